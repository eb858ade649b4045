"""The sweep runner without SLURM, on the fixture objective: exactly-once over the grid with
concurrent workers, re-runs add nothing, failures are marked and logged, the reaper fails and
re-enqueues trials of dead workers (which then resume from their checkpoint), bad stores are
refused before any work, a down MLflow server fails the trial instead of completing it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from sweeps import run, tracking
from sweeps.spec import SpecError, load_spec
from tests.sweep_helpers import (
    REPO,
    by_state,
    check_complete_results,
    fixture_spec,
    fresh_tracking_uri,
    run_cli,
    runs,
    trials,
)


@pytest.fixture(scope="module")
def tracking_uri(tmp_path_factory):
    """One MLflow sqlite store for the module (creating one costs ~10 s of migrations)."""
    return fresh_tracking_uri(tmp_path_factory.mktemp("mlflow"))


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


@pytest.mark.slow
def test_local_workers_run_each_point_once_and_rerun_adds_nothing(tmp_path, tracking_uri):
    spec_path = fixture_spec(tmp_path, "local2", tracking_uri=tracking_uri, fixture={"steps": 2, "fail": [{"circuit": "hmm", "rank": 4}]})
    spec = load_spec(spec_path, env={})
    r = run_cli([str(spec_path), "--workers", "2"])
    assert r.returncode == 0, r.stderr[-3000:]
    ts = trials(spec.storage, "local2")
    st = by_state(ts)
    assert len(ts) == 4 and len(st["COMPLETE"]) == 3 and len(st["FAIL"]) == 1, {k: len(v) for k, v in st.items()}
    failed = st["FAIL"][0]
    assert failed.user_attrs["grid_key"] == "hmm-r4-n4-k0"
    assert "forced failure" in failed.user_attrs["error"]
    parent = {x.info.run_id: x for x in runs(tracking_uri, "local2")}[failed.user_attrs["mlflow_parent_run_id"]]
    assert parent.info.status == "FAILED" and "forced failure" in parent.data.tags["mtpc.error"]
    check_complete_results(spec.storage, "local2", tracking_uri, "local2")
    # the two workers shared the work
    owners = {json.loads(t.user_attrs["owner"])["pid"] for t in ts}
    assert len(owners) == 2
    n_runs = len(runs(tracking_uri, "local2"))
    # running the finished sweep again (init + a worker, in-process) does no new work
    assert run.init(spec)["enqueued"] == 0
    assert run.worker(spec) == 0
    assert len(trials(spec.storage, "local2")) == 4
    assert len(runs(tracking_uri, "local2")) == n_runs


def test_same_study_with_another_space_is_refused(tmp_path, tracking_uri):
    a = load_spec(fixture_spec(tmp_path, "space", tracking_uri=tracking_uri), env={})
    run.init(a)
    other = fixture_spec(tmp_path, "space", tracking_uri=tracking_uri,
                         space={"slices": {"a": {"circuit": ["btree"], "rank": [2], "window": [4], "lora_depth": [0]}}})
    b = load_spec(other, env={})
    with pytest.raises(SpecError, match="different space"):
        run.init(b)
    with pytest.raises(SpecError, match="different space"):
        run.worker(b)
    assert len(trials(a.storage, "space")) == 4  # nothing was enqueued for b


def test_unreachable_optuna_storage_is_a_clear_error_before_submitting(tmp_path, tracking_uri):
    spec_path = fixture_spec(tmp_path, "nostore", tracking_uri=tracking_uri)
    url = "postgresql://sweeper@127.0.0.1:9/optuna"
    r = run_cli([str(spec_path), "--submit"], env={"MTPC_OPTUNA_STORAGE": url, "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2, r.stderr[-2000:]
    assert url in r.stderr and "unreachable" in r.stderr
    assert "submitting" not in r.stderr and "Traceback" not in r.stderr
    r = run_cli([str(spec_path), "--check"], env={"MTPC_OPTUNA_STORAGE": "/proc/no/such/dir/optuna.journal"})
    assert r.returncode == 2 and "not writable" in r.stderr and "/proc/no/such/dir" in r.stderr


def test_unreachable_mlflow_is_a_clear_error_before_any_trial(tmp_path):
    spec_path = fixture_spec(tmp_path, "nomlflow", tracking_uri="http://127.0.0.1:9")
    r = run_cli([str(spec_path), "--init"])
    assert r.returncode == 2 and "http://127.0.0.1:9" in r.stderr and "unreachable" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "out" / "optuna.journal").exists() or "created study" not in r.stderr


def test_mlflow_down_during_a_trial_fails_it(tmp_path, tracking_uri, monkeypatch):
    """Init against a working store, then the store goes away: the trial is FAIL with the URI in
    its error, never COMPLETE."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "3")
    spec = load_spec(fixture_spec(tmp_path, "down", tracking_uri=tracking_uri), env={})
    run.init(spec)
    study = run._load_study(spec, run.open_storage(spec.storage))
    exp_id = run._experiment_id(spec, study)
    dead = "http://127.0.0.1:9"
    broken = spec.__class__(**{**spec.__dict__, "tracking_uri": dead})
    tid = run._pop_waiting(study)
    run.run_one(broken, study, tid, exp_id, run.Owner.current(), run.StopFlag())
    t = study._storage.get_trial(tid)
    assert t.state.name == "FAIL"
    assert "127.0.0.1:9" in t.user_attrs["error"]
    with pytest.raises(tracking.TrackingError, match="unreachable"):
        run.worker(broken)  # a worker refuses to start trials against a down server
    assert by_state(trials(spec.storage, "down")).get("WAITING") and not by_state(trials(spec.storage, "down")).get("COMPLETE")


def test_reaper_fails_dead_workers_trial_and_the_rerun_resumes(tmp_path, tracking_uri):
    spec = load_spec(fixture_spec(tmp_path, "reap", tracking_uri=tracking_uri, fixture={"steps": 3}), env={})
    run.init(spec)
    study = run._load_study(spec, run.open_storage(spec.storage))
    exp_id = run._experiment_id(spec, study)
    tid = run._pop_waiting(study)
    t = study._storage.get_trial(tid)
    key = t.user_attrs["grid_key"]
    # a worker that died mid-trial: its pid is gone, its parent run is open, 2 of 3 steps are checkpointed
    dead = run.Owner(host=run.Owner.current().host, pid=_dead_pid(), pid_start="1", slurm_job_id=None, slurm_restart=0)
    study._storage.set_trial_user_attr(tid, "owner", dead.to_json())
    parent = tracking.start_parent_run(tracking_uri, exp_id, "dead", params={}, tags={})
    study._storage.set_trial_user_attr(tid, "mlflow_parent_run_id", parent)
    study._storage.set_trial_user_attr(tid, "mlflow_experiment_id", exp_id)
    ck = spec.output_dir / "checkpoints" / "reap" / key
    ck.mkdir(parents=True)
    (ck / "fixture_state.json").write_text('{"step": 2}')
    assert run.worker(spec) == 0
    ts = trials(spec.storage, "reap")
    old = ts[t.number]
    assert old.state.name == "FAIL" and "worker died" in old.user_attrs["error"]
    retry = [x for x in ts if x.user_attrs.get("retry_of") == t.number]
    assert len(retry) == 1 and retry[0].state.name == "COMPLETE" and retry[0].user_attrs["resumed_from_step"] == 2
    assert {x.info.run_id: x for x in runs(tracking_uri, "reap")}[parent].info.status == "KILLED"
    complete = check_complete_results(spec.storage, "reap", tracking_uri, "reap")
    assert len(complete) == 4


def test_owner_liveness(tmp_path, monkeypatch):
    me = run.Owner(host="h", pid=os.getpid(), pid_start=run._pid_start(os.getpid()), slurm_job_id="7_1", slurm_restart=1)
    earlier = run.Owner(host="h", pid=1, pid_start="x", slurm_job_id="7_1", slurm_restart=0)
    assert run.owner_is_dead(earlier, me, time.time(), 900)[0]  # adopted after a requeue
    sibling = run.Owner(host="h", pid=1, pid_start="x", slurm_job_id="7_1", slurm_restart=1)
    assert not run.owner_is_dead(sibling, me, time.time(), 900)[0]
    far = run.Owner(host="elsewhere", pid=1, pid_start="x", slurm_job_id=None, slurm_restart=0)
    assert not run.owner_is_dead(far, me, time.time(), 900)[0]
    assert run.owner_is_dead(far, me, time.time() - 1000, 900)[0]
    local_dead = run.Owner(host="h", pid=_dead_pid(), pid_start="1", slurm_job_id=None, slurm_restart=0)
    assert run.owner_is_dead(local_dead, run.Owner(**{**me.__dict__, "slurm_job_id": None}), time.time(), 900)[0]
    # another SLURM job: ask scontrol (a stub here; the real one is exercised in test_slurm_sweep.py)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for state, dead in (("CANCELLED", True), ("PENDING", False), ("RUNNING", False), ("TIMEOUT", True)):
        (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho 'JobId=9 JobState={state} Restarts=0'\n")
        (bin_dir / "scontrol").chmod(0o755)
        monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
        other = run.Owner(host="h", pid=1, pid_start="x", slurm_job_id="9_0", slurm_restart=0)
        assert run.owner_is_dead(other, me, time.time(), 900)[0] is dead, state


def test_sampler_space_runs_n_trials(tmp_path, tracking_uri):
    space = {"kind": "random", "params": {"circuit": {"choices": ["cp", "btree"]}, "rank": {"low": 2, "high": 16, "log": True},
                                          "window": {"choices": [4, 8]}, "lora_depth": {"choices": [0, 1]}}}
    spec = load_spec(fixture_spec(tmp_path, "tpe", tracking_uri=tracking_uri, space=space, n_trials=3), env={})
    run.init(spec)
    assert run.worker(spec) == 0
    st = by_state(trials(spec.storage, "tpe"))
    assert len(st["COMPLETE"]) == 3 and set(st) == {"COMPLETE"}


@pytest.mark.slow
def test_sigusr1_checkpoints_and_a_later_worker_resumes(tmp_path, tracking_uri):
    """Pre-emption outside SLURM: SIGUSR1 stops the worker after the current step (exit 75, trial
    left RUNNING); the next worker reaps it (its pid is gone) and the re-run resumes the steps."""
    spec_path = fixture_spec(tmp_path, "usr1", tracking_uri=tracking_uri, fixture={"steps": 40, "step_seconds": 0.25},
                             space={"slices": {"a": {"circuit": ["cp"], "rank": [2], "window": [4], "lora_depth": [0]}}})
    spec = load_spec(spec_path, env={})
    run.init(spec)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.Popen([sys.executable, "-m", "sweeps.run", str(spec_path), "--worker"], env=env, cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ck = spec.output_dir / "checkpoints" / "usr1" / "cp-r2-n4-k0" / "fixture_state.json"
    deadline = time.time() + 90
    while time.time() < deadline and not (ck.exists() and json.loads(ck.read_text())["step"] >= 2):
        time.sleep(0.2)
    p.send_signal(__import__("signal").SIGUSR1)
    out, _ = p.communicate(timeout=60)
    assert p.returncode == run.EXIT_PREEMPTED, out[-2000:]
    (t,) = trials(spec.storage, "usr1")
    assert t.state.name == "RUNNING"
    step = json.loads(ck.read_text())["step"]
    assert 2 <= step < 40
    r = run_cli([str(spec_path), "--resume"])  # init (nothing new) + a worker that reaps and re-runs it
    assert r.returncode == 0, r.stderr[-3000:]
    ts = trials(spec.storage, "usr1")
    assert [x.state.name for x in ts] == ["FAIL", "COMPLETE"]
    assert ts[1].user_attrs["resumed_from_step"] == step


def test_submit_passes_the_spec_resources_and_overrides_to_sbatch(tmp_path, tracking_uri):
    spec = load_spec(fixture_spec(tmp_path, "submit", tracking_uri=tracking_uri, slurm={"tasks": 3, "mem": "1G", "partition": "gpu"}), env={})
    cmd = run.submit(spec, REPO / "slurm" / "sweep.sh", ["--set", "eval.sets=2"], dry_run=True)
    assert cmd[0] == "sbatch" and "--array=0-2" in cmd and "--mem=1G" in cmd and "--partition=gpu" in cmd
    assert cmd[-4:] == [str(REPO / "slurm" / "sweep.sh"), str(spec.path), "--set", "eval.sets=2"]
    assert len(trials(spec.storage, "submit")) == 4  # initialised before submitting


@pytest.mark.parametrize(
    "slice_, key, expected",
    [
        ({"circuit": ["cp"], "rank": [2048], "window": [4], "lora_depth": [0]}, "space.slices.a.rank", "[1, 1024]"),
        ({"circuit": ["cp"], "rank": [4], "window": [65], "lora_depth": [0]}, "space.slices.a.window", "[2, 64]"),
    ],
)
def test_check_rejects_what_a_trial_would_reject(tmp_path, slice_, key, expected):
    """--check applies the head's bounds (mtpc.names): it once passed rank 2048, which every trial refused."""
    spec_path = fixture_spec(tmp_path, "toolarge", space={"kind": "grid", "slices": {"a": slice_}})
    r = run_cli([str(spec_path), "--check"])
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"{spec_path}: key '{key}'" in r.stderr and expected in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
