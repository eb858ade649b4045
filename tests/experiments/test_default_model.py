"""The shipped default backbone (mtpc/default_model/): every file matches the manifest, it loads
by name in seconds without training, it still scores its recorded held-out bits/byte on the
fixed 32 KiB slice, and a head made on another default is refused."""

from __future__ import annotations

import json
import time

import pytest
import torch
from transformers import LlamaForCausalLM

from experiments.pretraining.data import heldout_bits_per_byte, heldout_rows
from experiments.pretraining.files import METRICS_FILE
from mtpc import MtpcModel
from mtpc.backbones import load_backbone
from mtpc.backbones.shipped import MANIFEST, SHIPPED_DIR, default_label, verify_shipped
from mtpc.heads import HeadConfig, MtpcHead, save_head

METRICS = json.loads((SHIPPED_DIR / METRICS_FILE).read_text())


def test_every_file_matches_the_manifest_and_respects_the_size_limits():
    assert verify_shipped() == default_label()
    listed = json.loads((SHIPPED_DIR / MANIFEST).read_text())["files"]
    on_disk = {p.name for p in SHIPPED_DIR.iterdir() if p.is_file() and p.name != MANIFEST}
    assert set(listed) == on_disk  # nothing unlisted ships beside the weights
    shards = [p for p in SHIPPED_DIR.glob("*.safetensors")]
    assert 1 <= len(shards) <= 3
    assert all(p.stat().st_size < 16 * 2**20 for p in shards)
    assert sum(p.stat().st_size for p in shards) <= 40 * 2**20


def test_a_file_not_in_the_manifest_is_refused(tmp_path):
    import shutil

    from safetensors.torch import save_file

    folder = tmp_path / "default_model"
    shutil.copytree(SHIPPED_DIR, folder)
    verify_shipped(folder)
    save_file(
        {"w": torch.zeros(4)}, str(folder / "model.safetensors")
    )  # would be loaded under the verified label
    with pytest.raises(ValueError, match=r"model\.safetensors is not listed in MANIFEST\.json"):
        verify_shipped(folder)


def test_loads_by_name_in_seconds_as_float32():
    t0 = time.monotonic()
    bb = load_backbone("default")
    assert time.monotonic() - t0 < 60
    assert bb.name == default_label() and bb.dtype == torch.float32 and bb.vocab_size == 320
    assert load_backbone(default_label()).name == bb.name  # the label itself is a valid name


def test_scores_its_recorded_bits_per_byte_on_the_fixed_slice():
    model = LlamaForCausalLM.from_pretrained(SHIPPED_DIR, dtype=torch.float32)
    rows = heldout_rows(METRICS["slice_32k_rows"])
    assert rows.input_ids.shape == (METRICS["slice_32k_rows"], 2048)
    got = heldout_bits_per_byte(model, rows)["heldout_bits_per_byte"]
    assert got <= METRICS["slice_32k_bits_per_byte"] + 0.02


def test_a_head_made_on_another_default_is_refused(tmp_path):
    bb = load_backbone("default")
    cfg = HeadConfig(
        kind="cp",
        window=4,
        rank=2,
        vocab=bb.vocab_size,
        hidden=bb.hidden_size,
        lora_depth=0,
        backbone="default@deadbeef",
    )
    save_head(tmp_path / "stale", MtpcHead(cfg))
    with pytest.raises(
        ValueError, match=r"trained on backbone default@deadbeef, but the default backbone here is default@"
    ):
        MtpcModel.from_pretrained(tmp_path / "stale")
    with pytest.raises(ValueError, match=r"default@deadbeef"):
        MtpcModel.from_pretrained(tmp_path / "stale", backbone=bb)


@pytest.mark.parametrize("files", [["model-00001.safetensors"], None, {"config.json": 3}])
def test_a_manifest_whose_files_is_not_a_mapping_is_one_line(tmp_path, files):
    """`files` a list or null (a hand edit, a bad merge) was an AttributeError/TypeError traceback."""
    import shutil

    folder = tmp_path / "default_model"
    shutil.copytree(SHIPPED_DIR, folder)
    (folder / MANIFEST).write_text(json.dumps({"files": files}))
    with pytest.raises(ValueError) as err:
        verify_shipped(folder)
    msg = str(err.value)
    assert (
        str(folder / MANIFEST) in msg and "must map file names to SHA-256 digests" in msg and "\n" not in msg
    )
