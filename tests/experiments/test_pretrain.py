"""Pre-training the embedded default: shipped configs validate, a tiny run saves a loadable model."""

import json

import pytest
import torch

import experiments.pretrain as pt
from mtpc.backbones import load_backbone
from mtpc.tokenizer import VOCAB_SIZE, ByteTokenizer

TINY = dict(
    hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64, max_context=128,
    seq_len=32, batch_size=4, max_steps=6, warmup_steps=2, heldout_rows=4, max_minutes=2.0,
)


@pytest.mark.parametrize("name", sorted(pt.CONFIGS))
def test_shipped_configs_validate(name):
    cfg = pt.load_config(pt.CONFIGS[name])
    assert cfg.hidden_size >= 512 and cfg.num_layers >= 4
    assert cfg.llama_config().vocab_size == VOCAB_SIZE


def test_bad_configs(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("hidden_size: 512\nwidth: 3\n")
    with pytest.raises(ValueError, match=r"c\.yaml: unknown key\(s\) \['width'\]"):
        pt.load_config(path)
    path.write_text("hidden_size: 100\nnum_heads: 8\n")
    with pytest.raises(ValueError, match=r"c\.yaml: hidden_size=100"):
        pt.load_config(path)
    path.write_text("seq_len: 9000\n")
    with pytest.raises(ValueError, match="seq_len=9000 exceeds max_context=4096"):
        pt.load_config(path)
    with pytest.raises(ValueError, match="no such file"):
        pt.load_config(tmp_path / "nope.yaml")
    with pytest.raises(SystemExit):  # argparse error naming the bad override
        pt.main(["--config", "cpu", "--set", "max_minutes=-1", "--out", str(tmp_path / "m")])
    assert pt.load_config(pt.CONFIGS["cpu"], max_minutes=30).max_minutes == 30


def _corpus(path, n=60):
    rows = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"count to {i % 7}"}, {"role": "assistant", "content": "1 2 3 4 5 6 7"[: 2 * (i % 7) + 1]}]
        rows.append(json.dumps({"id": f"c{i}_0", "messages": msgs}))
    path.write_text("\n".join(rows) + "\n")
    return path


def test_tiny_pretrain_saves_a_loadable_backbone(tmp_path, monkeypatch):
    cfg = pt.PretrainConfig(**TINY, train_data=str(_corpus(tmp_path / "d.jsonl")))
    out = tmp_path / "model"
    metrics = pt.pretrain(cfg, out)
    assert metrics["steps"] == 6 and 0 < metrics["heldout_bits_per_byte"] < 10
    assert {"model.safetensors", "config.json", "tokenizer_config.json", pt.METRICS_FILE} <= {p.name for p in out.iterdir()}
    bb = load_backbone(str(out), lora_depth=1)
    assert isinstance(bb.tokenizer, ByteTokenizer) and bb.vocab_size == VOCAB_SIZE and bb.eos_token_id == 258
    ids = torch.tensor([bb.tokenizer.render_prompt("count to 3")])
    assert bb.stp_logits(bb(ids).verify_hidden).shape == (1, ids.shape[1], VOCAB_SIZE)
    assert metrics["loss_curve"] and metrics["loss_curve"][-1]["step"] == 6 and metrics["git_sha"]
    # make pretrain's default output is reported, not retrained, unless --force
    monkeypatch.setenv("MTPC_CACHE_DIR", str(tmp_path / "cache"))
    made = tmp_path / "cache" / "models" / "pretrained"
    made.parent.mkdir(parents=True)
    out.rename(made)
    monkeypatch.setattr(pt, "pretrain", lambda *a, **k: pytest.fail("retrained an existing model"))
    assert pt.main(["--config", "cpu"]) == 0  # reports the existing model and exits


def test_ship_writes_shards_manifest_and_loads_by_label(tmp_path, monkeypatch):
    """A shipped directory: bf16 shards under the size limit, a manifest every file matches, the
    held-out score of the weights as loaded, and a label that changes with the weights."""
    from mtpc.backbones import shipped

    corpus = str(_corpus(tmp_path / "d.jsonl"))
    cfg = pt.PretrainConfig(**TINY, train_data=corpus, heldout_data=corpus)
    metrics = pt.pretrain(cfg, tmp_path / "trained")
    model = pt.LlamaForCausalLM.from_pretrained(tmp_path / "trained", dtype=torch.float32)
    monkeypatch.setattr(pt, "SHARD_BYTES", 20_000)  # force several shards on the tiny model
    dest = tmp_path / "ship"
    m = pt.ship(model, dest, metrics, rows=4)
    names = {p.name for p in dest.iterdir()}
    assert {"config.json", "tokenizer_config.json", pt.METRICS_FILE, pt.CARD_FILE, shipped.MANIFEST} <= names
    assert len([n for n in names if n.endswith(".safetensors")]) >= 2 and "model.safetensors.index.json" in names
    assert 0 < m["shipped_heldout_bits_per_byte"] < 10 and m["slice_32k_rows"] == 4
    label = shipped.verify_shipped(dest)
    assert label.startswith("default@") and len(label) == len("default@") + 8
    # the weights as loaded score what the metrics say
    loaded = pt.LlamaForCausalLM.from_pretrained(dest, dtype=torch.float32)
    again = pt.heldout_bits_per_byte(loaded, pt.heldout_rows(cfg, 4))
    assert again["heldout_bits_per_byte"] == pytest.approx(m["shipped_heldout_bits_per_byte"], rel=1e-6)
    # a changed shard is caught, naming the file
    shard = sorted(dest.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-1] + b"\0")
    with pytest.raises(ValueError, match=f"{shard.name} does not match its SHA-256"):
        shipped.verify_shipped(dest)
