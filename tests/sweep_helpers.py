"""Helpers shared by the sweep, SLURM and MLflow-server tests: write a fixture spec, run the CLI,
read trials back from the Optuna journal and runs from MLflow, start and stop an `mlflow server` on
127.0.0.1 (stopped by its PID). No fixtures are defined here."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from tracking.screenshot import stop_server  # the one stop-by-PID of an mlflow server

REPO = Path(__file__).resolve().parents[1]


_TEMPLATE: Path | None = None


def fresh_tracking_uri(directory: Path) -> str:
    """A new MLflow sqlite store in `directory`: a copy of one migrated template (building the
    schema costs ~10 s on the 2-core machine; copying it is instant)."""
    global _TEMPLATE
    if _TEMPLATE is None:
        import tracking

        d = Path(tempfile.mkdtemp(prefix="mtpc-mlflow-template-"))
        tracking.ensure_experiment(f"sqlite:///{d / 'mlflow.db'}", "template")
        _TEMPLATE = d / "mlflow.db"
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(_TEMPLATE, directory / "mlflow.db")
    return f"sqlite:///{directory / 'mlflow.db'}"


def fixture_spec(tmp: Path, study: str, *, tracking_uri: str | None = None, **over: Any) -> Path:
    """A small grid spec with the fixture objective; `over` replaces top-level keys."""
    spec: dict[str, Any] = {
        "study": study,
        "objective": "fixture",
        "output_dir": str(tmp / "out"),
        "mlflow": {"experiment": study, **({"tracking_uri": tracking_uri} if tracking_uri else {})},
        "space": {
            "kind": "grid",
            "slices": {"a": {"circuit": ["cp", "hmm"], "rank": [2, 4], "window": [4], "lora_depth": [0]}},
        },
        "objectives": [{"metric": "throughput", "direction": "maximize"}],
        "eval": {"modes": ["greedy", "sample"], "sets": 1},
        "fixture": {"steps": 1},
    }
    spec.update(over)
    path = tmp / f"{study}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def run_cli(
    args: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 240
) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "sweeps.run", *args],
        capture_output=True,
        text=True,
        env=e,
        cwd=cwd or REPO,
        timeout=timeout,
    )


def trials(storage: str, study: str) -> list:
    import optuna

    from sweeps.study import open_storage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.load_study(study_name=study, storage=open_storage(storage)).get_trials()


def by_state(ts: list) -> dict[str, list]:
    out: dict[str, list] = {}
    for t in ts:
        out.setdefault(t.state.name, []).append(t)
    return out


def runs(tracking_uri: str, experiment: str) -> list:
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri)
    exp = c.get_experiment_by_name(experiment)
    assert exp is not None, f"experiment {experiment} missing at {tracking_uri}"
    return list(c.search_runs([exp.experiment_id], max_results=1000))


def check_complete_results(
    storage: str, study: str, tracking_uri: str, experiment: str, n_modes: int = 2
) -> list:
    """Every COMPLETE trial: parent run FINISHED, named `<study>/<grid key>`, with the per-mode
    summary metrics; its stored children FINISHED with the metrics; no grid point has two COMPLETE
    trials. Returns the COMPLETE trials."""
    ts = trials(storage, study)
    complete = [t for t in ts if t.state.name == "COMPLETE"]
    keys = [t.user_attrs["grid_key"] for t in complete]
    assert len(keys) == len(set(keys)), f"a grid point completed twice: {sorted(keys)}"
    rs = {r.info.run_id: r for r in runs(tracking_uri, experiment)}
    for t in complete:
        parent = rs[t.user_attrs["mlflow_parent_run_id"]]
        assert parent.info.status == "FINISHED", (t.number, parent.info.status)
        # named for the UI's runs table, with the compared metrics per mode on the trial's own row
        assert parent.info.run_name == f"{study}/{t.user_attrs['grid_key']}", parent.info.run_name
        for m in ("mu_acc", "mu_lat", "throughput", "speedup_vs_stp"):
            assert f"greedy/{m}" in parent.data.metrics, (parent.info.run_name, m)
        kids = t.user_attrs["mlflow_child_run_ids"]
        assert len(kids) == n_modes
        for k in kids:
            child = rs[k]
            assert child.info.status == "FINISHED"
            assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
            for m in ("mu_lat", "mu_acc", "tokens_per_cycle", "throughput", "max_throughput"):
                assert m in child.data.metrics, (k, m)
            for p in (
                "backbone",
                "circuit",
                "window",
                "rank",
                "lora_depth",
                "mode",
                "extra_token",
                "temperature",
                "prompt_set",
                "seed",
                "hardware",
                "top_p",
            ):
                assert p in child.data.params, (k, p)
            assert child.data.params["circuit"] == t.params["circuit"]
    return complete


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 2.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (local test server)
        return r.read()


def start_server(
    tmp: Path, port: int | None = None, backend: str | None = None
) -> tuple[subprocess.Popen, str]:
    """What docs/sweeps.md documents: an `mlflow server` on 127.0.0.1 with a sqlite backend in
    `tmp` (or the `backend` store URL, e.g. PostgreSQL) and artifacts served from a local directory,
    in its own session (pid = group id). A second start on the same `tmp` and `port` serves the same
    store again."""
    port = port or free_port()
    uri = f"http://127.0.0.1:{port}"
    tmp.mkdir(parents=True, exist_ok=True)
    if backend is None and not (tmp / "mlflow.db").exists():
        fresh_tracking_uri(tmp)  # an already-migrated schema, so the server starts sooner
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    log = open(tmp / "server.log", "a")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend-store-uri",
            backend or f"sqlite:///{tmp / 'mlflow.db'}",
            "--artifacts-destination",
            str(tmp / "artifacts"),
            "--workers",
            "1",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    deadline = time.time() + 180
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"mlflow server exited: {(tmp / 'server.log').read_text()[-2000:]}")
        try:
            if http_get(uri + "/health").strip() in (b"OK", b'"OK"'):
                return proc, uri
        except OSError:
            time.sleep(0.5)
    stop_server(proc)
    raise AssertionError(f"mlflow server did not answer /health: {(tmp / 'server.log').read_text()[-2000:]}")


def wait_for(pred, timeout: float, what: str):
    """Poll `pred` every 0.2 s until it returns something truthy (returned); fail the test after `timeout` s."""
    import pytest

    deadline = time.time() + timeout
    while time.time() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}")
