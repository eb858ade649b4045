"""The real trial (experiments/training/trial.py) on the `tiny` backbone: train_head logs into the trial's
parent run, experiments.evaluate logs one evaluation run per (mode, prompt_set) through the one
writer (named `<grid key>/<mode>/set<i>`, with the `tracking.schema.EVAL_PARAMS` / `EVAL_METRICS`
names); a stop request checkpoints and raises (during training, and between prompt sets of the
evaluation), and the re-run resumes from that checkpoint and completes; the sweep runner runs it
end to end; every grid point's training config is validated before submission."""

from __future__ import annotations

import importlib.util
import json
import os
import statistics

import pytest

import tracking
from sweeps.trials import Preempted
from tests.sweep_helpers import fresh_tracking_uri

pytest.importorskip("lightning")
for _mod in ("experiments.train", "experiments.evaluate"):
    if importlib.util.find_spec(_mod) is None:
        pytest.skip(f"{_mod} not present", allow_module_level=True)

POINT = {"circuit": "cp", "rank": 2, "window": 4, "lora_depth": 0}
PROMPTS = ["Hello, how are you?", "Write a haiku about bytes.", "What is 2 + 2?", "Name a colour."]


@pytest.fixture
def prompts(tmp_path):
    p = tmp_path / "prompts.jsonl"
    p.write_text("".join(json.dumps(x) + "\n" for x in PROMPTS))
    return str(p)


@pytest.mark.slow
def test_run_trial_trains_evaluates_and_resumes(tmp_path, prompts, monkeypatch):
    from mlflow.tracking import MlflowClient

    from experiments.evaluation.config import EvalConfig
    from experiments.training import trial
    from experiments.training.config import load_config

    train = load_config("debug", {"trainer": {"max_epochs": 1}, "run": {"checkpoint_every_n_steps": 1}})
    uri = fresh_tracking_uri(tmp_path)
    exp_id = tracking.ensure_experiment(uri, "trial")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    ev = EvalConfig(modes=("greedy", "sample"), prompts=prompts, sets=2, n_prompts=2, max_new_tokens=8)
    parent = tracking.start_parent_run(uri, exp_id, "t0", params={}, tags={})
    ck = tmp_path / "ck"
    kw = {
        "mlflow_tracking_uri": uri,
        "mlflow_experiment_id": exp_id,
        "parent_run_name": "t0",
        "parent_run_id": parent,
        "checkpoint_dir": ck,
        "preempted_exc": Preempted,
    }
    # 1) a stop request after the first batch: checkpoint written, Preempted raised, nothing evaluated
    with pytest.raises(Preempted):
        trial.run_trial(train, POINT, ev, should_stop=lambda: True, **kw)
    assert (ck / "checkpoints" / "last.ckpt").is_file()
    assert not tracking.child_runs(uri, exp_id, parent, finished_only=False)
    # 2) a stop request during the evaluation (after its first prompt set): Preempted, nothing logged
    import experiments.evaluation.decoding as evaluate

    asked, real = {"stop": False}, evaluate._generate_interleaved

    def first_set_then_stop(*args, **kwargs):
        asked["stop"] = True
        return real(*args, **kwargs)

    monkeypatch.setattr(evaluate, "_generate_interleaved", first_set_then_stop)
    with pytest.raises(Preempted, match="evaluation stopped"):
        trial.run_trial(train, POINT, ev, should_stop=lambda: asked["stop"], **kw)
    assert (
        not tracking.child_runs(uri, exp_id, parent, finished_only=False)
        and not (ck / "evaluation.json").exists()
    )
    monkeypatch.setattr(evaluate, "_generate_interleaved", real)
    # 3) the re-run resumes from it and finishes: training params/metrics on the parent, 2 x 2 children
    trial.run_trial(train, POINT, ev, **kw)
    stored = tracking.child_runs(uri, exp_id, parent)  # the objective metrics, as the sweep reads them back
    out = {
        "throughput": statistics.fmean(k.data.metrics["throughput"] for k in stored),
        "greedy/mu_acc": statistics.fmean(
            k.data.metrics["mu_acc"] for k in stored if k.data.params["mode"] == "greedy"
        ),
    }
    assert out["throughput"] > 0 and 0 <= out["greedy/mu_acc"] <= 3
    run = MlflowClient(uri).get_run(parent)
    assert (run.data.params["circuit"], run.data.params["rank"], run.data.params["window"]) == (
        "cp",
        "2",
        "4",
    )
    assert "val_loss" in run.data.metrics or "train_loss" in run.data.metrics, run.data.metrics
    kids = tracking.child_runs(uri, exp_id, parent)
    assert sorted((k.data.params["mode"], k.data.params["prompt_set"]) for k in kids) == [
        ("greedy", "0"),
        ("greedy", "1"),
        ("sample", "0"),
        ("sample", "1"),
    ]
    assert sorted(k.info.run_name for k in kids) == [
        "cp-r2-n4-k0/greedy/set0",
        "cp-r2-n4-k0/greedy/set1",
        "cp-r2-n4-k0/sample/set0",
        "cp-r2-n4-k0/sample/set1",
    ]
    assert run.data.metrics["converged"] in (0.0, 1.0)  # the stopping rule was checked and logged
    for k in kids:
        assert k.data.params["circuit"] == "cp" and k.data.params["extra_token"] == "keep"
        assert (k.data.params["kl_beta"], k.data.params["train_seed"], k.data.params["eos"]) == (
            "0.0",
            "0",
            "banned",
        )
        assert k.data.params["converged"] == str(int(run.data.metrics["converged"]))
        assert {
            "mu_lat",
            "mu_acc",
            "tokens_per_cycle",
            "throughput",
            "max_throughput",
            "speedup_vs_stp",
        } <= set(k.data.metrics)
    assert (ck / "evaluation.json").is_file()
    assert "MLFLOW_TRACKING_URI" not in os.environ  # the trial put the environment back


def test_training_configs_of_every_point_are_validated_before_submission(tmp_path):
    from sweeps.spec import SpecError, load_spec
    from sweeps.study import validate_trial_configs

    smoke = "sweeps/smoke.yaml"
    assert validate_trial_configs(load_spec(smoke, env={}, overrides={"output_dir": str(tmp_path)})) == 5
    bad = load_spec(smoke, env={}, overrides={"output_dir": str(tmp_path), "train.model.lr": -1.0})
    with pytest.raises(SpecError, match=r"smoke.yaml: key 'train' \(grid point ff-r1-n4-k0\).*model.lr"):
        validate_trial_configs(bad)


@pytest.mark.slow
def test_sweep_runner_with_the_real_trial(tmp_path, prompts, monkeypatch):
    """sweeps/smoke.yaml as shipped (tiny backbone), one hmm grid point, in-process worker."""
    from mlflow.tracking import MlflowClient

    from sweeps import run
    from sweeps.spec import load_spec
    from tests.sweep_helpers import REPO, check_complete_results, trials

    monkeypatch.chdir(tmp_path)
    spec = load_spec(
        REPO / "sweeps" / "smoke.yaml",
        env={},
        overrides={
            "output_dir": str(tmp_path / "out"),
            "eval.prompts": prompts,
            "space.slices": {"one": {"circuit": ["hmm"], "rank": [2], "window": [4], "lora_depth": [1]}},
        },
    )
    fresh_tracking_uri(tmp_path)  # = the spec's default store, sqlite:///<cwd>/mlflow.db
    run.init(spec)
    assert run.worker(spec) == 0
    (t,) = trials(spec.storage, spec.study)
    assert t.state.name == "COMPLETE", t.user_attrs.get("error")
    check_complete_results(spec.storage, spec.study, spec.tracking_uri, spec.experiment)
    parent = MlflowClient(spec.tracking_uri).get_run(t.user_attrs["mlflow_parent_run_id"])
    assert parent.data.params["circuit"] == "hmm" and parent.data.params["lora_depth"] == "1"
    assert parent.data.params["data_source"] == "debug"
    assert parent.data.tags["mlflow.source.git.commit"] and "peak_mem_bytes" in parent.data.metrics
    assert t.values[0] > 0  # mean throughput over the stored children
