"""The Optuna side of a sweep: the storage (checked, opened), the study (created once, its space
signature), the grid enqueued exactly once, and how a worker claims the next trial.

`init` is idempotent and file-locked, so every SLURM task can run it: it checks that both stores
answer, validates every grid point's training config, creates the MLflow experiment and the study
once (before any worker starts; workers select the experiment by id), refuses an existing study
with another space, refuses to create a study anew where MLflow already holds finished trial runs
of it (an emptied or replaced journal: every point would run twice), and enqueues every grid point
that has no trial yet. Workers only pop WAITING
trials; they never ask the sampler for grid points, so each point runs once however many start
together. Leaves out: running a trial (sweeps/worker.py) and dead workers (sweeps/liveness.py).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import tracking
from mtpc.names import point_rank
from sweeps.spec import STORAGE_ENV, SpecError, SweepSpec
from tracking import axes
from tracking.schema import POINTS_TAG, grid_key


class StorageError(RuntimeError):
    """The Optuna storage cannot be reached or used."""


def log(msg: str) -> None:
    print(f"[sweeps {time.strftime('%H:%M:%S')} pid {os.getpid()}] {msg}", file=sys.stderr, flush=True)


def check_storage(url: str) -> None:
    """Fail early, with the URL in the message, when the Optuna storage cannot be used."""
    if url.startswith("journal:"):
        path = Path(url[len("journal:") :])
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a"):
                pass
        except OSError as e:
            raise StorageError(
                f"Optuna journal file {path} is not writable ({e}); fix `storage` or {STORAGE_ENV}"
            ) from e
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

        from sweeps.journal import JournalError, repair

        try:
            for note in repair(url[len("journal:") :]):  # a torn line from an older crash or full disk
                log(f"warning: {note}")
        except (JournalError, OSError) as e:
            raise StorageError(str(e)) from None
        return JournalStorage(JournalFileBackend(url[len("journal:") :]))
    return optuna.storages.RDBStorage(url, engine_kwargs={"pool_pre_ping": True})


def load_study(spec: SweepSpec, storage):
    """The spec's study in `storage`, or None if it was never created."""
    import optuna

    try:
        return optuna.load_study(study_name=spec.study, storage=storage, sampler=sampler(spec))
    except KeyError:
        return None


def sampler(spec: SweepSpec, salt: int = 0):
    import optuna

    if spec.sampler is None:
        return optuna.samplers.RandomSampler(seed=0)  # never asked: grid trials are enqueued
    seed = spec.sampler.seed + salt
    if spec.sampler.kind == "tpe":
        return optuna.samplers.TPESampler(seed=seed, multivariate=True)
    return optuna.samplers.RandomSampler(seed=seed)


def check_signature(spec: SweepSpec, study) -> None:
    got = study.user_attrs.get("space_signature")
    if got is not None and got != spec.space_signature():
        raise SpecError(
            f"{spec.path}: study {spec.study!r} already exists in {spec.storage} with a different space/objectives "
            f"(signature {got}, this spec {spec.space_signature()}); use a new `study` name or the original spec"
        )


def validate_trial_configs(spec: SweepSpec) -> int:
    """With the real trial, parse + validate the training config of every grid point (no weights,
    no data) and that its evaluation fits the backbone's context, before anything is submitted;
    errors name the spec, the point and the key."""
    if spec.trial_kind != "trial" or spec.grid is None:
        return 0
    from experiments.training.fit import check_config
    from experiments.training.trial import check_eval_lengths, trial_config

    configs = {
        grid_key(p): trial_config(spec.train, p, tracking_uri=spec.tracking_uri, experiment=spec.experiment)
        for p in spec.grid
    }
    for key, cfg in configs.items():
        try:
            check_config(cfg)
        except (ValueError, TypeError) as e:
            raise SpecError(f"{spec.path}: key 'train' (grid point {key}): {e}") from e
    longest = None
    for key, cfg in configs.items():  # after every training config: the evaluation needs a valid one
        try:
            if longest is None:
                from experiments.evaluation.prompts import longest_prompt

                longest = longest_prompt(spec.eval)
            check_eval_lengths(cfg, spec.eval, longest)
        except ValueError as e:
            raise SpecError(f"{spec.path}: key 'eval' (grid point {key}): {e}") from e
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
        tracking.client(spec.tracking_uri).set_experiment_tag(exp_id, POINTS_TAG, str(spec.n_trials))
        storage = open_storage(spec.storage)
        study = load_study(spec, storage)
        if study is None:
            check_no_finished_runs(spec, exp_id)
            study = optuna.create_study(
                study_name=spec.study, storage=storage, directions=spec.directions, sampler=sampler(spec)
            )
            study.set_user_attr("space_signature", spec.space_signature())
            study.set_user_attr("objectives", [o.label for o in spec.objectives])
            study.set_user_attr("n_points", spec.n_trials)
            log(f"created study {spec.study!r} in {spec.storage}")
        check_signature(spec, study)
        if [d.name.lower() for d in study.directions] != spec.directions:
            raise SpecError(
                f"{spec.path}: study {spec.study!r} exists with directions {study.directions}, spec asks {spec.directions}"
            )
        study.set_user_attr("mlflow_experiment_id", exp_id)
        save_view(spec, exp_id)
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
                    study.enqueue_trial(point, user_attrs=grid_attrs(spec, point, attempt=len(trials)))
                    enqueued += 1
        summary = {
            "study": spec.study,
            "experiment_id": exp_id,
            "enqueued": enqueued,
            "points": spec.n_trials,
        }
        log(f"init: {summary}")
        return summary


def check_no_finished_runs(spec: SweepSpec, exp_id: str) -> None:
    """Before a study is created: SpecError (one line) when the MLflow experiment already holds
    FINISHED trial runs of a study of this name. The journal was emptied, deleted or replaced after
    the sweep ran (the runs outlive it): a new study would re-run every point and leave two finished
    trial runs per point. Refused rather than adopted: the Optuna side of those trials (values,
    attempts, errors) is gone, and a sweep that resumes must not guess it."""
    flt = f"tags.`optuna.study` = '{spec.study}' and attributes.status = 'FINISHED'"
    done = [
        r
        for r in tracking.iter_runs(tracking.client(spec.tracking_uri), [exp_id], flt)
        if tracking.PARENT_TAG not in r.data.tags
    ]
    if done:
        keys = sorted({r.data.tags.get("mtpc.grid_key", "?") for r in done})
        raise SpecError(
            f"{spec.path}: study {spec.study!r} is not in {spec.storage} (an emptied, deleted or replaced journal?), "
            f"but MLflow experiment {spec.experiment!r} at {spec.tracking_uri} already holds {len(done)} finished "
            f"trial run(s) of it ({len(keys)} grid point(s): {', '.join(keys[:5])}{', ...' if len(keys) > 5 else ''}); "
            "a new study would run every point again: restore the journal, or give the spec a new `study` name, "
            "or delete those runs in MLflow first"
        )


def view_labels(spec: SweepSpec) -> list[str]:
    """The evaluation labels (`greedy`, `sample`, `sample-T0.7`, ...) a trial of this spec stores."""
    from experiments.evaluation.prompts import eval_passes  # light: no torch

    e = spec.eval
    return [
        tracking.evaluation_label({"mode": m, "temperature": t, "eos": eos, "extra_token": e.extra_token})
        for m, t in eval_passes(e.modes, e.temperatures)
        for eos in e.eos
    ]


def save_view(spec: SweepSpec, exp_id: str) -> None:
    """The experiment's saved runs view (tracking/views.py) with this spec's evaluation labels."""
    tracking.save_runs_view(spec.tracking_uri, exp_id, view_labels(spec))


def requeue_lost_runs(spec: SweepSpec) -> list[int]:
    """For `--resume`: COMPLETE trials whose MLflow run is missing (a lost or replaced tracking store)
    are named in a warning, and their point is enqueued again unless it has a trial waiting or
    running, or another COMPLETE trial whose run exists. Returns the numbers of the lost trials."""
    from filelock import FileLock
    from optuna.trial import TrialState

    with FileLock(str(spec.output_dir / f".{spec.study}.init.lock"), timeout=600):
        study = load_study(spec, open_storage(spec.storage))
        if study is None:
            return []
        client = tracking.client(spec.tracking_uri)
        by_key: dict[str, list] = {}
        for t in study.get_trials(deepcopy=False):
            by_key.setdefault(t.user_attrs.get("grid_key", ""), []).append(t)
        lost: list[int] = []
        for key, ts in sorted(by_key.items()):
            complete = [t for t in ts if t.state == TrialState.COMPLETE]
            if not complete or any(
                _run_exists(client, t.user_attrs.get("mlflow_parent_run_id")) for t in complete
            ):
                continue
            for t in complete:
                log(
                    f"warning: trial {t.number} ({key}) is COMPLETE in Optuna, but its MLflow run "
                    f"{t.user_attrs.get('mlflow_parent_run_id')} is missing from {spec.tracking_uri}: re-running the point"
                )
            lost += [t.number for t in complete]
            if not any(t.state in (TrialState.WAITING, TrialState.RUNNING) for t in ts):
                point = trial_point(complete[-1])
                attrs = {
                    **grid_attrs(spec, point, len(ts), retry_of=complete[-1].number),
                    "replaces_lost": [t.number for t in complete],
                }
                study.enqueue_trial(point, user_attrs=attrs)
        return lost


def _run_exists(client, run_id: str | None) -> bool:
    from mlflow.exceptions import MlflowException

    if not run_id:
        return False
    try:
        return client.get_run(run_id).info.lifecycle_stage != "deleted"
    except MlflowException:
        return False


PREEMPTED_ATTR = "preempted"
"""User attr set on a trial stopped on request after its checkpoint (exit 75): the reaper enqueues its
point again without spending a retry, and the new attempt resumes from the checkpoint (the run
directory is the point's)."""


def grid_attrs(
    spec: SweepSpec, point: dict[str, Any], attempt: int, retry_of: int | None = None
) -> dict[str, Any]:
    """User attrs of an enqueued grid trial: its key, the slices it belongs to, which attempt."""
    key = grid_key(point)
    attrs: dict[str, Any] = {
        "grid_key": key,
        "slices": list(spec.grid_slices.get(key, ())),
        "attempt": attempt,
    }
    if retry_of is not None:
        attrs["retry_of"] = retry_of
    return attrs


def enqueue_retry(spec: SweepSpec, study, t, *, attempt: int) -> None:
    """Enqueue the grid point of finished trial `t` again (attempt number `attempt`)."""
    point = trial_point(t)
    study.enqueue_trial(point, user_attrs=grid_attrs(spec, point, attempt, retry_of=t.number))
    log(f"re-enqueued {grid_key(point)} (attempt {attempt}, retry of trial {t.number})")


def trial_point(t) -> dict[str, Any]:
    """The grid point of a trial: its params, else the fixed params it was enqueued with, else (an
    `always` training axis, `tracking.axes`) its default; another axis the trial does not hold stays out."""
    fixed = t.system_attrs.get("fixed_params", {})
    held = {**fixed, **t.params}
    return {
        a.name: held.get(a.name, a.default)
        for a in axes.axes()
        if a.name in held or a.role == axes.ARCHITECTURE or a.always
    }


def experiment_id(spec: SweepSpec, study=None) -> str:
    """The id of the sweep's MLflow experiment, which --init created (never created here) and
    recorded on the study; a worker that would log elsewhere (the tracking URI changed since
    --init) is refused."""
    exp_id = tracking.experiment_id(spec.tracking_uri, spec.experiment)
    if exp_id is None:
        raise SpecError(
            f"{spec.path}: MLflow experiment {spec.experiment!r} not found at {spec.tracking_uri}; "
            f"run `python -m sweeps.run {spec.path} --init` first"
        )
    recorded = study.user_attrs.get("mlflow_experiment_id") if study is not None else None
    if recorded is not None and recorded != exp_id:
        raise SpecError(
            f"{spec.path}: study {spec.study!r} logs to MLflow experiment id {recorded}, but {spec.experiment!r} "
            f"at {spec.tracking_uri} has id {exp_id}: the tracking URI changed since --init "
            "(MLFLOW_TRACKING_URI?); use the URI the sweep was initialised with"
        )
    return exp_id


def pop_waiting(study, spec: SweepSpec | None = None) -> int | None:
    """Claim a WAITING trial (an atomic state change in the storage); its id, or None. With a grid
    spec, the point that comes first in the grid's order: a retry (enqueued last, under a new trial
    number) runs where its point belongs, so the slices still run in their fixed order; else by number."""
    from optuna.trial import TrialState

    storage = study._storage
    waiting = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
    if spec is not None and spec.grid is not None:
        order = {grid_key(p): i for i, p in enumerate(spec.grid)}
        waiting = sorted(
            waiting, key=lambda t: (order.get(t.user_attrs.get("grid_key"), len(order)), t.number)
        )
    for t in waiting:
        try:
            if storage.set_trial_state_values(t._trial_id, state=TrialState.RUNNING):
                return t._trial_id
        except Exception:  # noqa: BLE001 (finished/claimed by another worker meanwhile)
            continue
    return None


def ask_new(spec: SweepSpec, study) -> int | None:
    """A sampler space: a new trial while fewer than n_trials are not FAIL; its id, or None."""
    from optuna.trial import TrialState

    live = [t for t in study.get_trials(deepcopy=False) if t.state != TrialState.FAIL]
    if len(live) >= spec.n_trials:
        return None
    return study.ask()._trial_id


def suggest(spec: SweepSpec, trial) -> dict[str, Any]:
    """The trial's point: a grid trial's fixed params, or the sampler's draw."""
    if spec.grid is not None:  # the axes of the grid's points (tracking.axes order), each from its values
        names = [a for a in axes.names() if a in spec.grid[0]]
        choices = {p: sorted({pt[p] for pt in spec.grid}, key=str) for p in names}
        return {p: trial.suggest_categorical(p, choices[p]) for p in names}
    out: dict[str, Any] = {}
    for p, d in spec.sampler.params.items():
        if "choices" in d:
            out[p] = trial.suggest_categorical(p, d["choices"])
        else:
            out[p] = trial.suggest_int(p, d["low"], d["high"], log=d["log"])
    out["rank"] = point_rank(out["circuit"], out["rank"])
    # a sampler space searches the architecture; the training axes of every point stay at their defaults
    return {**out, **{a.name: a.default for a in axes.axes(axes.TRAINING) if a.always}}
