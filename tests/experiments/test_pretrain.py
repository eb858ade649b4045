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
    # ensure_default_model finds an existing model without training again
    monkeypatch.setenv("MTPC_CACHE_DIR", str(tmp_path / "cache"))
    default = tmp_path / "cache" / "models" / "default"
    default.parent.mkdir(parents=True)
    out.rename(default)
    monkeypatch.setattr(pt, "pretrain", lambda *a, **k: pytest.fail("retrained an existing model"))
    assert pt.ensure_default_model() == default
    assert load_backbone("default").name == "default"
    assert pt.main(["--config", "cpu"]) == 0  # reports the existing model and exits
