"""The evaluation CLI's reliability cases (docs/reliability.md): bad flags refused in one line before
any weights load, a NaN temperature refused by `EvalConfig.check` (so a sweep's `--check` too), a
prompt past the backbone's context named by file:line with the numbers generation needs, a missing
MLflow parent run found before anything decodes, and a full disk at `--out` that loses no results."""

from __future__ import annotations

import json
import math

import pytest
import torch

import experiments.evaluation.decoding as evaluation
from experiments.evaluate import main
from experiments.evaluation.config import EvalConfig
from experiments.plumbing.parsing import Fail
from mtpc import MtpcModel
from tests.backbone_helpers import export_tiny_cp_head
from tests.faults import full_disk


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_rel")
    export_tiny_cp_head(root)
    (root / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in ["short", "x" * 450, "mid"]))
    return root


@pytest.fixture
def watched(monkeypatch):
    """What was loaded and decoded: nothing, for a command refused up front."""
    seen = {"loaded": 0, "decoded": 0}
    real_load, real_gen = MtpcModel.from_pretrained, evaluation._generate_interleaved

    def load(*a, **k):
        seen["loaded"] += 1
        return real_load(*a, **k)

    def gen(*a, **k):
        seen["decoded"] += 1
        return real_gen(*a, **k)

    monkeypatch.setattr(MtpcModel, "from_pretrained", staticmethod(load))
    monkeypatch.setattr(evaluation, "_generate_interleaved", gen)
    return seen


def _args(root, tmp_path, *more):
    return ["--head", str(root / "cp"), "--eval.prompts", str(root / "prompts.jsonl"), "--eval.n_prompts", "1",
            "--eval.modes", "greedy", "--eval.max_new_tokens", "6", "--out", str(tmp_path / "r.json"), "--no-progress",
            *more]  # fmt: skip


@pytest.mark.parametrize("flags, says", [
    (["--threads", "0"], "--threads 0: expected an integer >= 1"),
    (["--threads", "-2"], "--threads -2: expected an integer >= 1"),
    (["--device", "nonsense"], "--device 'nonsense': not a device"),
    (["--device", "cuda:99"], "--device cuda:99: "),
])  # fmt: skip
def test_bad_threads_or_device_are_one_line_before_anything_loads(
    exported, tmp_path, capsys, watched, flags, says
):
    """--threads 0 was a torch RuntimeError traceback; --device nonsense / cuda without a GPU failed
    while loading (or deep in it): now one line, exit 2, nothing loaded."""
    assert main(_args(exported, tmp_path, *flags)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err
    assert watched == {"loaded": 0, "decoded": 0}


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_one_line_before_anything_loads(exported, tmp_path, capsys, watched):
    assert main(_args(exported, tmp_path, "--device", "cuda")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--device cuda: no CUDA GPU on this machine" in err, err
    assert watched["loaded"] == 0


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_non_finite_temperature_is_refused_by_the_config_check(exported, tmp_path, capsys, watched, value):
    """`--temperature nan` passed every check and failed mid-decoding: EvalConfig.check now refuses
    it (NaN lies in no range), for the CLI and a sweep spec's --check alike."""
    with pytest.raises(ValueError, match="eval.temperatures: (nan|inf) out of range"):
        EvalConfig(temperatures=(1.0, value)).check(Fail("spec.yaml"))
    with pytest.raises(ValueError, match="eval.top_p: nan out of range"):
        EvalConfig(top_p=math.nan).check(Fail("spec.yaml"))
    assert (
        main(
            _args(exported, tmp_path, "--eval.temperatures", f"[1.0, {'.nan' if value != value else '.inf'}]")
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--eval.temperatures (command line): eval.temperatures:" in err, err
    assert watched == {"loaded": 0, "decoded": 0}
    from sweeps.spec import load_spec
    from tests.sweep_helpers import fixture_spec

    with pytest.raises(ValueError, match="eval.temperatures"):
        load_spec(fixture_spec(tmp_path, "nan"), env={}, overrides={"eval.temperatures": [value]})


def test_a_prompt_past_the_context_names_its_file_line_and_the_numbers(exported, tmp_path, capsys, watched):
    """It said `prompt (454) + max_new_tokens + window (1) = 515` (STP's window, no prompt named):
    now the prompt's index, set and file:line, and the head's window, before anything decodes."""
    rc = main(
        [
            "--head",
            str(exported / "cp"),
            "--eval.prompts",
            str(exported / "prompts.jsonl"),
            "--eval.n_prompts",
            "3",
            "--eval.modes",
            "greedy",
            "--eval.max_new_tokens",
            "60",
            "--out",
            str(tmp_path / "r.json"),
            "--no-progress",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert f"of set 0 ({exported / 'prompts.jsonl'}:2): 454 ids" in err, err
    assert (
        "+ eval.max_new_tokens 60 + window 4 = 518 exceeds the backbone's context of 512 positions" in err
    ), err
    assert watched["decoded"] == 0


def test_a_missing_mlflow_parent_run_is_refused_before_anything_decodes(exported, tmp_path, capsys, watched):
    """It was found only after the whole evaluation (results written, nothing logged, a traceback)."""
    mlflow = pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert (
        main(_args(exported, tmp_path, "--mlflow-parent-run", "0123abcd", "--mlflow-tracking-uri", uri)) == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--mlflow-parent-run 0123abcd: no MLflow store at" in err, err
    mlflow.tracking.MlflowClient(tracking_uri=uri).create_experiment("there")
    assert (
        main(_args(exported, tmp_path, "--mlflow-parent-run", "0123abcd", "--mlflow-tracking-uri", uri)) == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--mlflow-parent-run 0123abcd: no such run in" in err, err
    assert watched == {"loaded": 0, "decoded": 0} and not (tmp_path / "r.json").exists()


def test_a_full_disk_at_out_keeps_the_results_on_stdout(exported, tmp_path, capsys, monkeypatch):
    """The results were lost with an OSError traceback: now one line naming the path and the full
    disk, the results on stdout as JSON, exit 74."""
    disk = tmp_path / "disk"
    disk.mkdir()
    full_disk(monkeypatch, disk)
    out = disk / "r.json"
    rc = main(
        [
            "--head",
            str(exported / "cp"),
            "--eval.prompts",
            str(exported / "prompts.jsonl"),
            "--eval.n_prompts",
            "1",
            "--eval.modes",
            "greedy",
            "--eval.max_new_tokens",
            "6",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    captured = capsys.readouterr()
    assert rc == 74, captured.err
    first = captured.err.splitlines()[0]
    assert (
        first.startswith(f"error: {out}: no space left on device") and "results follow on stdout" in first
    ), first
    results = json.loads(captured.out)  # stdout holds the results alone
    assert results["runs"] and results["summary"] and results["config"]["eval"]["max_new_tokens"] == 6
    assert not out.exists()
