"""Trials of several ranks without a cluster: the spec's per-trial resources (typed, checked before
anything is submitted, each refusal one line naming the key), the sbatch options `--submit`
requests, the worker's refusal of a SLURM job too small for one trial, the launch command (srun
under SLURM, Lightning's standalone launcher otherwise), and one 2-rank trial end to end on this
CPU (standalone launcher, gloo): COMPLETE with one MLflow parent run.
The real-SLURM runs are tests/sweeps/test_slurm_ddp.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments.training.launch import ProcessGroup, command
from sweeps.run import check_allocation, sbatch_resources
from sweeps.spec import SpecError, load_spec
from tests.sweep_helpers import REPO, check_complete_results, fresh_tracking_uri, run_cli, runs, trials

SMOKE = REPO / "sweeps" / "smoke.yaml"


def test_tasks_per_trial_sets_the_trials_devices_and_strategy():
    spec = load_spec(SMOKE, overrides={"slurm.tasks_per_trial": 2, "train.data.global_batch_size": 8})
    t = spec.train.trainer
    assert (t["devices"], t["num_nodes"], t["strategy"], t["accelerator"]) == (2, 1, "ddp", "cpu")
    assert spec.slurm.ranks == 2 and spec.train.accumulation() == 1
    one = load_spec(SMOKE)
    assert one.slurm.ranks == 1 and "strategy" not in one.train.trainer  # a one-rank trial is unchanged


@pytest.mark.parametrize(
    ("sets", "key"),
    [
        ({"slurm.tasks_per_trial": 2, "train.data.global_batch_size": 6}, "train.data.global_batch_size"),
        (
            {
                "slurm.tasks_per_trial": 2,
                "train.data.global_batch_size": 16,
                "train.trainer.accumulate_grad_batches": 3,
            },
            "train.trainer.accumulate_grad_batches",
        ),
        ({"slurm.gpus_per_trial": 4, "slurm.gpus_per_node": 2}, "slurm.gpus_per_trial"),
        (
            {"slurm.gpus_per_trial": 16, "slurm.nodes_per_trial": 2, "slurm.gpus_per_node": 4},
            "slurm.gpus_per_trial",
        ),
        ({"slurm.tasks_per_trial": 2, "train.trainer.strategy": "ddp_spawn"}, "train.trainer.strategy"),
        ({"slurm.tasks_per_trial": 2, "train.trainer.strategy": "fsdp"}, "train.trainer.strategy"),
        ({"train.trainer.strategy": "ddp_spawn"}, "train.trainer.strategy"),
        ({"train.trainer.devices": 2}, "train.trainer.devices"),
        ({"slurm.tasks_per_trial": 2, "train.trainer.devices": 4}, "train.trainer.devices"),
        ({"slurm.tasks_per_trial": 3, "slurm.nodes_per_trial": 2}, "slurm.nodes_per_trial"),
        ({"slurm.tasks_per_trial": 3, "slurm.gpus_per_trial": 2}, "slurm.tasks_per_trial"),
        ({"slurm.gpus_per_trial": 2}, "train.trainer.accelerator"),  # the debug config trains on the CPU
    ],
)
def test_resources_that_cannot_run_the_trial_are_refused_naming_the_key(sets, key):
    with pytest.raises(SpecError, match=f"key '{key}'") as err:
        load_spec(SMOKE, overrides=sets)
    assert "\n" not in str(err.value)


def test_check_refuses_in_one_line_before_any_store_is_touched(tmp_path):
    r = run_cli(
        [
            str(SMOKE),
            "--check",
            "--set",
            "slurm.tasks_per_trial=2",
            "--set",
            "train.data.global_batch_size=6",
            "--set",
            f"output_dir={tmp_path}/out",
        ],
        cwd=tmp_path,
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "key 'train.data.global_batch_size'" in r.stderr and "slurm: 2 rank(s) per trial" in r.stderr
    assert not (tmp_path / "out").exists()


def test_submit_requests_one_trials_nodes_tasks_and_gpus():
    spec = load_spec(
        SMOKE,
        overrides={
            "slurm.gpus_per_trial": 16,
            "slurm.nodes_per_trial": 2,
            "slurm.gpus_per_node": 8,
            "slurm.cpus_per_task": 8,
            "train.trainer.accelerator": "gpu",
        },
    )
    assert sbatch_resources(spec)[:5] == [
        "--array=0-1",
        "--nodes=2",
        "--ntasks=16",
        "--ntasks-per-node=8",
        "--cpus-per-task=8",
    ]
    assert "--gpus-per-node=8" in sbatch_resources(spec)
    assert sbatch_resources(load_spec(SMOKE))[:2] == ["--array=0-1", "--ntasks=1"]


def test_a_job_smaller_than_one_trial_stops_the_worker_naming_the_key():
    spec = load_spec(SMOKE, overrides={"slurm.tasks_per_trial": 2})
    with pytest.raises(SpecError, match="key 'slurm.tasks_per_trial'.*1 task"):
        check_allocation(spec, {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1", "SLURM_JOB_NUM_NODES": "1"})
    check_allocation(spec, {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_JOB_NUM_NODES": "1"})
    check_allocation(spec, {})  # not in SLURM: the ranks run on this machine


def test_launch_command_srun_under_slurm_else_the_plain_cli(tmp_path):
    srun = tmp_path / "bin" / "srun"
    srun.parent.mkdir()
    srun.write_text("#!/bin/sh\n")
    srun.chmod(0o755)
    cfg = tmp_path / "trial_config.yaml"
    env = {"SLURM_JOB_ID": "5", "SLURM_CPUS_PER_TASK": "4", "PATH": str(srun.parent)}
    cmd = command(
        ProcessGroup(ranks=4, nodes=2, gpus_per_node=2), cfg, mlflow_run_id="abc", resume=True, env=env
    )
    assert cmd[:8] == [
        "srun",
        "--nodes=2",
        "--ntasks=4",
        "--ntasks-per-node=2",
        "--cpus-per-task=4",
        "--kill-on-bad-exit=1",
        "--export=ALL",
        "--gpus-per-node=2",
    ]
    assert cmd[-7:] == ["fit", "--config", str(cfg), "--mlflow_run_id", "abc", "--ckpt_path", "last"]
    plain = command(
        ProcessGroup(ranks=2), cfg, mlflow_run_id=None, resume=False, env={"PATH": "/nonexistent"}
    )
    assert plain[1:] == ["-m", "experiments.train", "fit", "--config", str(cfg)]
    with pytest.raises(ValueError, match="slurm.nodes_per_trial"):
        command(
            ProcessGroup(ranks=2, nodes=2),
            cfg,
            mlflow_run_id=None,
            resume=False,
            env={"PATH": "/nonexistent"},
        )


@pytest.mark.slow
def test_two_rank_trial_on_this_cpu_one_parent_run(tmp_path):
    """`--task` with slurm.tasks_per_trial 2 outside SLURM: the worker starts the training CLI, whose
    Lightning launcher starts rank 1 (not a second worker); rank 0 logs into the worker's parent."""
    store = fresh_tracking_uri(tmp_path / "mlflow")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in ("Hello there!", "Count to five.")))
    study = "ddp-local"
    sets = [
        f"study={study}",
        f"output_dir={tmp_path}/out",
        f"mlflow.tracking_uri={store}",
        f"mlflow.experiment={study}",
        f"eval.prompts={prompts}",
        "eval.n_prompts=2",
        "eval.max_new_tokens=8",
        "slurm.tasks_per_trial=2",
        'space={"slices": {"one": {"circuit": ["cp"], "rank": [2], "window": [4], "lora_depth": [0]}}}',
    ]
    r = run_cli(
        [str(SMOKE), "--task", *[x for s in sets for x in ("--set", s)]],
        cwd=tmp_path,
        env={"OMP_NUM_THREADS": "1"},
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("worker done") == 1  # one worker: Lightning re-ran the training CLI, not the worker
    storage = f"journal:{tmp_path / 'out' / 'optuna.journal'}"
    (t,) = check_complete_results(storage, study, store, study)
    assert [x.state.name for x in trials(storage, study)] == ["COMPLETE"]
    parents = [p for p in runs(store, study) if "mlflow.parentRunId" not in p.data.tags]
    assert [p.info.run_id for p in parents] == [t.user_attrs["mlflow_parent_run_id"]]
    assert parents[0].data.params["world_size"] == "2" and "val_window_nll" in parents[0].data.metrics
    log = Path(tmp_path / "out" / "checkpoints" / study / "cp-r2-n4-k0" / "train.log").read_text()
    assert "Starting with 2 processes" in log
