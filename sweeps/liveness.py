"""Who holds a RUNNING trial and whether they still live; the reaper that fails and re-enqueues
the trials of dead workers and ends the MLflow runs their attempts left RUNNING.

Each trial records its owner (host, pid + the pid's start time, SLURM `<array>_<index>` and
restart count) and a heartbeat. An owner is dead when its SLURM job is gone or in a final state;
when its local pid is gone, reused or a zombie (exited, not yet waited for by its parent); or,
when neither can be checked, when its heartbeat is older than `stale_after_s`. A requeued SLURM
task (same job, higher restart count) adopts its own trials instead. Leaves out: running trials
(sweeps/worker.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tracking
from sweeps.spec import SweepSpec
from sweeps.study import PREEMPTED_ATTR, enqueue_retry, log

TRANSITIONAL_SLURM_STATES = {"COMPLETING", "SIGNALING", "STAGE_OUT"}  # ending: requeued or gone, wait
ALIVE_SLURM_STATES = {
    "PENDING",
    "RUNNING",
    "REQUEUED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "SUSPENDED",
    "CONFIGURING",
    "COMPLETING",
    "RESIZING",
    "SIGNALING",
    "STAGE_OUT",
    "RESV_DEL_HOLD",
    "STOPPED",
    "PREEMPTED",
}


@dataclass(frozen=True)
class Owner:
    host: str
    pid: int
    pid_start: str  # /proc/<pid>/stat start time: tells a reused pid apart
    slurm_job_id: str | None
    slurm_restart: int

    @staticmethod
    def current() -> Owner:
        return Owner(
            host=socket.gethostname(),
            pid=os.getpid(),
            pid_start=pid_start(os.getpid()) or "",
            slurm_job_id=slurm_task_id(),
            slurm_restart=int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
        )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @staticmethod
    def from_json(s: str | None) -> Owner | None:
        if not s:
            return None
        try:
            return Owner(**json.loads(s))
        except (TypeError, ValueError):
            return None

    def describe(self) -> str:
        return (
            f"SLURM task {self.slurm_job_id}"
            if self.slurm_job_id
            else f"worker pid {self.pid} on {self.host}"
        )


def slurm_task_id() -> str | None:
    """This task's id for scontrol/scancel: `<array job>_<index>` in an array (the bare SLURM_JOB_ID
    of the last array task equals the array's id, so `scontrol requeue <it>` would hit every task)."""
    arr, idx = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if arr and idx:
        return f"{arr}_{idx}"
    return os.environ.get("SLURM_JOB_ID") or None


def pid_start(pid: int) -> str | None:
    """The start time of a live process (field 22 of /proc/<pid>/stat); None when the pid is gone
    or a zombie: a killed worker whose parent has not waited for it yet is dead, not alive."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if len(fields) < 20 or fields[0] in ("Z", "X"):  # fields[0] = state
        return None
    return fields[19]


def slurm_job_state(job_id: str) -> str | None:
    """`JobState` from scontrol; 'NOTFOUND' when SLURM no longer knows the job; None when SLURM
    cannot be asked (no scontrol, controller down)."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return "NOTFOUND" if "Invalid job id" in (out.stderr + out.stdout) else None
    for tok in out.stdout.split():
        if tok.startswith("JobState="):
            return tok.split("=", 1)[1]
    return None


def owner_is_dead(
    owner: Owner | None, me: Owner, heartbeat: float | None, stale_after_s: float
) -> tuple[bool, str]:
    """Whether the worker that holds a RUNNING trial is gone (and why). `heartbeat`: the last sign
    of life (heartbeat attr, else the trial's start: a just-popped trial has no owner yet)."""
    stale = heartbeat is None or time.time() - heartbeat > stale_after_s
    if owner is None:
        return stale, "no owner recorded" + (", heartbeat stale" if stale else "")
    if owner.slurm_job_id:
        if owner.slurm_job_id == me.slurm_job_id:
            if owner.slurm_restart < me.slurm_restart:
                return (
                    True,
                    f"left by an earlier run (restart {owner.slurm_restart}) of this job {me.slurm_job_id}",
                )
            return False, "a sibling worker in this job"
        state = slurm_job_state(owner.slurm_job_id)
        if state is None:
            return stale, f"SLURM cannot be asked about job {owner.slurm_job_id}" + (
                "; heartbeat stale" if stale else ""
            )
        if state == "NOTFOUND" or state not in ALIVE_SLURM_STATES:
            return True, f"SLURM job {owner.slurm_job_id} is {state}"
        return False, f"SLURM job {owner.slurm_job_id} is {state}"
    if owner.host == me.host:
        if pid_start(owner.pid) != owner.pid_start:
            return True, f"worker pid {owner.pid} on {owner.host} is gone"
        return False, f"worker pid {owner.pid} is alive"
    return stale, f"worker on another host {owner.host}" + ("; heartbeat stale" if stale else "")


def trial_owner_state(spec: SweepSpec, t, me: Owner) -> tuple[bool, str]:
    """owner_is_dead for a RUNNING trial, from its user attrs."""
    hb = t.user_attrs.get("heartbeat")
    if hb is None and t.datetime_start is not None:
        hb = t.datetime_start.timestamp()  # naive local time, as Optuna stores it
    return owner_is_dead(Owner.from_json(t.user_attrs.get("owner")), me, hb, spec.stale_after_s)


@dataclass
class ReapResult:
    adopt: list[int]  # trial ids of this job's own trials from before a requeue: resume them
    reaped: list[int]  # trial numbers marked FAIL (and re-enqueued up to max_retries)
    ending: int  # RUNNING trials whose SLURM job is still ending (COMPLETING): ask again soon


def reap(spec: SweepSpec, study, me: Owner) -> ReapResult:
    """Fail RUNNING trials whose worker is dead and re-enqueue them (up to `max_retries`); then end
    the MLflow runs that finished attempts left RUNNING."""
    import optuna
    from optuna.trial import TrialState

    adopt, reaped, ending = [], [], 0
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        owner = Owner.from_json(t.user_attrs.get("owner"))
        dead, why = trial_owner_state(spec, t, me)
        if not dead:
            ending += any(f" is {s}" in why for s in TRANSITIONAL_SLURM_STATES)
            continue
        if owner is not None and owner.slurm_job_id and owner.slurm_job_id == me.slurm_job_id:
            adopt.append(t._trial_id)
            continue
        preempted = bool(t.user_attrs.get(PREEMPTED_ATTR))
        err = f"pre-empted, then its worker ended: {why}" if preempted else f"worker died: {why}"
        try:
            study._storage.set_trial_user_attr(t._trial_id, "error", err)
            study.tell(t.number, state=TrialState.FAIL)
        except (RuntimeError, ValueError, optuna.exceptions.UpdateFinishedTrialError) as e:
            log(f"reaper: trial {t.number} changed under us ({e}); skipped")
            continue
        reaped.append(t.number)
        log(f"reaper: trial {t.number} ({t.user_attrs.get('grid_key')}) marked FAIL: {err}")
        _kill_mlflow_runs(spec, t, err)
        attempt = int(t.user_attrs.get("attempt", 0))
        if (
            spec.grid is not None and preempted
        ):  # stopped on request after a checkpoint: not a failure of the point
            enqueue_retry(spec, study, t, attempt=attempt)
        elif spec.grid is not None and attempt < spec.max_retries:
            enqueue_retry(spec, study, t, attempt=attempt + 1)
    close_stale_runs(spec, study)
    return ReapResult(adopt, reaped, ending)


def _kill_mlflow_runs(spec: SweepSpec, t, err: str) -> None:
    parent = t.user_attrs.get("mlflow_parent_run_id")
    if not parent:
        return
    try:
        exp_id = t.user_attrs.get("mlflow_experiment_id")
        runs = [parent] + (
            [
                r.info.run_id
                for r in tracking.child_runs(spec.tracking_uri, exp_id, parent, finished_only=False)
            ]
            if exp_id
            else []
        )
        tracking.terminate(spec.tracking_uri, runs, "KILLED")
        tracking.set_tags(spec.tracking_uri, parent, {tracking.ERROR_TAG: err})
    except Exception as e:  # noqa: BLE001 (the Optuna state is what counts; close_stale_runs retries later)
        log(
            f"reaper: could not mark the MLflow runs of trial {t.number} KILLED ({tracking.short(e)}); a later reap ends them"
        )


def close_stale_runs(spec: SweepSpec, study) -> int:
    """End the parent runs of this study that are still RUNNING in MLflow although their Optuna
    trial is finished: an attempt that failed while the tracking store was down could not end its
    run, and a worker killed between creating its run and recording it leaves one too. FAIL trials'
    runs end FAILED with the trial's error, COMPLETE trials' FINISHED. Returns how many were ended;
    best effort (a store that is still down is logged and tried again at the next reap)."""
    from optuna.trial import TrialState

    exp_id = study.user_attrs.get("mlflow_experiment_id") or tracking.experiment_id(
        spec.tracking_uri, spec.experiment
    )
    if exp_id is None:
        return 0
    try:
        with tracking.quick_failures():
            open_runs = list(
                tracking.iter_runs(
                    tracking.client(spec.tracking_uri),
                    [exp_id],
                    f"tags.`optuna.study` = '{spec.study}' and attributes.status = 'RUNNING'",
                )
            )
        if not open_runs:
            return 0
        trials = {str(t.number): t for t in study.get_trials(deepcopy=False)}
        closed = 0
        for run in open_runs:
            t = trials.get(run.data.tags.get("optuna.trial", ""))
            if t is None or t.state not in (TrialState.FAIL, TrialState.COMPLETE):
                continue  # a live trial's run, or not one of ours
            status = "FINISHED" if t.state == TrialState.COMPLETE else "FAILED"
            err = t.user_attrs.get("error", "the attempt ended without closing its run")
            with tracking.quick_failures():
                tracking.close_if_running(spec.tracking_uri, exp_id, run.info.run_id, status, err)
            closed += 1
            log(f"closed MLflow run {run.info.run_id} of finished trial {t.number} ({status}): {err[:200]}")
        return closed
    except Exception as e:  # noqa: BLE001
        log(
            f"could not close stale MLflow runs at {spec.tracking_uri}: {tracking.short(e)}; tried again at the next reap"
        )
        return 0


def gone_workers(spec: SweepSpec, study, me: Owner) -> list[dict[str, Any]]:
    """RUNNING trials whose worker is gone (what the next reap will fail and re-enqueue)."""
    from optuna.trial import TrialState

    out = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        dead, why = trial_owner_state(spec, t, me)
        if dead:
            out.append({"trial": t.number, "grid_key": t.user_attrs.get("grid_key"), "why": why})
    return out
