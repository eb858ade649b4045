"""Shipped heads (mtpc.shipped_heads, experiments.shipping.ship_head): written in bf16 with an index of
checksums, loaded by name with the default backbone, refused when anything in them changed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from experiments.shipping.ship_head import ship
from mtpc import MtpcModel
from mtpc import shipped_heads as sh
from mtpc.backbones.shipped import SHIPPED_DIR, verify_shipped
from mtpc.heads import HeadConfig, load_head, random_head, save_head


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    """A finished-run directory holding a random head for the default backbone, shipped into a
    temporary heads folder that `from_pretrained` reads."""
    label = verify_shipped(SHIPPED_DIR)
    run = tmp_path / "run"
    head = random_head(
        HeadConfig("btree", 4, 2, 320, 512, leaf_delta_rank=2), seed=0, init="unembedding", sum_std=0.5
    )
    head.config.backbone = label
    save_head(run / "head", head)
    config = {
        "model": {"kl_beta": 0.5, "kl_temperature": 1.0, "lr": 0.003},
        "data": {"batch_size": 2, "global_batch_size": 2, "seq_len": 512},
        "trainer": {"max_steps": 7},
        "run": {"export_dir": str(run / "head")},
    }
    (run / "run.json").write_text(json.dumps({"config": config}))
    (run / "metrics.json").write_text(json.dumps({"val/nll": 1.5, "train_seconds": 60.0}))
    heads = tmp_path / "heads"
    monkeypatch.setattr(sh, "HEADS_DIR", heads)
    ship(run, "tiny-btree", make_default=True, report_path=None, heads_dir=heads)
    return heads, head


def test_a_shipped_head_is_bf16_indexed_and_loads_as_default_with_the_default_backbone(shipped):
    heads, trained = shipped
    index = json.loads((heads / sh.INDEX_FILE).read_text())
    assert index["default"] == "tiny-btree" and index["backbone"] == verify_shipped(SHIPPED_DIR)
    assert sorted(index["heads"]["tiny-btree"]["files"]) == [
        "MODEL_CARD.md",
        "config.json",
        "head.safetensors",
    ]
    stored, _ = load_head(heads / "tiny-btree")
    assert {t.dtype for t in stored.state_dict().values()} == {torch.bfloat16}
    card = (heads / "tiny-btree" / sh.CARD_FILE).read_text()
    assert "btree, window n = 4, rank r = 2" in card and "7 optimizer steps of 2 x 512 bytes" in card
    model = MtpcModel.from_pretrained("default")
    assert model.head.config.kind == "btree" and next(model.head.parameters()).dtype == torch.float32
    for name, p in model.head.state_dict().items():  # float32 values of the bf16 storage
        assert torch.equal(p, trained.state_dict()[name].to(torch.bfloat16).float())
    assert MtpcModel.from_pretrained("shipped:tiny-btree").head.config.rank == 2
    out = model.generate("Hi", max_new_tokens=8, mode="greedy", ban_eos=True)
    assert (
        out.ids.tolist()
        == model.generate_plain("Hi", max_new_tokens=8, mode="greedy", ban_eos=True).ids.tolist()
    )


def test_a_changed_extra_or_missing_file_is_refused_naming_it(shipped):
    heads, _ = shipped
    folder = heads / "tiny-btree"
    card = folder / sh.CARD_FILE
    card.write_text(card.read_text() + "edited\n")
    with pytest.raises(ValueError, match=rf"{card}: SHA-256 differs from .*INDEX.json"):
        sh.resolve_head("default")
    card.unlink()
    (folder / "extra.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"not listed: \['extra.bin'\], missing: \['MODEL_CARD.md'\]"):
        MtpcModel.from_pretrained("default")


def test_shipped_names_and_local_folders_are_told_apart(shipped, tmp_path, monkeypatch):
    heads, _ = shipped
    with pytest.raises(
        ValueError, match=r"no shipped head of that name; shipped: \['tiny-btree'\] .*\./nope"
    ):
        sh.resolve_head("shipped:nope")
    monkeypatch.chdir(tmp_path)
    local = tmp_path / "default"
    save_head(local, random_head(HeadConfig("cp", 2, 2, 320, 512), seed=1, init="unembedding", sum_std=0.5))
    assert sh.resolve_head("default") == heads / "tiny-btree"  # the name is the shipped head
    assert sh.resolve_head("./default") == Path("./default")  # a path is the folder
    assert load_head(sh.resolve_head("./default"))[0].config.kind == "cp"


def test_a_head_of_another_backbone_or_too_large_is_not_shipped(tmp_path):
    def run_with(head, name):
        run = tmp_path / name
        save_head(run / "head", head)
        config = {
            "model": {"kl_beta": 0.0, "lr": 0.003},
            "data": {"batch_size": 2, "seq_len": 512},
            "trainer": {"max_steps": 1},
            "run": {"export_dir": str(run / "head")},
        }
        (run / "run.json").write_text(json.dumps({"config": config}))
        (run / "metrics.json").write_text("{}")
        return run

    other = random_head(HeadConfig("btree", 4, 2, 320, 512, leaf_delta_rank=2), seed=0)
    other.config.backbone = "tiny"
    with pytest.raises(ValueError, match="only heads of the shipped default@"):
        ship(run_with(other, "other"), "x", make_default=True, report_path=None, heads_dir=tmp_path / "heads")
    big = random_head(
        HeadConfig("btree", 4, 8, 320, 512, backbone="default"), seed=0
    )  # full leaves: 10.5 MB in bf16
    with pytest.raises(ValueError, match=r"MiB in bf16; a shipped head must stay under 8 MiB"):
        ship(run_with(big, "big"), "x", make_default=True, report_path=None, heads_dir=tmp_path / "heads")
    assert not (tmp_path / "heads" / "x").exists() and not (tmp_path / "heads" / sh.INDEX_FILE).exists()


def test_every_head_in_the_repository_verifies_and_fits_the_size_cap():
    names = sh.shipped_head_names()
    for name in names:
        folder = sh.resolve_head(f"shipped:{name}")
        assert sum(p.stat().st_size for p in folder.iterdir()) <= sh.MAX_HEAD_BYTES, name
    if names:
        assert sh.read_index()["default"] in names


def test_loading_the_default_prints_nothing(shipped, capfd):
    """The README's one line leaves the console quiet: no transformers 'Loading weights' bar (the
    library turns it off while a backbone loads, and restores the caller's setting)."""
    from transformers.utils import logging as hf_logging

    assert hf_logging.is_progress_bar_enabled()
    MtpcModel.from_pretrained("default")
    out, err = capfd.readouterr()
    assert out == "" and err == "", err[-500:]
    assert hf_logging.is_progress_bar_enabled()


def test_the_demo_line_reports_the_shipped_heads_speedup_in_both_modes(shipped, tmp_path, monkeypatch):
    import experiments.evaluation.prompts as prompts_module
    from sweeps.demo import shipped_head_line

    monkeypatch.setenv("MTPC_TIMING_LOCK", str(tmp_path / "timing.lock"))
    monkeypatch.setattr(
        prompts_module, "load_prompt_sets", lambda *a, **k: [["Hello there", "Tell me a story"]]
    )
    line = shipped_head_line(prompts=2, new_bytes=8)
    assert line.startswith(
        'shipped head tiny-btree (btree, n=4, r=2; MtpcModel.from_pretrained("default")): '
    )
    assert (
        "x plain decoding greedy (output identical on 2/2)" in line
        and "x sampled" in line
        and "\n" not in line
    )


def test_the_demo_line_without_a_shipped_head(tmp_path, monkeypatch):
    from sweeps.demo import shipped_head_line

    monkeypatch.setattr(sh, "HEADS_DIR", tmp_path / "none")
    assert shipped_head_line() == "shipped head: none in this installation"


def _report(draft_lens=(2, 4)):
    fig = {"speedup_median": 1.5, "speedup_rounds": [1.5, 1.4], "bytes_per_cycle": 2.0, "degenerate_fraction": 0.0,
           "distinct_4gram_ratio": 0.9, "identical": "3/3"}  # fmt: skip
    return {
        "command": "python bench/bench_shipped_head.py --draft-lens 2,4",
        "machine": "test machine",
        "prompts": "1 held-out sets x 3 prompts",
        "modes": {"greedy": {str(m): dict(fig, draft_len=m) for m in draft_lens}},
    }


def test_update_records_the_draft_len_the_shipped_head_then_decodes_with(shipped, tmp_path):
    from experiments.shipping.ship_head import main, update_shipped

    heads, _ = shipped
    assert sh.decode_defaults("default") == {}
    assert MtpcModel.from_pretrained("default").draft_len == 4  # the head's window
    report = tmp_path / "report.json"
    report.write_text(json.dumps(_report()))
    update_shipped("tiny-btree", report, draft_len=3, heads_dir=heads)
    assert sh.decode_defaults("default") == sh.decode_defaults("shipped:tiny-btree") == {"draft_len": 3}
    assert sh.decode_defaults(str(heads / "tiny-btree")) == {}  # a path: no shipped defaults
    card = (heads / "tiny-btree" / sh.CARD_FILE).read_text()
    assert "feeds the first **3** bytes" in card and "| greedy | 4 | 1.50x |" in card
    model = MtpcModel.from_pretrained("default")  # the card's new digest verifies
    assert model.draft_len == 3 and MtpcModel.from_pretrained("default", draft_len=4).draft_len == 4
    assert MtpcModel.from_pretrained(heads / "tiny-btree").draft_len == 4
    out = model.generate(torch.tensor([257, 72, 105]), max_new_tokens=6, ban_eos=True)
    assert out.stats.window == 3
    # re-measured again: one speed section, not two
    update_shipped("tiny-btree", report, heads_dir=heads)
    card = (heads / "tiny-btree" / sh.CARD_FILE).read_text()
    assert card.count("## Held-out speed") == 1 and "feeds the first **3** bytes" in card
    assert (
        "| greedy | 4 | 1.50x | 1.50, 1.40 | - | - | 2.00 |" in card
    )  # an older report: no decode-only figures
    decode = {"decode_speedup_median": 1.75, "decode_speedup_rounds": [1.75], "prefill_share_of_plain": 0.21}
    report.write_text(
        json.dumps(
            {**_report(), "modes": {"greedy": {"4": dict(_report()["modes"]["greedy"]["4"], **decode)}}}
        )
    )
    update_shipped("tiny-btree", report, heads_dir=heads)
    card = (heads / "tiny-btree" / sh.CARD_FILE).read_text()
    assert "| greedy | 4 | 1.50x | 1.50, 1.40 | 1.75x | 0.21 | 2.00 |" in card
    assert main(["--update", "tiny-btree", "--report", str(report), "--draft-len", "9"]) == 2


def test_a_malformed_decode_entry_is_refused(shipped):
    heads, _ = shipped
    path = heads / sh.INDEX_FILE
    index = json.loads(path.read_text())
    for bad in ({"draft_len": 1}, {"draft_len": True}, {"draft_len": "4"}, {"window": 4}, [4]):
        index["heads"]["tiny-btree"]["decode"] = bad
        path.write_text(json.dumps(index))
        with pytest.raises(ValueError, match=r"heads.tiny-btree.decode: expected"):
            sh.read_index(heads)
