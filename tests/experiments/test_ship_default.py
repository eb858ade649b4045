"""Shipping a pre-trained model as the repository's default: shards, manifest, the score as loaded."""

import pytest
import torch
from transformers import LlamaForCausalLM

import experiments.shipping.ship_default as sd
from experiments.pretraining.config import PretrainConfig
from experiments.pretraining.data import heldout_bits_per_byte, heldout_rows
from experiments.pretraining.files import METRICS_FILE
from experiments.pretraining.loop import pretrain
from tests.experiments.test_pretrain import TINY, _corpus


def test_ship_writes_shards_manifest_and_loads_by_label(tmp_path, monkeypatch):
    """A shipped directory: bf16 shards under the size limit, a manifest every file matches, the
    held-out score of the weights as loaded, and a label that changes with the weights."""
    from mtpc.backbones import shipped

    corpus = str(_corpus(tmp_path / "d.jsonl"))
    cfg = PretrainConfig(**TINY, train_data=corpus, heldout_data=corpus)
    metrics = pretrain(cfg, tmp_path / "trained")
    model = LlamaForCausalLM.from_pretrained(tmp_path / "trained", dtype=torch.float32)
    monkeypatch.setattr(sd, "SHARD_BYTES", 20_000)  # force several shards on the tiny model
    dest = tmp_path / "ship"
    m = sd.ship(model, dest, metrics, rows=4)
    names = {p.name for p in dest.iterdir()}
    assert {"config.json", "tokenizer_config.json", METRICS_FILE, sd.CARD_FILE, shipped.MANIFEST} <= names
    assert (
        len([n for n in names if n.endswith(".safetensors")]) >= 2 and "model.safetensors.index.json" in names
    )
    assert 0 < m["shipped_heldout_bits_per_byte"] < 10 and m["slice_32k_rows"] == 4
    label = shipped.verify_shipped(dest)
    assert label.startswith("default@") and len(label) == len("default@") + 8
    # the weights as loaded score what the metrics say
    loaded = LlamaForCausalLM.from_pretrained(dest, dtype=torch.float32)
    again = heldout_bits_per_byte(loaded, heldout_rows(4, train_data=corpus, heldout_data=corpus))
    assert again["heldout_bits_per_byte"] == pytest.approx(m["shipped_heldout_bits_per_byte"], rel=1e-6)
    # a changed shard is caught, naming the file
    shard = sorted(dest.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-1] + b"\0")
    with pytest.raises(ValueError, match=f"{shard.name} does not match its SHA-256"):
        shipped.verify_shipped(dest)
