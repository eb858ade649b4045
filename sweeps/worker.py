"""A sweep worker: claim trials until none are waiting, run each to COMPLETE or FAIL, and stop
cleanly when asked (pre-emption) or when the tracking store fails.

- A trial is COMPLETE only after its parent MLflow run and every evaluation run are stored and read
  back; the Optuna values are computed from the stored evaluation runs.
- Any other error marks the trial FAIL (`error`, `traceback` user attrs; the parent run FAILED with
  `mtpc.error`) and the worker goes on, unless the tracking store no longer takes a write: then the
  attempt is marked FAIL with a message that names the tracking URI, its grid point is enqueued
  again (not counted as a retry), and the worker stops taking trials (`TrackingLost`). It also
  probes the store before every trial, so a store that went down costs no further trials.
- SIGUSR1 / SIGTERM / SIGINT: the running trial checkpoints at its next step and stays RUNNING
  (`Preempted`) for a requeued task or a reaper to resume.
Leaves out: the Optuna study (sweeps/study.py), dead workers (sweeps/liveness.py), the CLI and exit
codes (sweeps/run.py).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time
import traceback

import tracking
from sweeps.liveness import Owner, reap
from sweeps.spec import SpecError, SweepSpec
from sweeps.study import (
    PREEMPTED_ATTR,
    ask_new,
    check_signature,
    check_storage,
    enqueue_retry,
    experiment_id,
    load_study,
    log,
    open_storage,
    pop_waiting,
    sampler,
    suggest,
)
from sweeps.trials import Preempted, TrialContext, run_trial
from tracking.schema import grid_key

#: exit codes a worker returns (sweeps/run.py documents every exit code of the runner)
EXIT_TRACKING = 69  # EX_UNAVAILABLE: the tracking store stopped taking writes; the worker stopped
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped by a signal; the running trial checkpointed, stays RUNNING
HEARTBEAT_S = 20.0
ENDING_WAIT_S = 180.0  # how long an idle worker waits for peers' jobs that are COMPLETING


class IncompleteResults(RuntimeError):
    """The trial returned, but the evaluation runs or metrics the objectives need are not stored: the
    trial did not produce them (the store answered; a store that fails is TrackingLost's case)."""


class TrackingLost(RuntimeError):  # noqa: N818 (the worker's reason to stop, not a trial error)
    """The tracking store stopped taking writes during the sweep: the worker stops taking trials."""


class StopFlag:
    """Set by SIGUSR1 (pre-emption warning), SIGTERM (scancel, requeue) or SIGINT (Ctrl-C)."""

    SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signal: int | None = None

    def install(self) -> None:
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        self.signal = signum
        log(
            f"received {signal.Signals(signum).name}: finishing the current step, checkpointing, then stopping"
        )

    def __call__(self) -> bool:
        return self.signal is not None


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


def worker(spec: SweepSpec, *, max_trials: int | None = None, stop: StopFlag | None = None) -> int:
    """Run trials until none are waiting. Returns an exit code of sweeps/run.py (0, 69 or 75)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    stop = stop or StopFlag()
    check_storage(spec.storage)
    tracking.check_tracking(spec.tracking_uri)
    storage = open_storage(spec.storage)
    me = Owner.current()
    study = load_study(spec, storage)
    if study is None:
        raise SpecError(
            f"{spec.path}: study {spec.study!r} does not exist in {spec.storage}; run --init first"
        )
    check_signature(spec, study)
    if spec.sampler is not None:
        study.sampler = sampler(spec, salt=os.getpid())
    exp_id = experiment_id(spec, study)
    adopt = reap(spec, study, me).adopt
    done = 0
    ending_deadline = time.time() + ENDING_WAIT_S
    while not stop() and (max_trials is None or done < max_trials):
        problem = tracking.probe_write(spec.tracking_uri, exp_id)
        if problem is not None:
            _stopped_by_tracking(problem, adopt)
            return EXIT_TRACKING
        trial_id = _take(adopt, study, spec, storage)
        if trial_id is None and spec.sampler is not None:
            trial_id = ask_new(spec, study)
        if trial_id is None:
            r = reap(spec, study, me)  # a peer may have died meanwhile
            adopt.extend(r.adopt)
            trial_id = _take(adopt, study, spec, storage)
            if trial_id is None and r.ending and time.time() < ending_deadline:
                log(
                    f"{r.ending} RUNNING trial(s) belong to SLURM jobs that are ending; checking again shortly"
                )
                time.sleep(3.0)
                continue
        if trial_id is None:
            break
        try:
            run_one(spec, study, trial_id, exp_id, me, stop)
        except Preempted as e:
            log(f"trial id {trial_id} pre-empted ({e}); it stays RUNNING and resumes from its checkpoint")
            with contextlib.suppress(
                Exception
            ):  # the reaper re-enqueues a pre-empted trial without spending a retry
                storage.set_trial_user_attr(trial_id, PREEMPTED_ATTR, 1)
            return EXIT_PREEMPTED
        except TrackingLost as e:
            _stopped_by_tracking(str(e), adopt)
            return EXIT_TRACKING
        done += 1
    if stop():
        return EXIT_PREEMPTED
    log(f"worker done: ran {done} trial(s), none waiting")
    return 0


def _stopped_by_tracking(problem: str, adopt: list[int]) -> None:
    log(
        f"error: {problem}; this worker stopped taking trials (the waiting ones stay WAITING"
        + (f", {len(adopt)} adopted trial(s) stay RUNNING" if adopt else "")
        + "); once the store answers again, run `python -m sweeps.run SPEC --resume`"
    )


def run_one(spec: SweepSpec, study, trial_id: int, exp_id: str, me: Owner, stop: StopFlag) -> None:
    """Run one trial to COMPLETE or FAIL; raise Preempted (trial left RUNNING) when stopped, and
    TrackingLost (trial FAIL and re-enqueued) when the tracking store failed under it."""
    import optuna
    from optuna.trial import TrialState

    storage = study._storage
    frozen = storage.get_trial(trial_id)
    number = frozen.number
    trial = optuna.trial.Trial(study, trial_id)
    try:
        storage.set_trial_user_attr(trial_id, "owner", me.to_json())
        storage.set_trial_user_attr(trial_id, "heartbeat", time.time())
    except optuna.exceptions.UpdateFinishedTrialError:
        log(f"trial {number} was finished by another worker before it started here; skipped")
        return
    point = suggest(spec, trial)
    key = grid_key(point)
    if "grid_key" not in frozen.user_attrs:
        storage.set_trial_user_attr(trial_id, "grid_key", key)
    storage.set_trial_user_attr(trial_id, "mlflow_experiment_id", exp_id)
    lost = tuple(frozen.user_attrs.get("replaces_lost", ()))  # re-run of trials whose MLflow runs are gone
    dup = _completed_twin(study, key, lost)
    if spec.grid is not None and dup is not None:
        storage.set_trial_user_attr(
            trial_id, "error", f"duplicate: grid point {key} already COMPLETE in trial {dup}"
        )
        study.tell(trial, state=TrialState.FAIL)
        log(f"trial {number}: {key} already complete (trial {dup}); marked FAIL as duplicate")
        return
    run_name = f"{spec.study}/{key}"  # the trial number is the tag optuna.trial
    resume_parent = frozen.user_attrs.get("mlflow_parent_run_id")
    log(f"trial {number}: {key} ({'resuming' if resume_parent else 'starting'})")
    hb = _Heartbeat(storage, trial_id)
    hb.start()
    parent = resume_parent
    uri = spec.tracking_uri
    try:
        tags = {
            "optuna.study": spec.study,
            "optuna.trial": str(number),
            "mtpc.grid_key": key,
            "mtpc.slices": ",".join(frozen.user_attrs.get("slices", [])),
            tracking.GIT_TAGS[0]: tracking.git_sha(),
            "mtpc.spec": str(spec.path),
            "mtpc.objective": spec.trial_kind,
            "slurm.job_id": me.slurm_job_id or "",
            "slurm.restart": str(me.slurm_restart),
            "host": me.host,
        }
        # the run's id goes to Optuna before anything else is logged into it, so a later reap can
        # always find (and end) a run this attempt leaves open
        parent = tracking.start_parent_run(
            uri, exp_id, run_name, params={}, tags=tags, resume_run_id=resume_parent
        )
        storage.set_trial_user_attr(trial_id, "mlflow_parent_run_id", parent)
        tracking.log_params(uri, parent, {"study": spec.study, "trial": number})
        ctx = TrialContext(
            spec=spec,
            point=point,
            trial_number=number,
            tracking_uri=uri,
            experiment_id=exp_id,
            parent_run_id=parent,
            parent_run_name=run_name,
            checkpoint_dir=spec.trial_dir(key),
            should_stop=stop,
            set_attr=lambda k, v: storage.set_trial_user_attr(trial_id, k, v),
        )
        run_trial(ctx)
        values, child_ids = read_back(spec, exp_id, parent)
        storage.set_trial_user_attr(trial_id, "mlflow_child_run_ids", child_ids)
        for o, v in zip(spec.objectives, values, strict=True):
            storage.set_trial_user_attr(trial_id, f"value:{o.label}", v)
        tracking.log_metrics(
            uri,
            parent,
            {
                f"objective.{o.label}".replace("/", "."): v
                for o, v in zip(spec.objectives, values, strict=True)
            },
        )
        tracking.log_trial_summary(uri, exp_id, parent)  # one row per trial in the UI's runs table
        dup = _completed_twin(study, key, lost)
        if spec.grid is not None and dup is not None:
            raise RuntimeError(f"duplicate: grid point {key} completed meanwhile in trial {dup}")
        tracking.terminate(uri, [parent], "FINISHED")
        hb.halt.set()
        study.tell(trial, values)
        log(
            f"trial {number}: {key} COMPLETE, "
            + ", ".join(f"{o.label} {v:.4g}" for o, v in zip(spec.objectives, values, strict=True))
        )
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
        problem = tracking.probe_write(uri, exp_id)
        if problem is not None:
            err = f"{problem}: this attempt stopped on it ({tracking.short(e, 500)})"
        else:
            err = f"{type(e).__name__}: {e}"
        log(f"trial {number}: {key} FAILED: {err}\n{traceback.format_exc()}")
        storage.set_trial_user_attr(trial_id, "error", err[:2000])
        storage.set_trial_user_attr(trial_id, "traceback", traceback.format_exc()[-4000:])
        if parent and problem is None:
            try:
                tracking.set_tags(uri, parent, {tracking.ERROR_TAG: err})
                tracking.terminate(uri, [parent], "FAILED")
            except Exception as e2:  # noqa: BLE001 (the next reap ends it: liveness.close_stale_runs)
                log(f"trial {number}: could not mark the MLflow run failed: {tracking.short(e2)}")
        study.tell(trial, state=TrialState.FAIL)
        if problem is not None:
            if spec.grid is not None:
                # the store failed, not the point: run it again, without spending a retry
                enqueue_retry(
                    spec, study, storage.get_trial(trial_id), attempt=int(frozen.user_attrs.get("attempt", 0))
                )
            raise TrackingLost(problem) from e


def _take(adopt: list[int], study, spec: SweepSpec, storage) -> int | None:
    """The next trial: one this job adopts (its own, pre-empted and requeued), else a WAITING one."""
    if not adopt:
        return pop_waiting(study, spec)
    trial_id = adopt.pop(0)
    with contextlib.suppress(Exception):  # resumed by its own job: a later death is a failure again
        storage.set_trial_user_attr(trial_id, PREEMPTED_ATTR, 0)
    return trial_id


def _completed_twin(study, key: str, lost: tuple[int, ...] = ()) -> int | None:
    """Another COMPLETE trial of grid point `key`, not counting `lost` ones (their MLflow runs are gone)."""
    from optuna.trial import TrialState

    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        if t.user_attrs.get("grid_key") == key and t.number not in lost:
            return t.number
    return None


def read_back(spec: SweepSpec, exp_id: str, parent: str) -> tuple[list[float], list[str]]:
    """Objective values from the *stored* evaluation runs; raise unless every evaluation is there."""
    children = tracking.child_runs(spec.tracking_uri, exp_id, parent)
    e = spec.eval
    for m in e.modes:
        sets = {r.data.params.get("prompt_set") for r in children if r.data.params.get("mode") == m}
        if len(sets) < e.sets:
            odd = [t for t in e.temperatures if not math.isfinite(t)]
            raise IncompleteResults(
                f"the trial stored no {m} evaluation for {e.sets - len(sets)} of {e.sets} prompt set(s) (parent run "
                f"{parent}): its evaluation ran no such pass; "
                + (
                    f"eval.temperatures holds {odd}: a temperature must be a finite number"
                    if odd
                    else f"eval.modes {list(e.modes)}, eval.temperatures {list(e.temperatures)}"
                )
            )
    values = []
    for o in spec.objectives:
        rows = [r for r in children if o.mode is None or r.data.params.get("mode") == o.mode]
        vals = [r.data.metrics.get(o.metric) for r in rows]
        if not vals or any(v is None for v in vals):
            raise IncompleteResults(
                f"metric {o.metric!r} missing from a stored evaluation run of parent {parent}: the "
                "evaluation did not produce it (a NaN or infinite value is not stored)"
            )
        values.append(sum(vals) / len(vals))
    for r in children:
        missing = [m for m in tracking.STORED_METRICS if m not in r.data.metrics]
        if missing:
            raise IncompleteResults(
                f"evaluation run {r.info.run_id} lacks metrics {missing}: the evaluation did not "
                "produce them (a NaN or infinite value is not stored)"
            )
    return values, [r.info.run_id for r in children]
