"""Read evaluation runs from MLflow into one tidy pandas DataFrame.

One row per *evaluation* run: a run carrying the params ``mode`` and ``prompt_set`` (DESIGN
section 3 — each (mode, prompt_set) evaluation of a trial is a child run that copies every param).
Parent (trial) runs, analysis summary runs and unfinished runs are left out. Params are typed
(ints, floats, strings); optional params (``extra_token``, ``temperature``, ``seed``,
``hardware``, ``top_p``, ``eos``, and the training axes ``kl_beta``, ``kl_temperature``,
``train_seed``) and optional metrics become NaN/None when absent. Per-position
acceptance metrics ``acceptance_pos_<i>`` (i = 1-based window position) become columns of their own.

Also here: resolving the tracking URI and experiment with errors a user can act on, filtering,
and reading the accepted-length histogram artifact. No aggregation, plotting or tables.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from mtpc.names import (
    ACCEPTANCE_PREFIX,
    CIRCUIT_KINDS,
    DECODE_MODES,
    DEV_SET_PREFIX,
    EVAL_METRICS,
    EXTRA_TOKEN_OPTIONS,
    HISTOGRAM_ARTIFACT,
)

# --- names fixed by DESIGN section 3 -------------------------------------------------------------

#: params every evaluation run must carry, with their types
REQUIRED_PARAMS: dict[str, type] = {
    "backbone": str,
    "circuit": str,
    "window": int,
    "rank": int,
    "lora_depth": int,
    "mode": str,
    "prompt_set": str,
}
#: params that may be absent (NaN / None then)
OPTIONAL_PARAMS: dict[str, type] = {
    "extra_token": str,
    "temperature": float,
    "seed": int,
    "hardware": str,
    "top_p": float,
    "eos": str,  # banned | allowed (EOS_MODES)
    "kl_beta": float,  # training: weight of the distillation term (0: cross-entropy only)
    "kl_temperature": float,  # training: temperature of the teacher in the KL term
    "train_seed": int,  # training seed of the head (the evaluation seed is `seed`)
    "converged": int,  # 1: held-out window NLL changed < 1 % over the last fifth of training; 0: undertrained
}
#: metrics without which a run cannot be placed on the Pareto plot or in a table
REQUIRED_METRICS: tuple[str, ...] = EVAL_METRICS[:4]  # mu_lat, mu_acc, tokens_per_cycle, throughput
OPTIONAL_METRICS: tuple[str, ...] = EVAL_METRICS[4:]
#: per-position acceptance: acceptance_pos_<i>, i = 1-based window position
ACC_POS_PREFIX = ACCEPTANCE_PREFIX
ACC_POS_RE = re.compile(rf"^{ACCEPTANCE_PREFIX}(\d+)$")
#: accepted-length histogram artifact of an evaluation run
HIST_ARTIFACT = HISTOGRAM_ARTIFACT
#: tag set on the summary run that `pareto.py --log-to-mlflow` creates (never read back as data)
SUMMARY_TAG = "mtpc.analysis"

CIRCUIT_ORDER: tuple[str, ...] = CIRCUIT_KINDS
MODES: tuple[str, ...] = DECODE_MODES
DEFAULT_DB = "mlflow.db"

_PARENT_TAG = "mlflow.parentRunId"


class AnalysisError(RuntimeError):
    """A problem with the tracking store or its contents that the user must fix (no traceback)."""


# --- tracking URI and experiment ----------------------------------------------------------------


def resolve_tracking_uri(uri: str | None = None) -> tuple[str, str]:
    """Return (uri, where it came from): the argument, else $MLFLOW_TRACKING_URI, else MLflow 3's
    default ``sqlite:///<cwd>/mlflow.db``."""
    if uri:
        return uri, "--tracking-uri"
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env, "MLFLOW_TRACKING_URI"
    return f"sqlite:///{Path.cwd() / DEFAULT_DB}", "the default (./mlflow.db)"


def _sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///path`` URI (None for in-memory or other schemes)."""
    if not uri.startswith("sqlite:"):
        return None
    rest = uri[len("sqlite:") :]
    if not rest.startswith("///"):
        return None
    path = rest[3:].split("?", 1)[0]
    if path in ("", ":memory:"):
        return None
    # sqlite:////abs/path -> "/abs/path"; sqlite:///rel/path -> "rel/path"
    return Path(path)


@contextmanager
def _quick_http_failures() -> Iterator[None]:
    """Fail fast on an unreachable server: MLflow retries HTTP calls with backoff for minutes by
    default. Only variables the user did not set are touched, and only for the probe."""
    overrides = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
    added = [k for k in overrides if k not in os.environ]
    for k in added:
        os.environ[k] = overrides[k]
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def _short(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def connect(uri: str, source: str = "--tracking-uri"):
    """An ``MlflowClient`` for ``uri`` after checking that the store answers.

    Raises AnalysisError naming the URI and where it came from when the store is missing or
    unreachable. A sqlite file that does not exist is an error (MLflow would silently create an
    empty store there)."""
    from mlflow.tracking import MlflowClient

    db = _sqlite_path(uri)
    if db is not None and not db.is_file():
        raise AnalysisError(
            f"no MLflow database at {db} (tracking URI {uri!r} from {source}); pass --tracking-uri "
            "or set MLFLOW_TRACKING_URI to the store your sweep logged to"
        )
    client = MlflowClient(tracking_uri=uri)
    try:
        with _quick_http_failures():
            client.search_experiments(max_results=1)
    except Exception as exc:  # noqa: BLE001 - any failure here means "cannot read the store"
        raise AnalysisError(
            f"cannot reach the MLflow tracking store {uri!r} (from {source}): {_short(exc)}"
        ) from None
    return client


def resolve_experiment(client, experiment: str | None) -> list[Any]:
    """The experiments to read: ``experiment`` by name or id, else $MLFLOW_EXPERIMENT_NAME /
    $MLFLOW_EXPERIMENT_ID, else every active experiment that holds runs (several are read
    together; `pareto.py --log-to-mlflow` then asks for one)."""
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


# --- runs -> DataFrame --------------------------------------------------------------------------


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
        "parent_run_id": tags.get(_PARENT_TAG),
    }
    missing: list[str] = []
    for name, kind in REQUIRED_PARAMS.items():
        try:
            value = _parse(params.get(name), kind)
        except ValueError:
            value = None
        if value is None:
            missing.append(f"param {name}")
        row[name] = value
    for name, kind in OPTIONAL_PARAMS.items():
        try:
            row[name] = _parse(params.get(name), kind)
        except ValueError:
            missing.append(f"param {name} (unparsable {params.get(name)!r})")
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
    params = list(REQUIRED_PARAMS) + list(OPTIONAL_PARAMS)
    metrics = list(REQUIRED_METRICS) + list(OPTIONAL_METRICS)
    df = pd.DataFrame.from_records(records)
    acc = _acceptance_pos_columns(df.columns)
    columns = base + params + metrics + acc
    df = df.reindex(columns=columns)
    for name in params:
        kind = {**REQUIRED_PARAMS, **OPTIONAL_PARAMS}[name]
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


def _iter_runs(client, experiment_ids: list[str]) -> Iterator[Any]:
    token = None
    while True:
        page = client.search_runs(experiment_ids, max_results=1000, page_token=token)
        yield from page
        token = page.token
        if not token:
            break


def load_runs(client, experiment_ids: list[str]) -> LoadResult:
    """Every finished evaluation run of the experiments as a typed DataFrame (no filters)."""
    records: list[dict[str, Any]] = []
    skipped: list[SkippedRun] = []
    unfinished = 0
    for run in _iter_runs(client, experiment_ids):
        params, tags = run.data.params, run.data.tags
        if SUMMARY_TAG in tags or "mode" not in params or "prompt_set" not in params:
            continue  # a trial (parent) run, a summary run, or not ours
        if run.info.status != "FINISHED":
            unfinished += 1
            continue
        rec = run_record(
            run.info.run_id,
            run.info.run_name or "",
            run.info.experiment_id,
            params,
            run.data.metrics,
            tags,
        )
        if isinstance(rec, SkippedRun):
            skipped.append(rec)
        else:
            records.append(rec)
    return LoadResult(records_to_frame(records), skipped, unfinished)


# --- filters ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Filters:
    """Row filters; None = no filter. Each list means "any of these values"."""

    backbone: tuple[str, ...] | None = None
    mode: tuple[str, ...] | None = None
    extra_token: tuple[str, ...] | None = None
    temperature: tuple[float, ...] | None = None
    window: tuple[int, ...] | None = None
    lora_depth: tuple[int, ...] | None = None
    circuit: tuple[str, ...] | None = None
    prompt_sets: str = "reported"
    """reported (default: development sets "dev<i>" left out), dev (only those) or all"""

    def __post_init__(self) -> None:
        if self.mode is not None:
            bad = [m for m in self.mode if m not in MODES]
            if bad:
                raise ValueError(f"filter mode={bad}: expected values in {list(MODES)}")
        if self.extra_token is not None:
            bad = [m for m in self.extra_token if m not in EXTRA_TOKEN_OPTIONS]
            if bad:
                raise ValueError(f"filter extra_token={bad}: expected values in {list(EXTRA_TOKEN_OPTIONS)}")
        if self.prompt_sets not in ("reported", "dev", "all"):
            raise ValueError(f"filter prompt_sets={self.prompt_sets!r}: expected 'reported', 'dev' or 'all'")
        if self.circuit is not None:
            bad = [m for m in self.circuit if m not in CIRCUIT_ORDER]
            if bad:
                raise ValueError(f"filter circuit={bad}: expected values in {list(CIRCUIT_ORDER)}")

    def active(self) -> dict[str, tuple]:
        return {k: v for k, v in self.__dict__.items() if v is not None and k != "prompt_sets"}

    def describe(self) -> str:
        act = self.active()
        parts = [f"{k} in {list(v)}" if len(v) > 1 else f"{k}={v[0]}" for k, v in act.items()]
        if self.prompt_sets != "reported":
            parts.append(f"prompt sets: {self.prompt_sets}")
        return ", ".join(parts) or "no filters"


def apply_filters(df: pd.DataFrame, filters: Filters) -> tuple[pd.DataFrame, list[tuple[str, int]]]:
    """Rows that pass every filter, and the row count after each filter (to explain an empty
    result). Float filters compare with a tolerance (temperature 0.7 == "0.7000001")."""
    trail: list[tuple[str, int]] = []
    out = df
    if filters.prompt_sets != "all":
        dev = out["prompt_set"].astype(str).str.startswith(DEV_SET_PREFIX).to_numpy(dtype=bool)
        before = len(out)
        out = out[dev if filters.prompt_sets == "dev" else ~dev]
        if filters.prompt_sets == "dev" or len(out) != before:
            trail.append((f"prompt sets={filters.prompt_sets}", len(out)))
    for name, values in filters.active().items():
        col = out[name]
        if name == "temperature":
            vals = np.asarray(values, dtype=float)
            x = col.to_numpy(dtype=float, na_value=np.nan)
            keep = np.isclose(x[:, None], vals[None, :], rtol=1e-6, atol=1e-9).any(axis=1)
        else:
            keep = col.isin(list(values)).to_numpy(dtype=bool, na_value=False)
        out = out[keep]
        trail.append((f"{name}={list(values) if len(values) > 1 else values[0]}", len(out)))
    return out.reset_index(drop=True), trail


def load(
    tracking_uri: str | None = None,
    experiment: str | None = None,
    filters: Filters | None = None,
) -> tuple[LoadResult, Any, str]:
    """Resolve + connect + load + filter. Returns (result, client, uri).

    Raises AnalysisError when the store cannot be read or when no run matches (naming the
    filters and how many runs each one left)."""
    uri, source = resolve_tracking_uri(tracking_uri)
    client = connect(uri, source)
    exps = resolve_experiment(client, experiment)
    ids = [e.experiment_id for e in exps]
    names = [e.name for e in exps]
    result = load_runs(client, ids)
    result.experiments = names
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


# --- accepted-length histogram artifact ---------------------------------------------------------


def parse_hist(data: Any) -> np.ndarray:
    """Counts indexed by accepted length from the artifact's JSON.

    Accepted forms: a list of counts ``[c0, c1, ...]``; a mapping ``{"0": c0, "3": c3}``; or
    either of those under a key ``"accepted_length_histogram"`` (what experiments.evaluate writes) / ``"counts"`` / ``"hist"``. Raises ValueError otherwise."""
    if isinstance(data, Mapping):
        for key in ("accepted_length_histogram", "counts", "hist", "histogram"):
            if key in data:
                return parse_hist(data[key])
        try:
            items = {int(k): float(v) for k, v in data.items()}
        except (TypeError, ValueError):
            raise ValueError(
                f"{HIST_ARTIFACT}: expected a list of counts or a mapping length -> count, got keys "
                f"{list(data)[:5]}"
            ) from None
        if not items:
            return np.zeros(0)
        if min(items) < 0:
            raise ValueError(f"{HIST_ARTIFACT}: negative accepted length {min(items)}")
        out = np.zeros(max(items) + 1)
        for k, v in items.items():
            out[k] = v
        return out
    if isinstance(data, list) and all(isinstance(v, (int, float)) for v in data):
        return np.asarray(data, dtype=float)
    raise ValueError(f"{HIST_ARTIFACT}: expected a list of counts or a mapping length -> count")


def load_hists(client, run_ids: list[str]) -> tuple[dict[str, np.ndarray], list[str]]:
    """Accepted-length counts per run id for the runs that have the artifact (others left out),
    and one message per artifact that could not be read."""
    from tqdm import tqdm

    out: dict[str, np.ndarray] = {}
    problems: list[str] = []
    key = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"  # one bar of ours, not one per downloaded file
    old = os.environ.get(key)
    os.environ[key] = "false"
    try:
        with tempfile.TemporaryDirectory() as tmp:
            bar = tqdm(run_ids, desc="histograms", unit="run", disable=len(run_ids) < 50, leave=False)
            for i, run_id in enumerate(bar):
                try:
                    if HIST_ARTIFACT not in {f.path for f in client.list_artifacts(run_id)}:
                        continue
                    dst = Path(tmp) / str(i)
                    dst.mkdir()
                    path = client.download_artifacts(run_id, HIST_ARTIFACT, str(dst))
                    out[run_id] = parse_hist(json.loads(Path(path).read_text()))
                except (OSError, ValueError) as exc:  # JSONDecodeError is a ValueError
                    problems.append(f"run {run_id}: {HIST_ARTIFACT} unreadable: {_short(exc)}")
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old
    return out, problems
