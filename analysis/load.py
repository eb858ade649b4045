"""Read evaluation runs from MLflow into one tidy pandas DataFrame.

One row per *evaluation* run (`tracking.is_evaluation_run`: a child run of a trial carrying the
params `mode` and `prompt_set`, written by `tracking.log_evaluation`). Parent (trial) runs,
analysis summary runs and unfinished runs are left out, and so are the evaluation runs of a deleted
(trashed) trial run. One evaluation (same experiment, params and prompt set) stored under several
finished trial runs (a grid point run twice: a sweep started again after its journal was emptied)
is never averaged: the newest trial run's evaluations are kept, the others left out with a warning
naming the grid point (`LoadResult.duplicates`). Params are typed (ints, floats, strings);
optional params (``extra_token``, ``temperature``, ``seed``, ``hardware``, ``top_p``, ``eos``,
``acceptance_method`` (absent: "online", how every run was evaluated before the offline method), and
the training axes of `tracking.axes` (``kl_beta``, ``kl_temperature``, ``train_seed``, ...), typed by
their rows) and optional metrics become NaN/None when absent (never the axis's default), so stores
written before a param existed still load. Per-position
acceptance metrics ``acceptance_pos_<i>`` (i = 1-based window position) become columns of their own.

`load` = the tracking-URI rule + open the store + pick the experiments + read + filter, with errors
a user can act on. Leaves out: filters (analysis/filters.py), histogram artifacts
(analysis/hists.py), aggregation, plotting and tables.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

import tracking
from analysis.filters import Filters, apply_filters
from tracking import axes
from tracking.schema import (
    ACCEPTANCE_PREFIX,
    BASELINE_METHODS,
    EVAL_METRICS,
    PARETO_METRICS,
    POINTS_TAG,
    grid_key,
)

#: the order the analysis shows the library's architecture axes in (n before r, as the tables read);
#: any other axis follows in `tracking.axes` order
ARCHITECTURE_ORDER: tuple[str, ...] = ("circuit", "window", "rank", "lora_depth")


def axis_names(role: str | None = None) -> list[str]:
    """The sweep axes (`tracking.axes`, read now) of one role or all, in the analysis's order."""
    names = axes.names(role)
    return [k for k in ARCHITECTURE_ORDER if k in names] + [k for k in names if k not in ARCHITECTURE_ORDER]


def required_params() -> dict[str, type]:
    """Params every evaluation run must carry, with their types (rank: but a baseline method's,
    BASELINE_METHODS): the backbone, the architecture axes, mode, prompt_set."""
    return {
        "backbone": str,
        **{k: axes.axis(k).type for k in axis_names(axes.ARCHITECTURE)},
        "mode": str,
        "prompt_set": str,
    }


def optional_params() -> dict[str, type]:
    """Params that may be absent (NaN / None then): the evaluation's, then every training axis
    (`tracking.axes`, typed by its row), then converged and acceptance_method."""
    return {
        "extra_token": str,
        "temperature": float,
        "seed": int,  # the evaluation's sampling seed (the training seed is the axis train_seed)
        "hardware": str,
        "top_p": float,
        "eos": str,  # banned | allowed (EOS_MODES)
        **{k: axes.axis(k).type for k in axis_names(axes.TRAINING)},
        "converged": int,  # 1: held-out window NLL changed < 1 % over the last fifth of training; 0: undertrained
        "acceptance_method": str,  # offline | online (ACCEPTANCE_METHODS); a run without it is online
    }


#: the shipped table's params at import (for reading; the loader calls the functions)
REQUIRED_PARAMS: dict[str, type] = required_params()
OPTIONAL_PARAMS: dict[str, type] = optional_params()
#: metrics without which a run cannot be placed on the Pareto plot or in a table
REQUIRED_METRICS: tuple[str, ...] = PARETO_METRICS
OPTIONAL_METRICS: tuple[str, ...] = tuple(m for m in EVAL_METRICS if m not in PARETO_METRICS)
#: per-position acceptance: acceptance_pos_<i>, i = 1-based window position
ACC_POS_RE = re.compile(rf"^{ACCEPTANCE_PREFIX}(\d+)$")


class AnalysisError(RuntimeError):
    """A problem with the store's contents or the selection that the user must fix (no traceback)."""


def resolve_experiment(client, experiment: str | None) -> list[Any]:
    """The experiments to read: ``experiment`` by name or id, else $MLFLOW_EXPERIMENT_NAME /
    $MLFLOW_EXPERIMENT_ID, else every active experiment that holds runs (several are read
    together; `--log-to-mlflow` then asks for one)."""
    if experiment is None:
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or os.environ.get("MLFLOW_EXPERIMENT_ID")
    if experiment is not None:
        exp = client.get_experiment_by_name(experiment)
        if exp is None and experiment.isdigit():
            try:
                exp = client.get_experiment(experiment)
            except Exception:  # noqa: BLE001 - not an id either
                exp = None
        if exp is None:
            names = sorted(e.name for e in client.search_experiments())
            raise AnalysisError(
                f"no MLflow experiment named (or with id) {experiment!r}; experiments in the store: "
                f"{', '.join(names) or '(none)'}"
            )
        return [exp]
    exps = []
    for exp in client.search_experiments():
        if client.search_runs([exp.experiment_id], max_results=1):
            exps.append(exp)
    if not exps:
        raise AnalysisError("the tracking store holds no runs in any experiment")
    return exps


@dataclass(frozen=True)
class SkippedRun:
    """An evaluation run left out of the DataFrame, and why."""

    run_id: str
    run_name: str
    missing: tuple[str, ...]  # names of missing/unparsable params or metrics
    reason: str = "missing"


@dataclass
class LoadResult:
    """The tidy DataFrame plus what was skipped on the way (for the CLI to report)."""

    runs: pd.DataFrame
    skipped: list[SkippedRun] = field(default_factory=list)
    n_unfinished: int = 0
    experiments: list[str] = field(default_factory=list)  # names
    missing_points: list[str] = field(
        default_factory=list
    )  # one note per experiment holding fewer grid points than its sweep
    n_of_deleted: int = 0  # evaluation runs left out: their trial (parent) run is deleted
    duplicates: list[str] = field(
        default_factory=list
    )  # one note per grid point evaluated under several trial runs

    def unfinished_note(self) -> str:
        return f"{self.n_unfinished} unfinished run(s) ignored" if self.n_unfinished else ""


def _parse(value: str | None, kind: type) -> Any:
    """Parse one param string; raises ValueError on a malformed value."""
    if value is None or value == "None" or value == "":
        return None
    if kind is int:
        f = float(value)  # accepts "8" and "8.0"
        if not f.is_integer():
            raise ValueError(value)
        return int(f)
    if kind is float:
        return float(value)
    return str(value)


def run_record(
    run_id: str,
    run_name: str,
    experiment_id: str,
    params: Mapping[str, str],
    metrics: Mapping[str, float],
    tags: Mapping[str, str] | None = None,
) -> dict[str, Any] | SkippedRun:
    """One DataFrame row from a run's params and metrics, or the reason it is skipped (pure)."""
    tags = tags or {}
    row: dict[str, Any] = {
        "run_id": run_id,
        "run_name": run_name,
        "experiment_id": experiment_id,
        "parent_run_id": tags.get(tracking.PARENT_TAG),
    }
    missing: list[str] = []
    for name, kind in required_params().items():
        try:
            value = _parse(params.get(name), kind)
        except ValueError:
            value = None
        if value is None and not (name == "rank" and row.get("circuit") in BASELINE_METHODS):
            missing.append(f"param {name}")  # a baseline method (EvaByte's own decoding) has no rank
        row[name] = value
    for name, kind in optional_params().items():
        try:
            row[name] = _parse(params.get(name), kind)
        except ValueError:
            missing.append(f"param {name} (unparsable {params.get(name)!r})")
    row["acceptance_method"] = (
        row.get("acceptance_method") or "online"
    )  # stores from before the param: online
    for name in REQUIRED_METRICS:
        value = metrics.get(name)
        if value is None or not math.isfinite(value):
            missing.append(name)
        row[name] = value
    for name in OPTIONAL_METRICS:
        row[name] = metrics.get(name)
    for name, value in metrics.items():
        if ACC_POS_RE.match(name):
            row[name] = value
    if missing:
        return SkippedRun(run_id, run_name, tuple(missing))
    return row


def _acceptance_pos_columns(columns) -> list[str]:
    found = [c for c in columns if ACC_POS_RE.match(str(c))]
    return sorted(found, key=lambda c: int(ACC_POS_RE.match(c).group(1)))


def records_to_frame(records: list[dict[str, Any]]) -> pd.DataFrame:
    """Typed DataFrame from `run_record` rows: Int64 for integer params, float64 for metrics and
    float params, object (str or None) for string params; columns in a fixed order."""
    base = ["run_id", "run_name", "experiment_id", "parent_run_id"]
    kinds = {**required_params(), **optional_params()}
    params = list(kinds)
    metrics = list(REQUIRED_METRICS) + list(OPTIONAL_METRICS)
    df = pd.DataFrame.from_records(records)
    acc = _acceptance_pos_columns(df.columns)
    columns = base + params + metrics + acc
    df = df.reindex(columns=columns)
    for name in params:
        kind = kinds[name]
        if kind is int:
            df[name] = df[name].astype("Int64")
        elif kind is float:
            df[name] = pd.to_numeric(df[name], errors="coerce").astype("float64")
        else:
            df[name] = df[name].astype(object).where(df[name].notna(), None)
    for name in metrics + acc:
        df[name] = pd.to_numeric(df[name], errors="coerce").astype("float64")
    for name in base:
        df[name] = df[name].astype(object)
    return df.reset_index(drop=True)


def deleted_run_ids(client, experiment_ids: list[str]) -> set[str]:
    """The ids of the experiments' deleted (trashed, not yet garbage-collected) runs."""
    from mlflow.entities import ViewType

    out: set[str] = set()
    token = None
    while True:
        page = client.search_runs(
            experiment_ids, run_view_type=ViewType.DELETED_ONLY, max_results=1000, page_token=token
        )
        out.update(r.info.run_id for r in page)
        token = page.token
        if not token:
            return out


#: params that tell one evaluation from another; `converged` is an outcome of training, not one of them
_IDENTITY = tuple(k for k in (*REQUIRED_PARAMS, *OPTIONAL_PARAMS) if k != "converged")


def newest_parent_only(
    records: list[dict[str, Any]], started: Mapping[str, int]
) -> tuple[list[dict[str, Any]], list[str]]:
    """`records` without the evaluations that a newer trial run of the same grid point repeats: where
    one evaluation (experiment, the `_IDENTITY` params, prompt set) is stored under several parent
    runs, only the parent whose evaluation runs started last keeps its rows. Returns the rows kept
    and one note per grid point that had such duplicates (pure; `started`: run id -> start time)."""
    newest: dict[str, int] = {}  # parent -> its latest evaluation start
    groups: dict[tuple, set[str]] = {}
    for r in records:
        parent = r.get("parent_run_id")
        if parent is None:
            continue
        newest[parent] = max(newest.get(parent, 0), started.get(r["run_id"]) or 0)
        groups.setdefault((r["experiment_id"], *(repr(r.get(k)) for k in _IDENTITY)), set()).add(parent)
    drop: set[str] = set()
    per_point: dict[tuple[str, str], set[str]] = {}
    for parents in groups.values():
        if len(parents) < 2:
            continue
        keep = max(parents, key=lambda p: (newest[p], p))
        drop |= parents - {keep}
    if not drop:
        return records, []
    kept = [r for r in records if r.get("parent_run_id") not in drop]
    for r in records:
        if r.get("parent_run_id") is not None:
            point = (r["experiment_id"], grid_key({k: r.get(k) for k in axes.names()}))
            per_point.setdefault(point, set()).add(r["parent_run_id"])
    notes = []
    for (exp, key), parents in sorted(per_point.items()):
        gone = sorted(parents & drop)
        if gone:
            n = sum(1 for r in records if r.get("parent_run_id") in gone)
            keep = sorted(parents - drop)
            notes.append(
                f"grid point {key} (experiment id {exp}) has finished evaluation runs under {len(parents)} trial runs "
                f"(the point ran twice, e.g. a sweep started again after its journal was emptied): kept the newest "
                f"trial run's ({', '.join(keep)}), left out {n} run(s) of {', '.join(gone)}; never averaged together"
            )
    return kept, notes


def load_runs(client, experiment_ids: list[str]) -> LoadResult:
    """Every finished evaluation run of the experiments as a typed DataFrame (no filters), without
    the runs of deleted trial runs and of trial runs a newer one of the same point repeats."""
    records: list[dict[str, Any]] = []
    skipped: list[SkippedRun] = []
    unfinished = of_deleted = 0
    deleted = deleted_run_ids(client, experiment_ids)
    started: dict[str, int] = {}
    for run in tracking.evaluation_runs(client, experiment_ids):
        if run.info.status != "FINISHED":
            unfinished += 1
            continue
        if (
            run.data.tags.get(tracking.PARENT_TAG) in deleted
        ):  # its trial run is in the trash: so are its results
            of_deleted += 1
            continue
        started[run.info.run_id] = run.info.start_time or 0
        rec = run_record(
            run.info.run_id,
            run.info.run_name or "",
            run.info.experiment_id,
            run.data.params,
            run.data.metrics,
            run.data.tags,
        )
        if isinstance(rec, SkippedRun):
            skipped.append(rec)
        else:
            records.append(rec)
    records, duplicates = newest_parent_only(records, started)
    return LoadResult(
        records_to_frame(records), skipped, unfinished, n_of_deleted=of_deleted, duplicates=duplicates
    )


def missing_points(experiments: list[Any], runs: pd.DataFrame) -> list[str]:
    """A note per experiment whose sweep (its `POINTS_TAG`) has more grid points than the runs here cover."""
    notes = []
    for e in experiments:
        expected = (e.tags or {}).get(POINTS_TAG)
        if not expected:
            continue
        rows = runs[runs["experiment_id"] == e.experiment_id] if "experiment_id" in runs else runs.iloc[0:0]
        cols = [a for a in axes.names() if a in rows.columns]
        found = len(rows[cols].drop_duplicates()) if len(rows) and cols else 0
        if found < int(expected):
            notes.append(
                f"experiment {e.name!r} holds evaluation runs of {found} of the sweep's {expected} grid points "
                "(unfinished, or a lost tracking store: `python -m sweeps.run <spec> --resume` re-runs them)"
            )
    return notes


def load(
    tracking_uri: str | None = None,
    experiment: str | None = None,
    filters: Filters | None = None,
) -> tuple[LoadResult, Any, str]:
    """Resolve (the tracking-URI rule: `tracking_uri` > $MLFLOW_TRACKING_URI > sqlite:///<cwd>/mlflow.db)
    + open the store + load + filter. Returns (result, client, uri).

    Raises tracking.TrackingError when the store cannot be read, AnalysisError when no run
    matches (naming the filters and how many runs each one left)."""
    where = tracking.resolve_uri(explicit=tracking_uri)
    uri = where.uri
    client = tracking.open_for_reading(uri, where.source)
    exps = resolve_experiment(client, experiment)
    ids = [e.experiment_id for e in exps]
    names = [e.name for e in exps]
    result = load_runs(client, ids)
    result.experiments = names
    result.missing_points = missing_points(exps, result.runs)
    n_all = len(result.runs)
    filters = filters or Filters()
    df, trail = apply_filters(result.runs, filters)
    if df.empty:
        where = f"experiment(s) {', '.join(repr(n) for n in names)} at {uri}"
        if n_all == 0:
            extra = ""
            if result.skipped:
                listed = "; ".join(
                    f"{r.run_id} ({r.run_name or 'unnamed'}): missing {', '.join(r.missing)}"
                    for r in result.skipped[:5]
                )
                more = f"; ... and {len(result.skipped) - 5} more" if len(result.skipped) > 5 else ""
                extra = f"; {len(result.skipped)} evaluation run(s) were skipped for missing params/metrics: {listed}{more}"
            if result.unfinished_note():
                extra += f"; {result.unfinished_note()}"
            raise AnalysisError(
                f"no usable evaluation runs (runs with params mode and prompt_set and metrics "
                f"{', '.join(REQUIRED_METRICS)}) in {where}{extra}"
            )
        steps = " -> ".join(f"{name}: {n}" for name, n in trail)
        raise AnalysisError(
            f"no runs match the filters ({filters.describe()}) in {where}: {n_all} evaluation "
            f"runs before filtering -> {steps}"
        )
    result.runs = df
    return result, client, uri
