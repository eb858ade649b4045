"""`sbatch slurm/sweep.sh sweeps/smoke.yaml` on a real one-node SLURM cluster (slurm/local_cluster.sh,
started once per session on 127.0.0.1 and stopped by PID). The fixture objective keeps it short.

Checks: every grid point ends with exactly one COMPLETE trial with its MLflow runs; a forced failure
leaves the rest complete; a second submission adds nothing; `scancel` of one running array task
loses no other result and its trial is marked failed and re-run (never reported complete half
written); a pre-empted (SIGUSR1) task is requeued and resumes the same trial from its checkpoint.
Skipped, with the reason, when the Debian packages cannot be installed (not root, no apt). The
cluster and the MLflow store are session fixtures of tests/sweeps/conftest.py."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from sweeps.liveness import Owner
from tests.sweep_helpers import REPO, by_state, check_complete_results, runs, trials

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def _sh(cluster, *cmd: str, check: bool = True) -> str:
    r = subprocess.run(list(cmd), capture_output=True, text=True, env=cluster["env"], cwd=REPO, timeout=60)
    if check:
        assert r.returncode == 0, f"{cmd}: {r.stderr}"
    return r.stdout.strip()


def _sbatch(cluster, tmp: Path, tasks: int, *sets: str) -> str:
    out = _sh(
        cluster,
        "sbatch",
        "--parsable",
        f"--array=0-{tasks - 1}",
        f"--output={tmp}/slurm-%A_%a.out",
        str(REPO / "slurm" / "sweep.sh"),
        "sweeps/smoke.yaml",
        *[x for s in sets for x in ("--set", s)],
    )
    return out.split(";")[0]


def _wait_done(cluster, job: str, timeout: float, *tasks: str) -> None:
    """Until squeue lists no task of the array nor any of `tasks` (a requeued task is not always
    listed under the array id once the array's own record has ended). A failed squeue call (busy
    controller) proves nothing: it must answer, with nothing, twice in a row."""
    deadline = time.time() + timeout
    empty = 0
    ids = ",".join((job, *tasks))
    while time.time() < deadline:
        r = subprocess.run(
            ["squeue", "-h", "-j", ids], capture_output=True, text=True, env=cluster["env"], timeout=60
        )
        empty = empty + 1 if r.returncode == 0 and not r.stdout.strip() else 0
        if empty >= 2:
            return
        time.sleep(1.0)
    raise AssertionError(
        f"array job {job} not finished after {timeout}s: {_sh(cluster, 'squeue', check=False)}"
    )


def _logs(tmp: Path) -> str:
    return "\n".join(p.read_text() for p in sorted(tmp.glob("slurm-*.out")))


def _sets(tmp: Path, study: str, store: str, **fixture) -> list[str]:
    return [
        f"study={study}",
        "objective=fixture",
        f"output_dir={tmp}/out",
        f"mlflow.tracking_uri={store}",
        f"mlflow.experiment={study}",
        f"fixture={json.dumps(fixture)}",
    ]


def test_sbatch_smoke_every_point_once_failure_isolated_resubmit_adds_nothing(cluster, store, tmp_path):
    study = "slurm-smoke"
    sets = _sets(tmp_path, study, store, steps=2, step_seconds=0.3, fail=[{"circuit": "hmm"}])
    job = _sbatch(cluster, tmp_path, 3, *sets)
    _wait_done(cluster, job, 240)
    storage = f"journal:{tmp_path / 'out' / 'optuna.journal'}"
    ts = trials(storage, study)
    st = by_state(ts)
    assert {k: len(v) for k, v in st.items()} == {"COMPLETE": 4, "FAIL": 1}, _logs(tmp_path)[-4000:]
    (failed,) = st["FAIL"]
    assert failed.params["circuit"] == "hmm" and "forced failure" in failed.user_attrs["error"]
    assert "forced failure" in _logs(tmp_path)  # the error is in the task's log too
    check_complete_results(storage, study, store, study)
    assert {t.user_attrs["grid_key"] for t in st["COMPLETE"]} == {
        "ff-r1-n4-k0",
        "cp-r4-n4-k0",
        "btree-r4-n4-k0",
        "cp-r4-n4-k1",
    }
    owners = {json.loads(t.user_attrs["owner"])["slurm_job_id"] for t in ts}
    assert all(o and o.startswith(f"{job}_") for o in owners)
    n_runs = len(runs(store, study))

    job2 = _sbatch(cluster, tmp_path, 2, *sets)
    _wait_done(cluster, job2, 180)
    assert len(trials(storage, study)) == 5
    assert len(runs(store, study)) == n_runs
    assert _logs(tmp_path).count("ran 0 trial(s)") >= 2


def _running_by_task(storage: str, study: str, ck_root: Path, min_step: int) -> dict[str, object]:
    out = {}
    try:
        ts = trials(storage, study)
    except Exception:  # noqa: BLE001 (study not created yet)
        return out
    for t in ts:
        if t.state.name != "RUNNING" or "owner" not in t.user_attrs:
            continue
        f = ck_root / t.user_attrs["grid_key"] / "fixture_state.json"
        if f.exists() and json.loads(f.read_text())["step"] >= min_step:
            out[json.loads(t.user_attrs["owner"])["slurm_job_id"]] = t
    return out


def test_scancel_one_task_and_requeue_another(cluster, store, tmp_path):
    study = "slurm-faults"
    # long enough that the first task is still mid-trial when the second (started later) reaches step 2
    sets = _sets(tmp_path, study, store, steps=24, step_seconds=0.5)
    sets.append(
        'space={"slices": {"a": {"circuit": ["cp"], "rank": [2, 4, 8], "window": [4], "lora_depth": [0]}}}'
    )
    job = _sbatch(cluster, tmp_path, 2, *sets)
    storage = f"journal:{tmp_path / 'out' / 'optuna.journal'}"
    ck_root = tmp_path / "out" / "checkpoints" / study
    deadline = time.time() + 150
    running: dict = {}
    while time.time() < deadline and len(running) < 2:
        time.sleep(0.5)
        running = _running_by_task(storage, study, ck_root, 2)
    assert len(running) == 2, f"two tasks never ran trials together:\n{_logs(tmp_path)[-3000:]}"
    (pre_task, pre_trial), (cancel_task, cancel_trial) = sorted(running.items())
    # pre-emption warning to one task (what --signal=B:USR1@120 does before the time limit) ...
    _sh(cluster, "scancel", "--signal=USR1", "--batch", pre_task)
    # ... and a plain cancel of the other
    _sh(cluster, "scancel", cancel_task)
    deadline = time.time() + 60
    while time.time() < deadline:
        state = _sh(cluster, "squeue", "-h", "-j", pre_task, "-o", "%T", check=False)
        if state == "PENDING":
            break
        time.sleep(0.5)
    assert state == "PENDING", f"pre-empted task not requeued (state {state!r}):\n{_logs(tmp_path)[-3000:]}"
    # skip the ~2 min requeue delay, but not within the second of the requeue: slurmd revoked the old
    # credential with one-second resolution and kills a restart in that same second
    # ("Killing non-startable batch job: Job credential revoked"), which loses the task
    time.sleep(2.0)
    _sh(cluster, "scontrol", "update", f"JobId={pre_task}", "StartTime=now")
    _wait_done(cluster, job, 200, pre_task)
    logs = _logs(tmp_path)
    ts = trials(storage, study)
    by_num = {t.number: t for t in ts}
    # the requeued task resumed the very same trial from its checkpoint
    resumed = by_num[pre_trial.number]
    assert resumed.state.name == "COMPLETE", logs[-3000:]
    assert resumed.user_attrs["resumed_from_step"] >= 2, (resumed.user_attrs, logs[-5000:])
    assert Owner.from_json(resumed.user_attrs["owner"]).slurm_restart == 1
    assert "requeueing" in logs
    # the cancelled task's trial: marked failed (never complete), its runs killed, re-run once
    cancelled = by_num[cancel_trial.number]
    assert cancelled.state.name == "FAIL" and "CANCELLED" in cancelled.user_attrs["error"], (
        cancelled.user_attrs
    )
    parent = {r.info.run_id: r for r in runs(store, study)}[cancelled.user_attrs["mlflow_parent_run_id"]]
    assert parent.info.status == "KILLED"
    retry = [t for t in ts if t.user_attrs.get("retry_of") == cancelled.number]
    assert (
        len(retry) == 1
        and retry[0].state.name == "COMPLETE"
        and retry[0].user_attrs["resumed_from_step"] >= 2
    )
    # nothing else lost: every grid point exactly one COMPLETE trial with its stored runs
    complete = check_complete_results(storage, study, store, study)
    assert sorted(t.user_attrs["grid_key"] for t in complete) == ["cp-r2-n4-k0", "cp-r4-n4-k0", "cp-r8-n4-k0"]


def test_sbatch_real_trial_on_the_tiny_backbone(cluster, store, tmp_path):
    """The shipped smoke spec with its real objective (train_head + experiments.evaluate) as a
    one-task array job: one point (btree, LoRA depth 1), prompts from a small file."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps(p) + "\n" for p in ("Hello there!", "Count to five.", "Why is the sky blue?"))
    )
    study = "slurm-real"
    sets = [
        f"study={study}",
        f"output_dir={tmp_path}/out",
        f"mlflow.tracking_uri={store}",
        f"mlflow.experiment={study}",
        f"eval.prompts={prompts}",
        "eval.n_prompts=2",
        "eval.max_new_tokens=8",
        'space={"slices": {"one": {"circuit": ["btree"], "rank": [2], "window": [4], "lora_depth": [1]}}}',
    ]
    job = _sbatch(cluster, tmp_path, 1, *sets)
    _wait_done(cluster, job, 300)
    storage = f"journal:{tmp_path / 'out' / 'optuna.journal'}"
    ts = trials(storage, study)
    assert [t.state.name for t in ts] == ["COMPLETE"], _logs(tmp_path)[-4000:]
    (t,) = check_complete_results(storage, study, store, study)
    parent = {r.info.run_id: r for r in runs(store, study)}[t.user_attrs["mlflow_parent_run_id"]]
    assert parent.data.params["circuit"] == "btree" and parent.data.params["lora_depth"] == "1"
    assert "peak_mem_bytes" in parent.data.metrics and parent.data.tags["slurm.job_id"] == f"{job}_0"
