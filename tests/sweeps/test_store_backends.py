"""The many-worker stores for real: a sweep of 8 grid points with 4 concurrent workers, one of them
killed with kill -9 mid-trial, on each Optuna store a user can pick — the journal file (the one-file
default, on the folder the workers share) and a PostgreSQL server (started here from Debian's
package by sweeps/local_postgres.sh on 127.0.0.1, stopped by its PID) with an `mlflow server` whose
backend store is the same PostgreSQL. Every grid point COMPLETE exactly once, one MLflow parent run
per trial (the killed one KILLED, its retry resuming from the checkpoint), nothing left RUNNING."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sweeps.spec import load_spec
from tests.sweep_helpers import (
    REPO,
    by_state,
    check_complete_results,
    fixture_spec,
    fresh_tracking_uri,
    runs,
    start_server,
    stop_server,
    trials,
    wait_for,
)

pytestmark = pytest.mark.slow
SCRIPT = REPO / "sweeps" / "local_postgres.sh"
GRID = {"a": {"circuit": ["cp", "hmm"], "rank": [2, 4], "window": [4, 8], "lora_depth": [0]}}  # 8 points


@pytest.fixture(scope="module")
def postgres(tmp_path_factory):
    r = subprocess.run(["bash", str(SCRIPT), "start"], capture_output=True, text=True, timeout=600)
    if r.returncode == 3:
        pytest.skip(f"PostgreSQL not installable here: {r.stderr.strip()[-300:]}")
    assert r.returncode == 0, r.stderr
    env = dict(
        line[len("export ") :].split("=", 1) for line in r.stdout.splitlines() if line.startswith("export ")
    )
    pid = int((Path(env["MTPC_PG_DIR"]) / "data" / "postmaster.pid").read_text().split()[0])
    for db in ("optuna", "mlflow"):
        subprocess.run(
            ["bash", str(SCRIPT), "createdb", env["MTPC_PG_DIR"], db],
            check=True,
            capture_output=True,
            timeout=60,
        )
    yield env["MTPC_PG_URL"]
    subprocess.run(["bash", str(SCRIPT), "stop", env["MTPC_PG_DIR"]], capture_output=True, timeout=60)
    assert not os.path.exists(f"/proc/{pid}"), "postgres still running after stop"


def _sweep_with_a_killed_worker(tmp_path, study: str, storage: str | None, tracking_uri: str):
    extra = {"storage": storage} if storage else {}
    spec_path = fixture_spec(
        tmp_path,
        study,
        tracking_uri=tracking_uri,
        space={"kind": "grid", "slices": GRID},
        fixture={"steps": 12, "step_seconds": 0.25},
        **extra,
    )
    spec = load_spec(spec_path, env={})
    err = open(tmp_path / "runner.err", "w")  # noqa: SIM115
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("MTPC_OPTUNA_STORAGE", None)
    p = subprocess.Popen(
        [sys.executable, "-m", "sweeps.run", str(spec_path), "--workers", "4"],
        env=env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=err,
    )
    try:

        def running_with_steps():
            try:
                ts = trials(spec.storage, study)
            except Exception:  # noqa: BLE001 (the study is not created yet)
                return None
            for t in ts:
                if t.state.name == "RUNNING" and "grid_key" in t.user_attrs:
                    ck = (
                        spec.output_dir
                        / "checkpoints"
                        / study
                        / t.user_attrs["grid_key"]
                        / "fixture_state.json"
                    )
                    if ck.exists() and json.loads(ck.read_text())["step"] >= 2:
                        return t
            return None

        victim = wait_for(running_with_steps, 300, "a trial RUNNING with 2+ steps checkpointed")
        pid = json.loads(victim.user_attrs["owner"])["pid"]
        os.kill(pid, signal.SIGKILL)
        rc = p.wait(timeout=600)
    finally:
        if p.poll() is None:
            p.kill()
        err.close()
    log = (tmp_path / "runner.err").read_text()
    assert rc == 0, log[-3000:]
    ts = trials(spec.storage, study)
    st = by_state(ts)
    assert len(st["COMPLETE"]) == 8 and "RUNNING" not in st and "WAITING" not in st, {
        k: len(v) for k, v in st.items()
    }
    killed = next(t for t in ts if t.number == victim.number)
    assert killed.state.name == "FAIL" and str(pid) in killed.user_attrs["error"]
    (retry,) = [t for t in ts if t.user_attrs.get("retry_of") == victim.number]
    assert retry.state.name == "COMPLETE" and retry.user_attrs["resumed_from_step"] > 0
    complete = check_complete_results(
        spec.storage, study, tracking_uri, study
    )  # each point once, runs FINISHED
    owners = {json.loads(t.user_attrs["owner"])["pid"] for t in ts}
    assert len(owners) >= 4, f"fewer than 4 workers took trials: {owners}"
    parents = [r for r in runs(tracking_uri, study) if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == len(complete) + 1, [r.info.run_name for r in parents]  # + the killed attempt
    statuses = sorted(r.info.status for r in parents)
    assert statuses.count("KILLED") == 1 and statuses.count("FINISHED") == 8
    return spec


def test_journal_store_four_workers_each_point_once(tmp_path):
    spec = _sweep_with_a_killed_worker(tmp_path, "journal4", None, fresh_tracking_uri(tmp_path / "mlflow"))
    assert spec.storage.startswith("journal:")


def test_postgres_store_and_mlflow_server_four_workers_each_point_once(tmp_path, postgres):
    proc, uri = start_server(tmp_path / "server", backend=f"{postgres}/mlflow")
    try:
        spec = _sweep_with_a_killed_worker(tmp_path, "pg4", f"{postgres}/optuna", uri)
    finally:
        stop_server(proc)
    assert spec.storage.startswith("postgresql://")
