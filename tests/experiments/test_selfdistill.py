"""Self-distillation data on the tiny debug backbone: answers are the backbone's own plain sampled
decoding (same bytes as generate_plain with seed + i), the cache file resumes after a kill (a half
line dropped, finished answers not regenerated), other settings get another file, and training
reads it beside the main source."""

from __future__ import annotations

import json

import pytest

from experiments.training import selfdistill
from experiments.training.fit import check_config, train_head


def test_answers_are_the_backbones_plain_samples_and_resume(tmp_path, monkeypatch):
    path, counts = selfdistill.build(
        "tiny", "debug", 4, temperature=0.8, max_new_tokens=24, seed=5, cache=tmp_path, progress=False
    )
    assert path.parent == tmp_path / "selfdistill" and path.name == "tiny-debug-T0.8-n24-s5.jsonl"
    assert counts["written"] == 4 and counts["already_done"] == 0
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    prompts = selfdistill.training_prompts("debug", 4)
    assert [r["id"] for r in recs] == [f"{i}#self" for i, _ in prompts]
    assert [r["messages"][0]["content"] for r in recs] == [t for _, t in prompts]
    # the answer is exactly what plain decoding of the same backbone gives with seed + i
    from experiments.training.module import build_backbone
    from mtpc import MtpcModel

    model = MtpcModel.from_components(build_backbone("tiny", 0), {"kind": "ff", "window": 2})
    again = model.generate_plain(prompts[2][1], max_new_tokens=24, mode="sample", temperature=0.8, seed=7)
    assert recs[2]["messages"][1]["content"] == again.text and recs[2]["seed"] == 7
    # a killed run: the last line half written; the rerun drops it and writes only that answer
    data = path.read_bytes()
    path.write_bytes(data[: data.rfind(b"\n", 0, len(data) - 1) + 1] + b'{"id": "half')
    calls = []
    real = MtpcModel.generate_plain
    monkeypatch.setattr(
        MtpcModel, "generate_plain", lambda self, *a, **k: calls.append(1) or real(self, *a, **k)
    )
    path2, counts = selfdistill.build(
        "tiny", "debug", 4, temperature=0.8, max_new_tokens=24, seed=5, cache=tmp_path, progress=False
    )
    assert (
        path2 == path
        and counts
        == {"written": 1, "already_done": 3, "skipped_too_long": 0, "truncated": counts["truncated"]}
        and len(calls) == 1
    )
    assert [json.loads(line) for line in path.read_text().splitlines()] == recs
    # more conversations extend the same file; other settings refuse a file written with these
    _, counts = selfdistill.build(
        "tiny", "debug", 6, temperature=0.8, max_new_tokens=24, seed=5, cache=tmp_path, progress=False
    )
    assert counts["written"] == 2 and counts["already_done"] == 4
    with pytest.raises(ValueError, match="other settings"):
        selfdistill.build(
            "tiny", "debug", 2, temperature=0.5, max_new_tokens=24, seed=5, out=path, progress=False
        )


def test_training_reads_it_beside_the_main_source(tmp_path):
    path, _ = selfdistill.build("tiny", "debug", 3, max_new_tokens=16, cache=tmp_path, progress=False)
    res = train_head(
        "debug", {"data.extra_train_source": str(path), "trainer.max_steps": 2}, run_dir=tmp_path / "run"
    )
    assert res.config["data"]["extra_train_source"] == str(path)
    from experiments.training.datamodule import ChatDataModule

    rows = {}
    for extra in (None, str(path)):
        dm = ChatDataModule(source="debug", seq_len=64, val_fraction=0.2, extra_train_source=extra)
        dm.setup()
        rows[extra] = (int(dm.train_rows.score_mask.sum()), len(dm.val_rows))
    assert (
        rows[str(path)][0] > rows[None][0] and rows[str(path)][1] == rows[None][1]
    )  # more training, same validation
    with pytest.raises(ValueError, match="data.extra_train_source"):
        check_config("debug", {"data.extra_train_source": str(tmp_path / "missing.jsonl")})


def test_cli(tmp_path, capsys):
    out = tmp_path / "a.jsonl"
    assert (
        selfdistill.main(
            [
                "--backbone",
                "tiny",
                "--source",
                "debug",
                "--conversations",
                "2",
                "--max-new-tokens",
                "8",
                "--out",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    assert len(out.read_text().splitlines()) == 2 and str(out) in capsys.readouterr().out
    assert (
        selfdistill.main(
            ["--backbone", "tiny", "--source", "debug", "--conversations", "0", "--out", str(out)]
        )
        == 2
    )
