"""The real trial (experiments/trial.py): train_head on the tiny backbone logs into the trial's parent
run; evaluation children per (mode, prompt_set) are read back; a stop request checkpoints and
raises, and the re-run resumes from that checkpoint.

The evaluation step here is a stand-in for `experiments.evaluate` (it logs child runs with the
DESIGN section 3 names and made-up numbers) unless the real module is importable; the training
step is the real one."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import types
from pathlib import Path

import pytest

from sweeps import tracking
from sweeps.objectives import Preempted
from tests.sweep_helpers import fresh_tracking_uri

pytest.importorskip("lightning")
if importlib.util.find_spec("experiments.train") is None:
    pytest.skip("experiments.train (training branch) not present", allow_module_level=True)

TRAIN = {"config": "debug", "circuit": "cp", "rank": 2, "window": 4, "lora_depth": 0,
         "trainer": {"max_epochs": 1}, "run": {"checkpoint_every_n_steps": 1}}
EVAL = {"modes": ["greedy", "sample"], "prompts": "heldout", "sets": 1, "n_prompts": 2, "max_new_tokens": 8}


def _stand_in_evaluate(uri: str, exp_id: str):
    calls = []

    def main(argv):
        a = dict(zip(argv[::2], argv[1::2], strict=True))
        calls.append(a)
        head = json.loads((Path(a["--head"]) / "config.json").read_text())  # the exported head's HeadConfig
        for i in range(int(a["--sets"])):
            tracking.log_child_run(
                uri, exp_id, a["--mlflow-parent-run"], f"eval-{a['--mode']}-{i}",
                params={"backbone": "tiny", "circuit": head["kind"], "window": head["window"], "rank": head["rank"],
                        "lora_depth": head["lora_depth"], "mode": a["--mode"],
                        "extra_token": "keep", "temperature": 1.0, "prompt_set": f"heldout-{i}", "seed": 0,
                        "hardware": "cpu", "top_p": 1.0},
                metrics={"mu_lat": 0.01, "mu_acc": 1.5, "tokens_per_cycle": 2.5, "throughput": 250.0, "max_throughput": 400.0},
            )
        return 0

    return types.SimpleNamespace(main=main), calls


@pytest.fixture
def store(tmp_path):
    uri = fresh_tracking_uri(tmp_path)
    return uri, tracking.ensure_experiment(uri, "trial")


@pytest.mark.slow
def test_run_trial_trains_logs_parent_and_children_and_resumes(tmp_path, store, monkeypatch):
    from experiments import trial

    uri, exp_id = store
    fake, calls = _stand_in_evaluate(uri, exp_id)
    monkeypatch.setitem(sys.modules, "experiments.evaluate", fake)
    import experiments

    monkeypatch.setattr(experiments, "evaluate", fake, raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    parent = tracking.start_parent_run(uri, exp_id, "t0", params={}, tags={})
    ck = tmp_path / "ck"
    # 1) a stop request after the first batch: checkpoint written, Preempted raised, no evaluation
    with pytest.raises(Preempted):
        trial.run_trial(TRAIN, EVAL, mlflow_tracking_uri=uri, mlflow_experiment_id=exp_id, parent_run_name="t0",
                        parent_run_id=parent, checkpoint_dir=ck, should_stop=lambda: True, preempted_exc=Preempted)
    assert (ck / "checkpoints" / "last.ckpt").is_file() and not calls
    # 2) the re-run resumes from it and finishes: training params/metrics on the parent, 2 children
    out = trial.run_trial(TRAIN, EVAL, mlflow_tracking_uri=uri, mlflow_experiment_id=exp_id, parent_run_name="t0",
                          parent_run_id=parent, checkpoint_dir=ck, preempted_exc=Preempted)
    assert [c["--mode"] for c in calls] == ["greedy", "sample"]
    assert out["throughput"] == 250.0 and out["greedy/throughput"] == 250.0
    from mlflow.tracking import MlflowClient

    run = MlflowClient(uri).get_run(parent)
    assert run.data.params["circuit"] == "cp" and run.data.params["rank"] == "2" and run.data.params["window"] == "4"
    assert any(k.startswith(("train", "val")) for k in run.data.metrics), run.data.metrics
    assert len(tracking.child_runs(uri, exp_id, parent)) == 2
    assert "MLFLOW_TRACKING_URI" not in os.environ  # the trial put the environment back


def test_training_configs_of_every_point_are_validated_before_submission(tmp_path):
    from sweeps.run import validate_trial_configs
    from sweeps.spec import SpecError, load_spec

    smoke = "sweeps/smoke.yaml"
    assert validate_trial_configs(load_spec(smoke, env={}, overrides={"output_dir": str(tmp_path)})) == 5
    bad = load_spec(smoke, env={}, overrides={"output_dir": str(tmp_path), "train.model.lr": -1.0})
    with pytest.raises(SpecError, match=r"smoke.yaml: key 'train' \(grid point ff-r1-n4-k0\).*model.lr"):
        validate_trial_configs(bad)


@pytest.mark.slow
def test_sweep_runner_with_the_real_trial(tmp_path, monkeypatch):
    """sweeps/smoke.yaml, one grid point, objective `trial`, in-process worker."""
    from sweeps import run
    from sweeps.spec import load_spec
    from tests.sweep_helpers import check_complete_results, trials

    monkeypatch.chdir(tmp_path)
    spec = load_spec(f"{run.__file__.rsplit('/', 2)[0]}/sweeps/smoke.yaml", env={}, overrides={
        "output_dir": str(tmp_path / "out"), "space.slices": {"one": {"circuit": ["hmm"], "rank": [2], "window": [4], "lora_depth": [0]}},
    })
    fresh_tracking_uri(tmp_path / "out")  # = the spec's default store, sqlite:///<output_dir>/mlflow.db
    run.init(spec)
    exp_id = run._experiment_id(spec, None)
    fake, calls = _stand_in_evaluate(spec.tracking_uri, exp_id)
    monkeypatch.setitem(sys.modules, "experiments.evaluate", fake)
    import experiments

    monkeypatch.setattr(experiments, "evaluate", fake, raising=False)
    assert run.worker(spec) == 0
    (t,) = trials(spec.storage, spec.study)
    assert t.state.name == "COMPLETE", t.user_attrs.get("error")
    check_complete_results(spec.storage, spec.study, spec.tracking_uri, spec.experiment)
    from mlflow.tracking import MlflowClient

    parent = MlflowClient(spec.tracking_uri).get_run(t.user_attrs["mlflow_parent_run_id"])
    assert parent.data.params["circuit"] == "hmm" and parent.data.params["data_source"] == "debug"
    assert parent.data.tags["mlflow.source.git.commit"] and "peak_mem_bytes" in parent.data.metrics
