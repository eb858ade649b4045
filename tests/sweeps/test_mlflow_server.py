"""An `mlflow server` on 127.0.0.1 as the sweep's tracking store: two trials log to it at the same
time, results are read back with the client and the REST API, the server is stopped by PID (its
process group), and a sweep against the stopped server fails with a clear error."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from sweeps import run
from sweeps.spec import load_spec
from tests.sweep_helpers import REPO, check_complete_results, fixture_spec, fresh_tracking_uri, run_cli

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 2.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (local test server)
        return r.read()


def start_server(tmp: Path) -> tuple[subprocess.Popen, str]:
    """What docs/sweeps.md documents: sqlite backend, artifacts served from a local directory."""
    port = _free_port()
    uri = f"http://127.0.0.1:{port}"
    fresh_tracking_uri(tmp)  # tmp/mlflow.db: an already-migrated schema, so the server starts sooner
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    log = open(tmp / "server.log", "w")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{tmp / 'mlflow.db'}", "--artifacts-destination", str(tmp / "artifacts"),
         "--workers", "1"],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"mlflow server exited: {(tmp / 'server.log').read_text()[-2000:]}")
        try:
            if _get(uri + "/health") .strip() in (b"OK", b'"OK"'):
                return proc, uri
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"mlflow server did not answer /health: {(tmp / 'server.log').read_text()[-2000:]}")


def stop_server(proc: subprocess.Popen) -> None:
    """Stop by PID: the server was started in its own session, so its pid is the group id."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def test_two_concurrent_trials_log_to_a_server_then_it_stops(tmp_path):
    proc, uri = start_server(tmp_path)
    try:
        spec = fixture_spec(tmp_path, "srv", tracking_uri=uri, fixture={"steps": 5, "step_seconds": 1.0},
                            space={"slices": {"a": {"circuit": ["cp", "btree"], "rank": [4], "window": [4], "lora_depth": [0]}}})
        run.init(load_spec(spec, env={}))
        # two workers, one trial each, started together
        env = dict(os.environ, PYTHONPATH=str(REPO))
        procs = [subprocess.Popen([sys.executable, "-m", "sweeps.run", str(spec), "--worker", "--max-trials", "1"], env=env, cwd=REPO,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
        outs = [p.communicate(timeout=240)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs
        storage = f"journal:{tmp_path / 'out' / 'optuna.journal'}"
        complete = check_complete_results(storage, "srv", uri, "srv")
        assert len(complete) == 2
        # the two trials ran at the same time
        (a, b) = sorted(complete, key=lambda t: t.datetime_start)
        assert b.datetime_start < a.datetime_complete, ("trials did not overlap", a.datetime_start, a.datetime_complete, b.datetime_start)
        # REST: the experiment by name, then its finished runs (2 parents + 2 x 2 children)
        exp = json.loads(_get(f"{uri}/api/2.0/mlflow/experiments/get-by-name?experiment_name=srv"))["experiment"]
        body = json.dumps({"experiment_ids": [exp["experiment_id"]], "filter": "attributes.status = 'FINISHED'", "max_results": 100}).encode()
        req = urllib.request.Request(f"{uri}/api/2.0/mlflow/runs/search", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:  # noqa: S310
            found = json.loads(resp.read())["runs"]
        assert len(found) == 6
        kids = [x for x in found if any(t["key"] == "mlflow.parentRunId" for t in x["data"].get("tags", []))]
        assert len(kids) == 4
        assert all(any(m["key"] == "throughput" for m in x["data"]["metrics"]) for x in kids)
    finally:
        stop_server(proc)
    assert proc.returncode is not None
    with pytest.raises(OSError):
        _get(uri + "/health")
    # a sweep against the stopped server: a clear error, nothing reported complete
    spec2 = fixture_spec(tmp_path, "srv2", tracking_uri=uri)
    r = run_cli([str(spec2), "--workers", "1"])
    assert r.returncode == 2 and uri in r.stderr and "unreachable" in r.stderr, r.stderr[-2000:]
