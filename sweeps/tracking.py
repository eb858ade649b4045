"""MLflow plumbing for sweeps: reachability checks, the experiment (created once, selected by id),
the parent run of a trial, child runs per (mode, prompt_set), and reading results back.

Uses `MlflowClient` with explicit run ids (no fluent global state), so several trials in one
process or thread never mix runs. What it leaves out: computing any metric (the objectives do).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from mtpc.names import EVAL_METRICS

PARENT_TAG = "mlflow.parentRunId"
# every child run must carry these (mu_lat, mu_acc, tokens_per_cycle, throughput, max_throughput)
REQUIRED_CHILD_METRICS = EVAL_METRICS[:5]


class TrackingError(RuntimeError):
    """The MLflow tracking store is unreachable or did not store what a trial needs."""


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def check_tracking(uri: str, timeout: float = 5.0) -> None:
    """Raise TrackingError unless the tracking store can be reached (http: /health answers;
    sqlite / file: the directory exists or can be created)."""
    parsed = urlparse(uri)
    if parsed.scheme in ("http", "https"):
        url = uri.rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (user's URI)
                if r.status != 200:
                    raise TrackingError(f"MLflow server {uri}: /health answered HTTP {r.status}")
        except (TimeoutError, urllib.error.URLError, OSError) as e:
            raise TrackingError(f"MLflow tracking server {uri} is unreachable ({e}); start it or fix mlflow.tracking_uri / MLFLOW_TRACKING_URI") from e
        return
    if parsed.scheme == "sqlite":
        path = Path(uri[len("sqlite:///"):]) if uri.startswith("sqlite:///") else None
        if path is None or str(path) == "":
            raise TrackingError(f"MLflow URI {uri}: expected sqlite:///<path>")
        _writable_dir(path.parent, f"MLflow store {uri}")
        return
    if parsed.scheme in ("", "file"):
        if os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() != "true":
            raise TrackingError(
                f"MLflow URI {uri} is a plain file store, which MLflow 3 refuses unless MLFLOW_ALLOW_FILE_STORE=true; "
                "use sqlite:///<path> or an http server"
            )
        _writable_dir(Path(parsed.path or uri), f"MLflow store {uri}")
        return
    # other schemes (postgresql://, databricks, ...): let the client try
    try:
        _client(uri).search_experiments(max_results=1)
    except Exception as e:  # noqa: BLE001 (any driver error means: unreachable)
        raise TrackingError(f"MLflow tracking URI {uri} is unreachable: {e}") from e


def _writable_dir(d: Path, what: str) -> None:
    try:
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=d, prefix=".probe-"):
            pass
    except OSError as e:
        raise TrackingError(f"{what}: directory {d} is not writable ({e})") from e


def ensure_experiment(uri: str, name: str) -> str:
    """Create the experiment if missing and return its id (called once, by --init, before jobs)."""
    from mlflow.exceptions import MlflowException

    client = _client(uri)
    exp = client.get_experiment_by_name(name)
    if exp is None:
        # local stores: artifacts next to the database, not in ./mlruns of whatever cwd a job has
        artifacts = None
        if uri.startswith("sqlite:///"):
            artifacts = (Path(uri[len("sqlite:///"):]).parent / "mlartifacts").resolve().as_uri()
        try:
            return client.create_experiment(name, artifact_location=artifacts)
        except MlflowException:  # created concurrently: fine, read it back
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise
    if exp.lifecycle_stage == "deleted":
        raise TrackingError(f"MLflow experiment {name!r} exists but is deleted; restore it or pick another name")
    return exp.experiment_id


def git_sha(cwd: str | Path | None = None) -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10)
        sha = out.stdout.strip()
        if out.returncode == 0 and sha:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd, capture_output=True, text=True, timeout=10)
            return sha + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def hardware() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 (torch absent in the fixture path is fine)
        pass
    return f"cpu-{os.cpu_count()}cores"


def start_parent_run(uri: str, experiment_id: str, run_name: str, *, params: dict[str, Any], tags: dict[str, str], resume_run_id: str | None = None) -> str:
    """Create (or reopen, when resuming a trial) the trial's parent run; log params and tags."""
    client = _client(uri)
    if resume_run_id:
        client.update_run(resume_run_id, status="RUNNING")
        run_id = resume_run_id
    else:
        run_id = client.create_run(experiment_id, run_name=run_name, tags=tags).info.run_id
    log_params(uri, run_id, params)
    if resume_run_id:
        for k, v in tags.items():
            client.set_tag(run_id, k, v)
    return run_id


def log_params(uri: str, run_id: str, params: dict[str, Any]) -> None:
    from mlflow.entities import Param

    client = _client(uri)
    existing = client.get_run(run_id).data.params
    new = [Param(k, _param_str(v)) for k, v in params.items() if k not in existing]
    for i in range(0, len(new), 100):
        client.log_batch(run_id, params=new[i : i + 100])


def _param_str(v: Any) -> str:
    s = v if isinstance(v, str) else json.dumps(v) if isinstance(v, (dict, list, tuple)) else str(v)
    return s[:6000]


def log_metrics(uri: str, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
    from mlflow.entities import Metric

    ts = int(time.time() * 1000)
    ms = [Metric(k, float(v), ts, step) for k, v in metrics.items()]
    client = _client(uri)
    for i in range(0, len(ms), 500):
        client.log_batch(run_id, metrics=ms[i : i + 500])


def log_child_run(uri: str, experiment_id: str, parent_run_id: str, run_name: str, *, params: dict[str, Any], metrics: dict[str, float], artifacts: dict[str, Any] | None = None) -> str:
    """One evaluation (mode, prompt_set) as a FINISHED child run of the trial's parent run."""
    client = _client(uri)
    run_id = client.create_run(experiment_id, run_name=run_name, tags={PARENT_TAG: parent_run_id}).info.run_id
    try:
        log_params(uri, run_id, params)
        log_metrics(uri, run_id, metrics)
        for name, obj in (artifacts or {}).items():
            client.log_dict(run_id, obj, name)
    except Exception:
        client.set_terminated(run_id, "FAILED")
        raise
    client.set_terminated(run_id, "FINISHED")
    return run_id


def child_runs(uri: str, experiment_id: str, parent_run_id: str, *, finished_only: bool = True) -> list:
    client = _client(uri)
    flt = f"tags.`{PARENT_TAG}` = '{parent_run_id}'"
    if finished_only:
        flt += " and attributes.status = 'FINISHED'"
    return list(client.search_runs([experiment_id], filter_string=flt, max_results=1000))


def discard_children(uri: str, experiment_id: str, parent_run_id: str) -> int:
    """Delete (soft) the children of an interrupted attempt, so a resumed trial reports only the
    evaluations of its final attempt."""
    client = _client(uri)
    runs = child_runs(uri, experiment_id, parent_run_id, finished_only=False)
    for r in runs:
        client.delete_run(r.info.run_id)
    return len(runs)


def terminate(uri: str, run_ids: list[str], status: str) -> None:
    client = _client(uri)
    for rid in run_ids:
        client.set_terminated(rid, status)


def set_tags(uri: str, run_id: str, tags: dict[str, str]) -> None:
    client = _client(uri)
    for k, v in tags.items():
        client.set_tag(run_id, k, str(v)[:5000])
