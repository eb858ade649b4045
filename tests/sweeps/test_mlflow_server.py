"""An `mlflow server` on 127.0.0.1 as the sweep's tracking store: two trials log to it at the same
time, results are read back with the client and the REST API, the server is stopped by PID (its
process group), and a sweep against the stopped server fails with a clear error; a server that
stops mid-sweep stops the sweep (exit 69, the URI in the attempt's error), and `--resume` with the
server back completes it and leaves no run RUNNING."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

from sweeps import run
from sweeps.spec import load_spec
from tests.sweep_helpers import (
    REPO,
    by_state,
    check_complete_results,
    fixture_spec,
    http_get,
    run_cli,
    runs,
    start_server,
    stop_server,
    trials,
)

pytestmark = pytest.mark.slow


def test_two_concurrent_trials_log_to_a_server_then_it_stops(tmp_path):
    proc, uri = start_server(tmp_path)
    try:
        spec = fixture_spec(
            tmp_path,
            "srv",
            tracking_uri=uri,
            fixture={"steps": 5, "step_seconds": 1.0},
            space={
                "slices": {"a": {"circuit": ["cp", "btree"], "rank": [4], "window": [4], "lora_depth": [0]}}
            },
        )
        run.init(load_spec(spec, env={}))
        # two workers, one trial each, started together
        env = dict(os.environ, PYTHONPATH=str(REPO))
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "sweeps.run", str(spec), "--worker", "--max-trials", "1"],
                env=env,
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for _ in range(2)
        ]
        outs = [p.communicate(timeout=240)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs
        storage = f"journal:{tmp_path / 'out' / 'optuna.journal'}"
        complete = check_complete_results(storage, "srv", uri, "srv")
        assert len(complete) == 2
        # the two trials ran at the same time
        (a, b) = sorted(complete, key=lambda t: t.datetime_start)
        assert b.datetime_start < a.datetime_complete, (
            "trials did not overlap",
            a.datetime_start,
            a.datetime_complete,
            b.datetime_start,
        )
        # REST: the experiment by name, then its finished runs (2 parents + 2 x 2 children)
        exp = json.loads(http_get(f"{uri}/api/2.0/mlflow/experiments/get-by-name?experiment_name=srv"))[
            "experiment"
        ]
        body = json.dumps(
            {
                "experiment_ids": [exp["experiment_id"]],
                "filter": "attributes.status = 'FINISHED'",
                "max_results": 100,
            }
        ).encode()
        req = urllib.request.Request(
            f"{uri}/api/2.0/mlflow/runs/search", data=body, headers={"Content-Type": "application/json"}
        )
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
        http_get(uri + "/health")
    # a sweep against the stopped server: a clear error, nothing reported complete
    spec2 = fixture_spec(tmp_path, "srv2", tracking_uri=uri)
    r = run_cli([str(spec2), "--workers", "1"])
    assert r.returncode == 2 and uri in r.stderr and "unreachable" in r.stderr, r.stderr[-2000:]


def test_server_down_mid_sweep_stops_the_sweep_and_resume_closes_every_run(tmp_path):
    """The server stops while a trial logs to it: the attempt is FAIL with the tracking URI in its
    error (not the config file), the other points stay WAITING, the runner exits 69; with the
    server back, `--resume` completes every point and no run stays RUNNING. (All remaining trials
    used to fail within a second, the runner exited 0, and two parent runs stayed RUNNING.)"""
    srv = tmp_path / "srv"
    srv.mkdir()
    proc, uri = start_server(srv)
    port = int(uri.rsplit(":", 1)[1])
    env = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
    spec = fixture_spec(tmp_path, "down", tracking_uri=uri, fixture={"steps": 12, "step_seconds": 0.25})
    storage = f"journal:{tmp_path / 'out' / 'optuna.journal'}"
    e = dict(os.environ, PYTHONPATH=str(REPO), **env)
    err = open(tmp_path / "runner.err", "w")  # noqa: SIM115
    runner = subprocess.Popen(
        [sys.executable, "-m", "sweeps.run", str(spec), "--workers", "1"],
        env=e,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=err,
    )
    try:
        deadline = time.time() + 240
        while time.time() < deadline:  # one trial COMPLETE, the next one 2+ steps into logging
            try:
                st = by_state(trials(storage, "down"))
            except Exception:  # noqa: BLE001 (init has not created the study yet)
                st = {}
            ck = [
                tmp_path
                / "out"
                / "checkpoints"
                / "down"
                / t.user_attrs.get("grid_key", "?")
                / "fixture_state.json"
                for t in st.get("RUNNING", [])
            ]
            if len(st.get("COMPLETE", [])) == 1 and any(
                c.exists() and json.loads(c.read_text())["step"] >= 2 for c in ck
            ):
                break
            time.sleep(0.2)
        else:
            pytest.fail("the sweep did not get to its second trial")
    finally:
        stop_server(proc)
    try:
        rc = runner.wait(timeout=180)
    finally:
        if runner.poll() is None:
            runner.kill()
        err.close()
    log = (tmp_path / "runner.err").read_text()
    assert rc == 69, log[-3000:]
    assert f"error: MLflow tracking store {uri} cannot be written" in log and "stopped taking trials" in log
    ts = trials(storage, "down")
    st = by_state(ts)
    (failed,) = st["FAIL"]
    assert (
        f"MLflow tracking store {uri}" in failed.user_attrs["error"]
        and ".yaml" not in failed.user_attrs["error"]
    )
    assert len(st["COMPLETE"]) == 1 and len(st["WAITING"]) == 3  # two never started + the failed one again
    # the server comes back (same store, same port): --resume finishes the sweep and ends every run
    proc, uri2 = start_server(srv, port=port)
    try:
        assert uri2 == uri
        r = run_cli([str(spec), "--resume"], env=env, timeout=400)
        assert r.returncode == 0, r.stderr[-3000:]
        ts = trials(storage, "down")
        assert {t.user_attrs["grid_key"] for t in ts if t.state.name == "COMPLETE"} == {
            t.user_attrs["grid_key"] for t in ts
        }
        check_complete_results(storage, "down", uri, "down")
        statuses = {x.info.run_id: x for x in runs(uri, "down")}
        assert [x.info.run_name for x in statuses.values() if x.info.status == "RUNNING"] == []
        stale = statuses[failed.user_attrs["mlflow_parent_run_id"]]
        assert stale.info.status == "FAILED" and uri in stale.data.tags["mtpc.error"]
    finally:
        stop_server(proc)
