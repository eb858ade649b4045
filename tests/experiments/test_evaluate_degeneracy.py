"""Degeneracy metrics in experiments/evaluation/decoding.py: every run (and STP) carries degenerate_fraction and
distinct_4gram_ratio computed from its own answers, for greedy and sampling, EOS banned and allowed;
greedy speculative answers equal STP's, so their degeneracy must agree; the > 0.25 warning; the
`eos` child-run param; the per-prompt records (and their artifact) that pool back to the metrics."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from experiments.evaluate import main
from experiments.evaluation.config import EvalConfig
from experiments.evaluation.decoding import degeneracy_warnings, evaluate_heads, log_evaluation_to_mlflow
from mtpc import MtpcModel
from mtpc.textstats import degeneracy_metrics
from mtpc.tokenizer import ByteTokenizer
from tests.backbone_helpers import export_tiny_cp_head
from tracking.schema import DEGENERACY_METRICS


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("degeneracy")
    export_tiny_cp_head(root)
    return root


def test_every_run_and_stp_carry_degeneracy_for_both_modes_and_eos(model_dir):
    m = MtpcModel.from_pretrained(model_dir / "cp")
    res = evaluate_heads(
        m,
        [["one", "two"], ["three"]],
        EvalConfig(max_new_tokens=40, eos=("banned", "allowed"), acceptance="online"),
        progress=False,
    )
    assert {(r["mode"], r["eos"]) for r in res["runs"]} == {
        (a, b) for a in ("greedy", "sample") for b in ("banned", "allowed")
    }
    stp = {(mode, s["eos"], s["prompt_set"]): s for mode, rows in res["stp"].items() for s in rows}
    for r in res["runs"]:
        mt = r["metrics"]
        for k in DEGENERACY_METRICS:
            assert 0.0 <= mt[k] <= 1.0 and mt[f"stp_{k}"] == stp[(r["mode"], r["eos"], r["prompt_set"])][k]
        if r["eos"] == "banned":
            assert mt["generated"] == 40 * (2 if r["prompt_set"] == 0 else 1)
        if r["mode"] == "greedy":  # exact: the same bytes as plain greedy decoding, so the same degeneracy
            assert all(mt[k] == mt[f"stp_{k}"] for k in DEGENERACY_METRICS)
    # the numbers are those of the answers: recompute one from a fresh generation
    out = m.generate(m.encode_prompt("three"), max_new_tokens=40, mode="greedy", seed=0, ban_eos=True)
    greedy_set1 = next(
        r for r in res["runs"] if (r["mode"], r["eos"], r["prompt_set"]) == ("greedy", "banned", 1)
    )
    assert degeneracy_metrics([ByteTokenizer().decode(out.ids.tolist())]) == {
        k: greedy_set1["metrics"][k] for k in DEGENERACY_METRICS
    }
    assert {(s["mode"], s["eos"]) for s in res["summary"]} == {
        (a, b) for a in ("greedy", "sample") for b in ("banned", "allowed")
    }
    assert set(res["summary"][0]["degenerate_fraction"]) == {"mean", "std"}
    for r in res[
        "runs"
    ]:  # per-prompt records pool back to the set's metrics, prompts in the same order as STP's
        pp, mt = r["per_prompt"], r["metrics"]
        assert sum(x["accepted"] for x in pp) / sum(x["cycles"] for x in pp) == pytest.approx(mt["mu_acc"])
        assert sum(x["degenerate"] for x in pp) / len(pp) == mt["degenerate_fraction"]
        stp_pp = stp[(r["mode"], r["eos"], r["prompt_set"])]["per_prompt"]
        assert [x["prompt_sha"] for x in pp] == [x["prompt_sha"] for x in stp_pp]
    with pytest.raises(ValueError, match="eval.eos: 'sometimes'"):
        evaluate_heads(m, [["one"]], EvalConfig(eos=("sometimes",)), progress=False)


def test_warning_above_a_quarter_degenerate():
    row = {
        "head": "head",
        "circuit": "cp",
        "window": 4,
        "mode": "greedy",
        "extra_token": "keep",
        "eos": "banned",
    }
    assert degeneracy_warnings([{**row, "degenerate_fraction": {"mean": 0.25, "std": 0.0}}]) == []
    (line,) = degeneracy_warnings([{**row, "degenerate_fraction": {"mean": 0.5, "std": 0.0}}])
    assert "degenerate_fraction 0.50 > 0.25" in line and "greedy/keep/eos banned" in line
    assert degeneracy_warnings([row]) == []  # not measured: nothing to say


def test_cli_eos_both_and_warning_agrees_with_the_json(model_dir, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(f"question {i}") for i in range(2)) + "\n")
    out = tmp_path / "r.json"
    rc = main(
        [
            "--head",
            str(model_dir / "cp"),
            "--eval.prompts",
            str(prompts),
            "--eval.n_prompts",
            "2",
            "--eval.sets",
            "1",
            "--eval.max_new_tokens",
            "140",
            "--eval.modes",
            "greedy",
            "--eval.eos",
            "banned,allowed",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    res = json.loads(out.read_text())
    assert res["config"]["eos"] == ["banned", "allowed"]
    flagged = [s for s in res["summary"] if s["degenerate_fraction"]["mean"] > 0.25]
    assert captured.err.count("measured on looping text") == len(flagged)
    assert "degenerate_fraction" in captured.out
    assert (
        main(
            [
                "--head",
                str(model_dir / "cp"),
                "--eval.prompts",
                str(prompts),
                "--eval.eos",
                "never",
                "--out",
                str(out),
            ]
        )
        == 2
    )
    assert "--eval.eos" in capsys.readouterr().err


def test_mlflow_child_runs_carry_eos_and_degeneracy(model_dir, tmp_path):
    mlflow = pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    parent = client.create_run(client.create_experiment("deg"), run_name="trial").info.run_id
    m = MtpcModel.from_pretrained(model_dir / "cp")
    res = evaluate_heads(
        m,
        [["one"]],
        EvalConfig(modes=("greedy",), max_new_tokens=8, eos=("banned", "allowed"), acceptance="online"),
        progress=False,
    )
    ids = log_evaluation_to_mlflow(res, parent, tracking_uri=uri)
    runs = [client.get_run(r).data for r in ids]
    assert sorted(r.params["eos"] for r in runs) == ["allowed", "banned"]
    assert all(
        {"degenerate_fraction", "distinct_4gram_ratio", "stp_degenerate_fraction"} <= set(r.metrics)
        for r in runs
    )
    art = client.download_artifacts(ids[0], "per_prompt.json", str(tmp_path))
    assert json.loads(open(art).read())["per_prompt"][0]["prompt"] == 0


def test_without_stp_the_heads_alone_and_named_sets(model_dir):
    m = MtpcModel.from_pretrained(model_dir / "cp")
    e = EvalConfig(modes=("sample",), max_new_tokens=12, acceptance="online")
    with_stp = evaluate_heads(m, [["one"], ["two"]], e, progress=False, set_names=["0", "dev0"])
    alone = evaluate_heads(
        m, [["one"], ["two"]], replace(e, stp=False), progress=False, set_names=["0", "dev0"]
    )
    assert [r["prompt_set"] for r in alone["runs"]] == ["0", "dev0"] and alone["stp"] == {"sample": []}
    for a, b in zip(alone["runs"], with_stp["runs"], strict=True):
        assert not any(k.startswith("stp_") or k == "speedup_vs_stp" for k in a["metrics"])
        assert a["metrics"]["mu_acc"] == b["metrics"]["mu_acc"]  # the same seeded generations
    with pytest.raises(ValueError, match="set_names"):
        evaluate_heads(m, [["one"]], e, set_names=["0", "1"], progress=False)


def test_an_evaluation_times_only_while_it_holds_the_machine_wide_lock(model_dir, tmp_path, monkeypatch):
    """Another process holds the timing lock: evaluate_heads waits (timing nothing) until it lets go."""
    import subprocess
    import sys
    import threading
    import time

    lock = tmp_path / "timing.lock"
    monkeypatch.setenv("MTPC_TIMING_LOCK", str(lock))
    held, release = tmp_path / "held", tmp_path / "release"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, time, pathlib; from filelock import FileLock\n"
                f"with FileLock({str(lock)!r}):\n"
                f"    pathlib.Path({str(held)!r}).touch()\n"
                f"    while not pathlib.Path({str(release)!r}).exists(): time.sleep(0.05)\n"
            ),
        ]
    )
    try:
        deadline = time.monotonic() + 60
        while not held.exists():
            assert holder.poll() is None and time.monotonic() < deadline, "the lock holder did not start"
            time.sleep(0.05)
        m = MtpcModel.from_pretrained(model_dir / "cp")
        done: list[dict] = []
        e = EvalConfig(modes=("greedy",), max_new_tokens=8, acceptance="online")
        t = threading.Thread(target=lambda: done.append(evaluate_heads(m, [["one"]], e, progress=False)))
        t.start()
        t.join(5.0)  # ample for this evaluation alone (well under a second)
        assert t.is_alive() and not done  # blocked on the lock, not timing beside the other process
        release.touch()
        t.join(120)
        assert done and done[0]["runs"]
    finally:
        release.touch()
        holder.wait(30)


def test_the_offline_pass_holds_the_timing_lock(model_dir, tmp_path, monkeypatch):
    """The offline acceptance decodes every prompt (heavy, untimed): it must hold the machine-wide
    timing lock while it runs, so that no other trial's latency is timed beside it; shared, so that
    other trials' training (and decoding) is not held up meanwhile."""
    import subprocess
    import sys

    import experiments.evaluation.decoding as ev

    lock = tmp_path / "timing.lock"
    monkeypatch.setenv("MTPC_TIMING_LOCK", str(lock))
    probe = f"from filelock import FileLock, Timeout\ntry:\n    FileLock({str(lock)!r}).acquire(timeout=0)\nexcept Timeout:\n    raise SystemExit(3)\n"
    shared = (
        "import fcntl, os, sys\nfd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\ntry:\n"
        "    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)\nexcept BlockingIOError:\n    raise SystemExit(3)\n"
    )
    seen, trains = [], []
    real = ev._offline

    def offline_probing(*args, **kwargs):
        seen.append(
            subprocess.run([sys.executable, "-c", probe], timeout=60).returncode
        )  # another process tries the lock
        trains.append(
            subprocess.run([sys.executable, "-c", shared, str(lock)], timeout=60).returncode
        )  # a trainer's check
        return real(*args, **kwargs)

    monkeypatch.setattr(ev, "_offline", offline_probing)
    m = MtpcModel.from_pretrained(model_dir / "cp")
    out = evaluate_heads(
        m, [["one"], ["two"]], EvalConfig(modes=("greedy",), max_new_tokens=8), progress=False
    )
    assert out["runs"] and seen == [3, 3]  # held for every set's offline pass
    assert trains == [0, 0]  # shared: training elsewhere goes on
    assert subprocess.run([sys.executable, "-c", probe], timeout=60).returncode == 0  # and let go afterwards
