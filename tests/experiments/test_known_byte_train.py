"""Training a known-byte head (`model.known_byte: true`) on the CPU debug config.

The head's E starts as the backbone's input embedding; a debug fit lowers the loss, reports
position 1 as not scored (val_nll_1 / val_kl_1 NaN; the window NLL and bits per byte over
positions 2..n), E trains, and the export records known_byte and reloads to the same outputs.
"""

from __future__ import annotations

import json
import math

import torch
from lightning.pytorch.callbacks import Callback

from experiments.training.fit import train_head
from experiments.training.module import MtpcTrainModule, input_embedding
from mtpc.heads import load_head


def test_known_embedding_starts_as_the_backbones_input_embedding():
    m = MtpcTrainModule(backbone="tiny", circuit="cp", window=3, rank=2, known_byte=True)
    E = m.backbone.model.get_input_embeddings().weight[: m.backbone.vocab_size]
    assert m.head.config.known_byte and m.head.config.first_scored == 2
    torch.testing.assert_close(m.head.known_embedding, E.float(), rtol=0, atol=0)
    assert input_embedding(m.backbone).shape == (m.backbone.vocab_size, m.backbone.hidden_size)
    assert not hasattr(
        MtpcTrainModule(backbone="tiny", circuit="cp", window=3, rank=2).head, "known_embedding"
    )


def test_debug_fit_of_a_known_byte_head(tmp_path):
    losses = []

    class Record(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    res = train_head("debug", {"model.known_byte": True}, run_dir=tmp_path, callbacks=[Record()])
    n = res.model.head.config.window
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.8 * first, (first, last)
    m = res.metrics
    assert math.isnan(m["val_nll_1"]) and math.isnan(m["val_kl_1"])  # position 1 is the input: not scored
    nll = [m[f"val_nll_{j}"] for j in range(2, n + 1)]
    assert all(math.isfinite(x) and x > 0 for x in nll) and math.isfinite(m["val_loss"])
    assert abs(m["val_window_nll"] - sum(nll)) < 1e-4
    assert abs(m["val_bits_per_byte"] - sum(nll) / (n - 1) / math.log(2)) < 1e-4
    E0 = input_embedding(res.model.backbone).float()
    assert (res.model.head.known_embedding - E0).abs().max() > 1e-4  # E trained
    config = json.loads((res.head_dir / "config.json").read_text())
    assert config["known_byte"] is True and config["format_version"] == 2
    head, _ = load_head(res.head_dir)
    e, c = torch.randn(3, res.model.backbone.hidden_size), torch.tensor([5, 97, 300])
    with torch.no_grad():
        want, got = res.model.head(e, c), head(e, c)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)


def test_known_byte_enters_the_run_identity_only_when_set():
    """A config written before the option existed keeps its identity (stored studies resume); setting
    the option makes it another run."""
    from experiments.plumbing.run_dir import config_hash
    from experiments.training.config import load_config

    base = load_config("debug").to_dict()
    before = {**base, "model": {k: v for k, v in base["model"].items() if k != "known_byte"}}
    assert config_hash(base) == config_hash(before)
    on = load_config("debug", {"model.known_byte": True}).to_dict()
    assert config_hash(on) != config_hash(base)
