"""The sweep runner: `python -m sweeps.run SPEC (--check | --init | --worker | --workers N | --resume | --submit | --status)`.

- `--init` (idempotent, under a file lock): checks the Optuna storage and the MLflow store can be
  reached, creates the MLflow experiment and the study once, refuses an existing study with
  another space, and enqueues every grid point that has no trial yet.
- `--worker` (what each SLURM array task runs): adopts its own trials from a previous incarnation
  (a requeued task resumes its trial), reaps trials left RUNNING by dead workers (marks them
  failed, kills their MLflow runs, re-enqueues them up to `max_retries`), then pops WAITING
  trials until none are left. Workers never create grid trials themselves, so each grid point
  runs exactly once however many start together.
- `--workers N`: N local worker processes. `--resume`: init + reap + workers (an interrupted
  sweep goes on; `--retry-failed` also re-enqueues points whose trials all failed).
- `--submit`: validate, init, then `sbatch slurm/sweep.sh` with the spec's resources.

A trial is COMPLETE only after its parent MLflow run and every child run are stored and read back.
Exit codes: 0 done, 2 bad spec / unreachable store, 75 pre-empted (trial saved, stays RUNNING).
What it leaves out: the trial itself (sweeps/objectives.py), MLflow details (sweeps/tracking.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtpc.names import SWEEP_AXES, TRAIN_AXES, point_rank
from sweeps import tracking
from sweeps.objectives import Preempted, TrialContext, run_objective
from sweeps.spec import SpecError, SweepSpec, grid_key, load_spec

EXIT_BAD_INPUT = 2
EXIT_PREEMPTED = 75
HEARTBEAT_S = 20.0
ENDING_WAIT_S = 180.0  # how long an idle worker waits for peers' jobs that are COMPLETING
TRANSITIONAL_SLURM_STATES = {"COMPLETING", "SIGNALING", "STAGE_OUT"}  # ending: requeued or gone, wait
ALIVE_SLURM_STATES = {
    "PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SUSPENDED", "CONFIGURING",
    "COMPLETING", "RESIZING", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD", "STOPPED", "PREEMPTED",
}


class StorageError(RuntimeError):
    """The Optuna storage cannot be reached or used."""


def log(msg: str) -> None:
    print(f"[sweeps {time.strftime('%H:%M:%S')} pid {os.getpid()}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------
# storage


def check_storage(url: str) -> None:
    """Fail early, with the URL in the message, when the Optuna storage cannot be used."""
    if url.startswith("journal:"):
        path = Path(url[len("journal:"):])
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a"):
                pass
        except OSError as e:
            raise StorageError(f"Optuna journal file {path} is not writable ({e}); fix `storage` or {'MTPC_OPTUNA_STORAGE'}") from e
        return
    try:
        import sqlalchemy

        connect_args = {"connect_timeout": 5} if url.startswith(("postgresql", "mysql")) else {}
        eng = sqlalchemy.create_engine(url, connect_args=connect_args)
        with eng.connect():
            pass
        eng.dispose()
    except Exception as e:  # noqa: BLE001 (driver errors vary; all mean "unreachable")
        raise StorageError(f"Optuna storage {url} is unreachable: {type(e).__name__}: {e}") from e


def open_storage(url: str):
    import optuna

    if url.startswith("journal:"):
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        return JournalStorage(JournalFileBackend(url[len("journal:"):]))
    return optuna.storages.RDBStorage(url, engine_kwargs={"pool_pre_ping": True})


def _load_study(spec: SweepSpec, storage):
    import optuna

    try:
        return optuna.load_study(study_name=spec.study, storage=storage, sampler=_sampler(spec))
    except KeyError:
        return None


def _sampler(spec: SweepSpec, salt: int = 0):
    import optuna

    if spec.sampler is None:
        return optuna.samplers.RandomSampler(seed=0)  # never asked: grid trials are enqueued
    seed = spec.sampler.seed + salt
    if spec.sampler.kind == "tpe":
        return optuna.samplers.TPESampler(seed=seed, multivariate=True)
    return optuna.samplers.RandomSampler(seed=seed)


def _check_signature(spec: SweepSpec, study) -> None:
    got = study.user_attrs.get("space_signature")
    if got is not None and got != spec.space_signature():
        raise SpecError(
            f"{spec.path}: study {spec.study!r} already exists in {spec.storage} with a different space/objectives "
            f"(signature {got}, this spec {spec.space_signature()}); use a new `study` name or the original spec"
        )


# ------------------------------------------------------------------------------------------------
# init


def validate_trial_configs(spec: SweepSpec) -> int:
    """With the real objective, parse + validate the training config of every grid point (no
    weights, no data) before anything is submitted; errors name the spec, the point and the key."""
    if spec.objective_kind != "trial" or spec.grid is None:
        return 0
    from experiments.train import check_config
    from experiments.trial import trial_config

    for point in spec.grid:
        try:
            check_config(trial_config({**spec.train, **point}, tracking_uri=spec.tracking_uri, experiment=spec.experiment))
        except (ValueError, TypeError) as e:
            raise SpecError(f"{spec.path}: key 'train' (grid point {grid_key(point)}): {e}") from e
    return len(spec.grid)


def init(spec: SweepSpec, *, retry_failed: bool = False) -> dict[str, Any]:
    """Create experiment + study once and enqueue missing grid points; safe to call from many tasks."""
    import optuna
    from filelock import FileLock

    check_storage(spec.storage)
    tracking.check_tracking(spec.tracking_uri)
    validate_trial_configs(spec)
    spec.output_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(spec.output_dir / f".{spec.study}.init.lock"), timeout=600):
        exp_id = tracking.ensure_experiment(spec.tracking_uri, spec.experiment)
        storage = open_storage(spec.storage)
        study = _load_study(spec, storage)
        if study is None:
            study = optuna.create_study(study_name=spec.study, storage=storage, directions=spec.directions, sampler=_sampler(spec))
            study.set_user_attr("space_signature", spec.space_signature())
            study.set_user_attr("objectives", [o.label for o in spec.objectives])
            study.set_user_attr("n_points", spec.n_trials)
            log(f"created study {spec.study!r} in {spec.storage}")
        _check_signature(spec, study)
        if [d.name.lower() for d in study.directions] != spec.directions:
            raise SpecError(f"{spec.path}: study {spec.study!r} exists with directions {study.directions}, spec asks {spec.directions}")
        study.set_user_attr("mlflow_experiment_id", exp_id)
        enqueued = 0
        if spec.grid is not None:
            by_key: dict[str, list] = {}
            for t in study.get_trials(deepcopy=False):
                by_key.setdefault(t.user_attrs.get("grid_key", ""), []).append(t)
            for point in spec.grid:
                k = grid_key(point)
                trials = by_key.get(k, [])
                all_failed = bool(trials) and all(t.state == optuna.trial.TrialState.FAIL for t in trials)
                if not trials or (retry_failed and all_failed):
                    study.enqueue_trial(point, user_attrs=_grid_attrs(spec, point, attempt=len(trials)))
                    enqueued += 1
        summary = {"study": spec.study, "experiment_id": exp_id, "enqueued": enqueued, "points": spec.n_trials}
        log(f"init: {summary}")
        return summary


def _grid_attrs(spec: SweepSpec, point: dict[str, Any], attempt: int, retry_of: int | None = None) -> dict[str, Any]:
    attrs: dict[str, Any] = {"grid_key": grid_key(point), "slices": list(spec.grid_slices.get(grid_key(point), ())), "attempt": attempt}
    if retry_of is not None:
        attrs["retry_of"] = retry_of
    return attrs


# ------------------------------------------------------------------------------------------------
# owners, liveness, reaper


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
            pid_start=_pid_start(os.getpid()) or "",
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


def slurm_task_id() -> str | None:
    """This task's id for scontrol/scancel: `<array job>_<index>` in an array (the bare SLURM_JOB_ID
    of the last array task equals the array's id, so `scontrol requeue <it>` would hit every task)."""
    arr, idx = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if arr and idx:
        return f"{arr}_{idx}"
    return os.environ.get("SLURM_JOB_ID") or None


def _pid_start(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def slurm_job_state(job_id: str) -> str | None:
    """`JobState` from scontrol; 'NOTFOUND' when SLURM no longer knows the job; None when SLURM
    cannot be asked (no scontrol, controller down)."""
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return "NOTFOUND" if "Invalid job id" in (out.stderr + out.stdout) else None
    for tok in out.stdout.split():
        if tok.startswith("JobState="):
            return tok.split("=", 1)[1]
    return None


def owner_is_dead(owner: Owner | None, me: Owner, heartbeat: float | None, stale_after_s: float) -> tuple[bool, str]:
    """Whether the worker that holds a RUNNING trial is gone (and why). `heartbeat`: the last sign
    of life (heartbeat attr, else the trial's start: a just-popped trial has no owner yet)."""
    stale = heartbeat is None or time.time() - heartbeat > stale_after_s
    if owner is None:
        return stale, "no owner recorded" + (", heartbeat stale" if stale else "")
    if owner.slurm_job_id:
        if owner.slurm_job_id == me.slurm_job_id:
            if owner.slurm_restart < me.slurm_restart:
                return True, f"left by an earlier run (restart {owner.slurm_restart}) of this job {me.slurm_job_id}"
            return False, "a sibling worker in this job"
        state = slurm_job_state(owner.slurm_job_id)
        if state is None:
            return stale, f"SLURM cannot be asked about job {owner.slurm_job_id}" + ("; heartbeat stale" if stale else "")
        if state == "NOTFOUND" or state not in ALIVE_SLURM_STATES:
            return True, f"SLURM job {owner.slurm_job_id} is {state}"
        return False, f"SLURM job {owner.slurm_job_id} is {state}"
    if owner.host == me.host:
        if _pid_start(owner.pid) != owner.pid_start:
            return True, f"worker pid {owner.pid} on {owner.host} is gone"
        return False, f"worker pid {owner.pid} is alive"
    return stale, f"worker on another host {owner.host}" + ("; heartbeat stale" if stale else "")


@dataclass
class ReapResult:
    adopt: list[int]  # trial ids of this job's own trials from before a requeue: resume them
    reaped: list[int]  # trial numbers marked FAIL (and re-enqueued up to max_retries)
    ending: int  # RUNNING trials whose SLURM job is still ending (COMPLETING): ask again soon


def reap(spec: SweepSpec, study, me: Owner) -> ReapResult:
    """Fail RUNNING trials whose worker is dead and re-enqueue them."""
    import optuna
    from optuna.trial import TrialState

    adopt, reaped, ending = [], [], 0
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        owner = Owner.from_json(t.user_attrs.get("owner"))
        hb = t.user_attrs.get("heartbeat")
        if hb is None and t.datetime_start is not None:
            hb = t.datetime_start.timestamp()  # naive local time, as Optuna stores it
        dead, why = owner_is_dead(owner, me, hb, spec.stale_after_s)
        if not dead:
            ending += any(f" is {s}" in why for s in TRANSITIONAL_SLURM_STATES)
            continue
        if owner is not None and owner.slurm_job_id and owner.slurm_job_id == me.slurm_job_id:
            adopt.append(t._trial_id)
            continue
        err = f"worker died: {why}"
        try:
            study._storage.set_trial_user_attr(t._trial_id, "error", err)
            study.tell(t.number, state=TrialState.FAIL)
        except (RuntimeError, ValueError, optuna.exceptions.UpdateFinishedTrialError) as e:
            log(f"reaper: trial {t.number} changed under us ({e}); skipped")
            continue
        reaped.append(t.number)
        log(f"reaper: trial {t.number} ({t.user_attrs.get('grid_key')}) marked FAIL: {err}")
        _kill_mlflow_runs(spec, t)
        attempt = int(t.user_attrs.get("attempt", 0))
        if spec.grid is not None and attempt < spec.max_retries:
            fixed = t.system_attrs.get("fixed_params", {})
            point = {k: t.params.get(k, fixed.get(k, TRAIN_AXES.get(k))) for k in SWEEP_AXES}
            study.enqueue_trial(point, user_attrs=_grid_attrs(spec, point, attempt + 1, retry_of=t.number))
            log(f"reaper: re-enqueued {grid_key(point)} (attempt {attempt + 1})")
    return ReapResult(adopt, reaped, ending)


def _kill_mlflow_runs(spec: SweepSpec, t) -> None:
    parent = t.user_attrs.get("mlflow_parent_run_id")
    if not parent:
        return
    try:
        exp_id = t.user_attrs.get("mlflow_experiment_id")
        runs = [parent] + ([r.info.run_id for r in tracking.child_runs(spec.tracking_uri, exp_id, parent, finished_only=False)] if exp_id else [])
        tracking.terminate(spec.tracking_uri, runs, "KILLED")
        tracking.set_tags(spec.tracking_uri, parent, {"mtpc.error": t.user_attrs.get("error", "worker died")})
    except Exception as e:  # noqa: BLE001 (the Optuna state is what counts; MLflow is best effort here)
        log(f"reaper: could not mark MLflow runs of trial {t.number} KILLED: {e}")


# ------------------------------------------------------------------------------------------------
# worker


class StopFlag:
    """Set by SIGUSR1 (pre-emption warning) or SIGTERM (scancel, requeue)."""

    def __init__(self) -> None:
        self.signal: int | None = None

    def install(self) -> None:
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        self.signal = signum
        log(f"received {signal.Signals(signum).name}: finishing the current step, checkpointing, then stopping")

    def __call__(self) -> bool:
        return self.signal is not None


def _pop_waiting(study) -> int | None:
    from optuna.trial import TrialState

    storage = study._storage
    for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
        try:
            if storage.set_trial_state_values(t._trial_id, state=TrialState.RUNNING):
                return t._trial_id
        except Exception:  # noqa: BLE001 (finished/claimed by another worker meanwhile)
            continue
    return None


def _experiment_id(spec: SweepSpec, study) -> str:
    from mlflow.tracking import MlflowClient

    exp = MlflowClient(spec.tracking_uri).get_experiment_by_name(spec.experiment)
    if exp is None:
        raise SpecError(f"{spec.path}: MLflow experiment {spec.experiment!r} not found at {spec.tracking_uri}; run `python -m sweeps.run {spec.path} --init` first")
    return exp.experiment_id


def worker(spec: SweepSpec, *, max_trials: int | None = None, stop: StopFlag | None = None) -> int:
    """Run trials until none are waiting. Returns an exit code."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    stop = stop or StopFlag()
    check_storage(spec.storage)
    tracking.check_tracking(spec.tracking_uri)
    storage = open_storage(spec.storage)
    me = Owner.current()
    study = _load_study(spec, storage)
    if study is None:
        raise SpecError(f"{spec.path}: study {spec.study!r} does not exist in {spec.storage}; run --init first")
    _check_signature(spec, study)
    if spec.sampler is not None:
        study.sampler = _sampler(spec, salt=os.getpid())
    exp_id = _experiment_id(spec, study)
    adopt = reap(spec, study, me).adopt
    done = 0
    ending_deadline = time.time() + ENDING_WAIT_S
    while not stop() and (max_trials is None or done < max_trials):
        trial_id = adopt.pop(0) if adopt else _pop_waiting(study)
        if trial_id is None and spec.sampler is not None:
            trial_id = _ask_new(spec, study)
        if trial_id is None:
            r = reap(spec, study, me)  # a peer may have died meanwhile
            adopt.extend(r.adopt)
            trial_id = adopt.pop(0) if adopt else _pop_waiting(study)
            if trial_id is None and r.ending and time.time() < ending_deadline:
                log(f"{r.ending} RUNNING trial(s) belong to SLURM jobs that are ending; checking again shortly")
                time.sleep(3.0)
                continue
        if trial_id is None:
            break
        try:
            run_one(spec, study, trial_id, exp_id, me, stop)
        except Preempted as e:
            log(f"trial id {trial_id} pre-empted ({e}); it stays RUNNING and resumes from its checkpoint")
            return EXIT_PREEMPTED
        done += 1
    if stop():
        return EXIT_PREEMPTED
    log(f"worker done: ran {done} trial(s), none waiting")
    return 0


def _ask_new(spec: SweepSpec, study) -> int | None:
    from optuna.trial import TrialState

    live = [t for t in study.get_trials(deepcopy=False) if t.state != TrialState.FAIL]
    if len(live) >= spec.n_trials:
        return None
    return study.ask()._trial_id


def _suggest(spec: SweepSpec, trial) -> dict[str, Any]:
    if spec.grid is not None:
        choices = {p: sorted({pt[p] for pt in spec.grid}, key=str) for p in SWEEP_AXES}
        return {p: trial.suggest_categorical(p, choices[p]) for p in SWEEP_AXES}
    out: dict[str, Any] = {}
    for p, d in spec.sampler.params.items():
        if "choices" in d:
            out[p] = trial.suggest_categorical(p, d["choices"])
        else:
            out[p] = trial.suggest_int(p, d["low"], d["high"], log=d["log"])
    out["rank"] = point_rank(out["circuit"], out["rank"])
    return {**out, **TRAIN_AXES}  # a sampler space searches the architecture; training axes stay at their defaults


class _Heartbeat(threading.Thread):
    def __init__(self, storage, trial_id: int) -> None:
        super().__init__(daemon=True)
        self.storage, self.trial_id, self.halt = storage, trial_id, threading.Event()

    def run(self) -> None:
        while not self.halt.wait(HEARTBEAT_S):
            try:
                self.storage.set_trial_user_attr(self.trial_id, "heartbeat", time.time())
            except Exception:  # noqa: BLE001 (trial finished meanwhile, or storage hiccup)
                return


def run_one(spec: SweepSpec, study, trial_id: int, exp_id: str, me: Owner, stop: StopFlag) -> None:
    """Run one trial to COMPLETE or FAIL; raise Preempted (trial left RUNNING) when stopped."""
    import optuna
    from optuna.trial import TrialState

    storage = study._storage
    frozen = storage.get_trial(trial_id)
    number = frozen.number
    trial = optuna.trial.Trial(study, trial_id)
    try:
        storage.set_trial_user_attr(frozen._trial_id, "owner", me.to_json())
        storage.set_trial_user_attr(frozen._trial_id, "heartbeat", time.time())
    except optuna.exceptions.UpdateFinishedTrialError:
        log(f"trial {number} was finished by another worker before it started here; skipped")
        return
    point = _suggest(spec, trial)
    key = grid_key(point)
    if "grid_key" not in frozen.user_attrs:
        storage.set_trial_user_attr(frozen._trial_id, "grid_key", key)
    storage.set_trial_user_attr(frozen._trial_id, "mlflow_experiment_id", exp_id)
    dup = [t.number for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.user_attrs.get("grid_key") == key]
    if spec.grid is not None and dup:
        storage.set_trial_user_attr(frozen._trial_id, "error", f"duplicate: grid point {key} already COMPLETE in trial {dup[0]}")
        study.tell(trial, state=TrialState.FAIL)
        log(f"trial {number}: {key} already complete (trial {dup[0]}); marked FAIL as duplicate")
        return
    run_name = f"{spec.study}-t{number}-{key}"
    resume_parent = frozen.user_attrs.get("mlflow_parent_run_id")
    log(f"trial {number}: {key} ({'resuming' if resume_parent else 'starting'})")
    hb = _Heartbeat(storage, frozen._trial_id)
    hb.start()
    parent = resume_parent
    try:
        tags = {
            "optuna.study": spec.study, "optuna.trial": str(number), "mtpc.grid_key": key,
            "mtpc.slices": ",".join(frozen.user_attrs.get("slices", [])),
            "mlflow.source.git.commit": tracking.git_sha(Path(__file__).resolve().parent.parent),
            "mtpc.spec": str(spec.path), "mtpc.objective": spec.objective_kind,
            "slurm.job_id": me.slurm_job_id or "", "slurm.restart": str(me.slurm_restart),
            "host": me.host,
        }
        parent = tracking.start_parent_run(
            spec.tracking_uri, exp_id, run_name, params={"study": spec.study, "trial": number}, tags=tags, resume_run_id=resume_parent
        )
        storage.set_trial_user_attr(frozen._trial_id, "mlflow_parent_run_id", parent)
        ctx = TrialContext(
            spec=spec, point=point, trial_number=number, tracking_uri=spec.tracking_uri, experiment_id=exp_id,
            parent_run_id=parent, parent_run_name=run_name,
            checkpoint_dir=spec.output_dir / "checkpoints" / spec.study / key,
            should_stop=stop, set_attr=lambda k, v: storage.set_trial_user_attr(frozen._trial_id, k, v),
        )
        run_objective(ctx)
        values, child_ids = _read_back(spec, exp_id, parent)
        storage.set_trial_user_attr(frozen._trial_id, "mlflow_child_run_ids", child_ids)
        for o, v in zip(spec.objectives, values, strict=True):
            storage.set_trial_user_attr(frozen._trial_id, f"value:{o.label}", v)
        tracking.log_metrics(spec.tracking_uri, parent, {f"objective.{o.label}".replace("/", "."): v for o, v in zip(spec.objectives, values, strict=True)})
        dup = [t.number for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.user_attrs.get("grid_key") == key]
        if spec.grid is not None and dup:
            raise RuntimeError(f"duplicate: grid point {key} completed meanwhile in trial {dup[0]}")
        tracking.terminate(spec.tracking_uri, [parent], "FINISHED")
        hb.halt.set()
        study.tell(trial, values)
        log(f"trial {number}: {key} COMPLETE {dict(zip([o.label for o in spec.objectives], values, strict=True))}")
    except Preempted:
        hb.halt.set()
        raise
    except BaseException as e:  # noqa: BLE001 (any trial error: mark failed, the sweep goes on)
        hb.halt.set()
        if stop():
            # anything raised after a stop request is the stop itself, e.g. Lightning's
            # SIGTERMException (a SystemExit) at the end of the epoch our callback cut short
            raise Preempted(f"stopped by a signal ({type(e).__name__}: {e})") from e
        if not isinstance(e, Exception):
            raise
        err = f"{type(e).__name__}: {e}"
        log(f"trial {number}: {key} FAILED: {err}\n{traceback.format_exc()}")
        storage.set_trial_user_attr(frozen._trial_id, "error", err[:2000])
        storage.set_trial_user_attr(frozen._trial_id, "traceback", traceback.format_exc()[-4000:])
        if parent:
            try:
                tracking.set_tags(spec.tracking_uri, parent, {"mtpc.error": err})
                tracking.terminate(spec.tracking_uri, [parent], "FAILED")
            except Exception as e2:  # noqa: BLE001 (MLflow may be what failed)
                log(f"trial {number}: could not mark the MLflow run failed: {e2}")
        study.tell(trial, state=TrialState.FAIL)


def _read_back(spec: SweepSpec, exp_id: str, parent: str) -> tuple[list[float], list[str]]:
    """Objective values from the *stored* child runs; raise unless every evaluation is there."""
    children = tracking.child_runs(spec.tracking_uri, exp_id, parent)
    for m in spec.eval.modes:
        sets = {r.data.params.get("prompt_set") for r in children if r.data.params.get("mode") == m}
        if len(sets) < spec.eval.sets:
            raise tracking.TrackingError(
                f"parent run {parent}: {len(sets)} stored child run(s) with mode={m} (prompt sets {sorted(map(str, sets))}), "
                f"expected {spec.eval.sets}; the evaluation did not store its results"
            )
    values = []
    for o in spec.objectives:
        rows = [r for r in children if o.mode is None or r.data.params.get("mode") == o.mode]
        vals = [r.data.metrics.get(o.metric) for r in rows]
        if not vals or any(v is None for v in vals):
            raise tracking.TrackingError(f"metric {o.metric!r} missing from a stored child run of parent {parent}")
        values.append(sum(vals) / len(vals))
    for r in children:
        missing = [m for m in tracking.REQUIRED_CHILD_METRICS if m not in r.data.metrics]
        if missing:
            raise tracking.TrackingError(f"child run {r.info.run_id} lacks metrics {missing}")
    return values, [r.info.run_id for r in children]


# ------------------------------------------------------------------------------------------------
# local workers, status, submit, CLI


def local_workers(spec_path: str, n: int, extra: list[str]) -> int:
    """Start n worker processes (each its own owner), forward SIGINT/SIGTERM, wait for all."""
    procs = [subprocess.Popen([sys.executable, "-m", "sweeps.run", spec_path, "--worker", *extra]) for _ in range(n)]

    def forward(signum, _frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, forward)
    codes = [p.wait() for p in procs]
    bad = [c for c in codes if c != 0]
    return bad[0] if bad else 0


def status(spec: SweepSpec) -> dict[str, Any]:
    storage = open_storage(spec.storage)
    study = _load_study(spec, storage)
    if study is None:
        return {"study": spec.study, "exists": False}
    counts: dict[str, int] = {}
    for t in study.get_trials(deepcopy=False):
        counts[t.state.name] = counts.get(t.state.name, 0) + 1
    return {"study": spec.study, "exists": True, "points": spec.n_trials, "states": counts}


def submit(spec: SweepSpec, script: Path, extra: list[str] = (), dry_run: bool = False) -> list[str]:
    """Init, then sbatch the array with the spec's resources; `extra` (e.g. --set overrides) is
    passed on to every task's `sweeps.run` so the tasks see the same spec as this process."""
    init(spec)
    s = spec.slurm
    cmd = ["sbatch", f"--array=0-{s.tasks - 1}", f"--cpus-per-task={s.cpus_per_task}", f"--mem={s.mem}", f"--time={s.time}", f"--job-name={spec.study}"]
    if s.partition:
        cmd.append(f"--partition={s.partition}")
    if s.gpus:
        cmd.append(f"--gpus-per-task={s.gpus}")
    cmd += list(s.extra_args) + [str(script), str(spec.path), *extra]
    log("submitting: " + " ".join(cmd))
    if not dry_run:
        subprocess.run(cmd, check=True)
    return cmd


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sweeps.run", description=__doc__.split("\n\n")[0])
    ap.add_argument("spec", help="sweep YAML (sweeps/*.yaml)")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--check", action="store_true", help="validate the spec and check the stores can be reached")
    g.add_argument("--init", action="store_true", help="create study + experiment, enqueue the grid")
    g.add_argument("--worker", action="store_true", help="run trials until none are waiting")
    g.add_argument("--task", action="store_true", help="--init then --worker in one process (what slurm/sweep.sh runs)")
    g.add_argument("--workers", type=int, metavar="N", help="init, then N local worker processes")
    g.add_argument("--resume", action="store_true", help="init, reap dead trials, then workers (--workers N, default 1)")
    g.add_argument("--submit", action="store_true", help="init, then sbatch slurm/sweep.sh with the spec's resources")
    g.add_argument("--status", action="store_true", help="print trial counts per state")
    ap.add_argument("-n", "--n-workers", type=int, default=1, help="workers for --resume")
    ap.add_argument("--retry-failed", action="store_true", help="with --init/--resume: re-enqueue points whose trials all failed")
    ap.add_argument("--max-trials", type=int, default=None, help="a worker stops after this many trials")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a spec key (YAML value), e.g. train.backbone=default")
    a = ap.parse_args(argv)
    try:
        import yaml

        overrides = {}
        for kv in a.set:
            if "=" not in kv:
                raise SpecError(f"--set {kv!r}: expected KEY=VALUE")
            k, v = kv.split("=", 1)
            overrides[k] = yaml.safe_load(v)
        spec = load_spec(a.spec, overrides=overrides)
        extra = [x for kv in a.set for x in ("--set", kv)]
        if a.max_trials is not None:
            extra += ["--max-trials", str(a.max_trials)]
        if a.check:
            check_storage(spec.storage)
            tracking.check_tracking(spec.tracking_uri)
            validate_trial_configs(spec)
            print(json.dumps({"study": spec.study, "points": spec.n_trials, "storage": spec.storage, "tracking_uri": spec.tracking_uri}))
            return 0
        if a.init:
            init(spec, retry_failed=a.retry_failed)
            return 0
        if a.worker or a.task:
            stop = StopFlag()
            stop.install()
            if a.task:
                init(spec, retry_failed=a.retry_failed)
            return worker(spec, max_trials=a.max_trials, stop=stop)
        if a.workers is not None or a.resume:
            init(spec, retry_failed=a.retry_failed)
            n = a.workers if a.workers is not None else a.n_workers
            if n < 1:
                raise SpecError(f"--workers {n}: expected >= 1")
            return local_workers(a.spec, n, extra)
        if a.submit:
            submit(spec, Path(__file__).resolve().parent.parent / "slurm" / "sweep.sh", extra)
            return 0
        if a.status:
            print(json.dumps(status(spec)))
            return 0
    except (SpecError, StorageError, tracking.TrackingError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


if __name__ == "__main__":
    sys.exit(main())
