"""DDP under the real one-node SLURM cluster (tests/sweeps/conftest.py), gloo on 2 CPUs.

- One head trained by `srun` with 2 tasks x 1 CPU (`--ntasks-per-node=2`: Lightning refuses a bare
  `--ntasks`), end to end into MLflow: one run, not two (only rank 0 makes the logger).
- A sweep trial of 2 ranks (`slurm.tasks_per_trial: 2`: the worker starts the ranks as an `srun`
  step inside its array task) pre-empted mid-training (SIGUSR1 to the batch shell, as the
  pre-emption warning does): the worker forwards it, both ranks checkpoint at the same step, the
  task is requeued, the requeued worker resumes the same trial from that checkpoint, and it
  finishes once, with one MLflow parent run. The ranks run `tests/ddp_run.py` (the training CLI
  with test-only hooks: a sleep per step, rank 0 records every step) through
  `MTPC_TRIAL_TRAIN_SCRIPT`.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from sweeps.liveness import Owner
from tests.sweep_helpers import REPO, check_complete_results, runs, trials
from tests.sweeps.test_slurm_sweep import _logs, _sh, _wait_done

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def test_srun_two_tasks_train_one_head_into_one_mlflow_run(cluster, store, tmp_path):
    run_dir = tmp_path / "run"
    train = (
        f"srun {sys.executable} -m experiments.train fit --config experiments/configs/debug.yaml "
        f"--trainer.devices 2 --trainer.strategy ddp --trainer.max_steps 4 --run.tracking true "
        f"--run.tracking_uri {store} --run.experiment srun-ddp --run.dir {run_dir}"
    )
    job = _sh(
        cluster,
        "sbatch",
        "--parsable",
        "--nodes=1",
        "--ntasks=2",
        "--ntasks-per-node=2",
        "--cpus-per-task=1",
        f"--output={tmp_path}/slurm-%j.out",
        "--wrap",
        train,
    )
    _wait_done(cluster, job, 300)
    out = _logs(tmp_path)
    assert "Starting with 2 processes" in out and out.count("head exported to") == 1, out[-3000:]
    (run,) = runs(store, "srun-ddp")  # one run: rank 1 made no logger
    assert run.info.status == "FINISHED", out[-3000:]
    assert run.data.params["world_size"] == "2" and run.data.params["global_batch_size"] == "8"
    assert run.data.metrics["peak_mem_bytes"] > 0 and "val_window_nll" in run.data.metrics
    assert json.loads((run_dir / "metrics.json").read_text())["global_step"] == 4
    assert (run_dir / "head" / "head.safetensors").is_file()


def _steps(record: Path) -> list[int]:
    return [json.loads(line)["step"] for line in record.read_text().splitlines()] if record.exists() else []


def test_two_rank_trial_preempted_resumes_from_its_checkpoint_and_finishes_once(cluster, store, tmp_path):
    study = "slurm-ddp-trial"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps(p) + "\n" for p in ("Hello there!", "Count to five.", "Why is the sky blue?"))
    )
    record, step_file = tmp_path / "steps.jsonl", tmp_path / "step"
    env = {
        **cluster["env"],
        "MTPC_TRIAL_TRAIN_SCRIPT": str(REPO / "tests" / "ddp_run.py"),
        "MTPC_TEST_STEP_SLEEP": "1",
        "MTPC_TEST_STEP_FILE": str(step_file),
        "MTPC_TEST_RECORD": str(record),
    }
    c = {**cluster, "env": env}
    sets = [
        f"study={study}",
        f"output_dir={tmp_path}/out",
        f"mlflow.tracking_uri={store}",
        f"mlflow.experiment={study}",
        f"eval.prompts={prompts}",
        "eval.n_prompts=2",
        "eval.max_new_tokens=8",
        "slurm.tasks_per_trial=2",
        "train.data.batch_size=2",
        "train.trainer.max_epochs=2",  # 4 rows per step: 12 steps of >= 1 s
        'space={"slices": {"one": {"circuit": ["cp"], "rank": [2], "window": [4], "lora_depth": [0]}}}',
    ]
    job = _sh(
        c,
        "sbatch",
        "--parsable",
        "--array=0-0",
        "--nodes=1",
        "--ntasks=2",
        "--ntasks-per-node=2",
        "--cpus-per-task=1",
        f"--output={tmp_path}/slurm-%A_%a.out",
        str(REPO / "slurm" / "sweep.sh"),
        "sweeps/smoke.yaml",
        *[x for s in sets for x in ("--set", s)],
    ).split(";")[0]
    task = f"{job}_0"
    deadline = time.time() + 240
    while time.time() < deadline and not (
        step_file.exists() and step_file.read_text().strip() and int(step_file.read_text()) >= 3
    ):
        time.sleep(0.3)
    assert step_file.exists() and int(step_file.read_text()) >= 3, _logs(tmp_path)[-3000:]
    _sh(c, "scancel", "--signal=USR1", "--batch", task)  # the pre-emption warning, to the batch shell only
    deadline = time.time() + 90
    state = ""
    while time.time() < deadline:
        state = _sh(c, "squeue", "-h", "-j", task, "-o", "%T", check=False)
        if state == "PENDING":
            break
        time.sleep(0.5)
    trial_dir = tmp_path / "out" / "checkpoints" / study / "cp-r2-n4-k0"
    assert state == "PENDING", (
        f"not requeued ({state!r}):\n{_logs(tmp_path)[-3000:]}\n{(trial_dir / 'train.log').read_text()[-3000:]}"
    )
    stopped_at = _steps(record)[-1]
    assert 3 <= stopped_at < 12 and (trial_dir / "checkpoints" / "last.ckpt").is_file()
    time.sleep(2.0)  # not within the second of the requeue (see test_slurm_sweep.py)
    _sh(c, "scontrol", "update", f"JobId={task}", "StartTime=now")
    _wait_done(c, job, 400, task)
    logs = _logs(tmp_path)
    storage = f"journal:{tmp_path / 'out' / 'optuna.journal'}"
    (t,) = trials(storage, study)
    assert t.state.name == "COMPLETE", logs[-4000:]
    assert Owner.from_json(t.user_attrs["owner"]).slurm_restart == 1 and logs.count("requeueing") == 1
    # the second attempt went on from the stop step: steps 1..s, then s+1..12, none twice
    steps = _steps(record)
    assert steps == list(range(1, 13)), steps
    log = (trial_dir / "train.log").read_text()
    first, second = (
        (line for line in log.splitlines() if line.startswith("$ ")) if log.count("\n$ ") == 2 else (log, "")
    )
    assert first.startswith("$ srun ") and not first.endswith("--ckpt_path last"), log[-3000:]
    assert second.startswith("$ srun ") and second.endswith("--ckpt_path last"), log[-3000:]
    assert "stopped by SIGUSR1" in log
    # one MLflow parent run for the trial, holding rank 0's training metrics and both evaluations
    (done,) = check_complete_results(storage, study, store, study)
    parents = [r for r in runs(store, study) if "mlflow.parentRunId" not in r.data.tags]
    assert [p.info.run_id for p in parents] == [done.user_attrs["mlflow_parent_run_id"]]
    assert parents[0].data.params["world_size"] == "2" and "val_window_nll" in parents[0].data.metrics
