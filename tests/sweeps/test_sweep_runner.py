"""The sweep runner without SLURM, on the fixture objective: exactly-once over the grid with
concurrent workers, re-runs add nothing, failures are marked and logged, the reaper fails and
re-enqueues trials of dead workers (which then resume from their checkpoint), a worker killed with
kill -9 beside a live one has its trial retried in the same run, zombies count as dead, `--status`
names trials whose worker is gone, bad stores are refused before any work, a down MLflow server
fails the attempt (naming the URI) and stops the worker instead of completing or failing trials."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from mlflow.tracking import MlflowClient

import tracking
from sweeps import liveness, run
from sweeps.spec import SpecError, load_spec
from sweeps.study import experiment_id, load_study, open_storage, pop_waiting
from sweeps.worker import StopFlag, TrackingLost, run_one
from tests.sweep_helpers import (
    REPO,
    by_state,
    check_complete_results,
    fixture_spec,
    fresh_tracking_uri,
    run_cli,
    runs,
    trials,
    wait_for,
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
    # 2 s per step: a trial outlasts a worker's start-up, so the second worker finds work (with
    # instant trials the first worker could finish all four before the second had started)
    spec_path = fixture_spec(
        tmp_path,
        "local2",
        tracking_uri=tracking_uri,
        fixture={"steps": 2, "step_seconds": 2.0, "fail": [{"circuit": "hmm", "rank": 4}]},
    )
    spec = load_spec(spec_path, env={})
    r = run_cli([str(spec_path), "--workers", "2"])
    assert r.returncode == run.EXIT_POINTS_FAILED, r.stderr[-3000:]  # the sweep is done, one point failed
    ts = trials(spec.storage, "local2")
    st = by_state(ts)
    assert len(ts) == 4 and len(st["COMPLETE"]) == 3 and len(st["FAIL"]) == 1, {
        k: len(v) for k, v in st.items()
    }
    failed = st["FAIL"][0]
    assert failed.user_attrs["grid_key"] == "hmm-r4-n4-k0"
    assert "forced failure" in failed.user_attrs["error"]
    parent = {x.info.run_id: x for x in runs(tracking_uri, "local2")}[
        failed.user_attrs["mlflow_parent_run_id"]
    ]
    assert parent.info.status == "FAILED" and "forced failure" in parent.data.tags["mtpc.error"]
    check_complete_results(spec.storage, "local2", tracking_uri, "local2")
    # the experiment opens on its runs with the spec's columns (tracking/views.py; a browser shows it:
    # tracking/screenshot.py); the write probes before every trial left no tag behind
    exp = MlflowClient(tracking_uri).get_experiment_by_name("local2")
    view = json.loads(json.loads(exp.tags[f"mlflow.sharedViewState.{tracking.VIEW_ID}"])["state"])
    assert view["selectedColumns"] == tracking.view_columns(["greedy", "sample"])
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    assert not [k for k in exp.tags if k.startswith("mtpc.")], exp.tags
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
    other = fixture_spec(
        tmp_path,
        "space",
        tracking_uri=tracking_uri,
        space={"slices": {"a": {"circuit": ["btree"], "rank": [2], "window": [4], "lora_depth": [0]}}},
    )
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
    assert r.returncode == 2 and "http://127.0.0.1:9" in r.stderr and "unreachable" in r.stderr, r.stderr[
        -2000:
    ]
    assert not (tmp_path / "out" / "optuna.journal").exists() or "created study" not in r.stderr


def test_mlflow_down_during_a_trial_fails_it(tmp_path, tracking_uri, monkeypatch):
    """Init against a working store, then the store goes away: the trial is FAIL with the URI in
    its error, never COMPLETE."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "3")
    spec = load_spec(fixture_spec(tmp_path, "down", tracking_uri=tracking_uri), env={})
    run.init(spec)
    study = load_study(spec, open_storage(spec.storage))
    exp_id = experiment_id(spec)
    dead = "http://127.0.0.1:9"
    broken = spec.__class__(**{**spec.__dict__, "tracking_uri": dead})
    tid = pop_waiting(study)
    with pytest.raises(TrackingLost, match="127.0.0.1:9"):
        run_one(broken, study, tid, exp_id, liveness.Owner.current(), StopFlag())
    t = study._storage.get_trial(tid)
    assert t.state.name == "FAIL"
    assert "MLflow tracking store http://127.0.0.1:9 cannot be written" in t.user_attrs["error"]
    ts = trials(spec.storage, "down")
    (retry,) = [x for x in ts if x.user_attrs.get("retry_of") == t.number]
    assert retry.state.name == "WAITING" and retry.user_attrs["attempt"] == t.user_attrs.get(
        "attempt", 0
    )  # not a retry spent
    with pytest.raises(tracking.TrackingError, match="unreachable"):
        run.worker(broken)  # a worker refuses to start trials against a down server
    st = by_state(trials(spec.storage, "down"))
    assert len(st["WAITING"]) == 4 and not st.get("COMPLETE")


def test_reaper_fails_dead_workers_trial_and_the_rerun_resumes(tmp_path, tracking_uri):
    spec = load_spec(fixture_spec(tmp_path, "reap", tracking_uri=tracking_uri, fixture={"steps": 3}), env={})
    run.init(spec)
    study = load_study(spec, open_storage(spec.storage))
    exp_id = experiment_id(spec)
    tid = pop_waiting(study)
    t = study._storage.get_trial(tid)
    key = t.user_attrs["grid_key"]
    # a worker that died mid-trial: its pid is gone, its parent run is open, 2 of 3 steps are checkpointed
    dead = liveness.Owner(
        host=liveness.Owner.current().host, pid=_dead_pid(), pid_start="1", slurm_job_id=None, slurm_restart=0
    )
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
    assert (
        len(retry) == 1
        and retry[0].state.name == "COMPLETE"
        and retry[0].user_attrs["resumed_from_step"] == 2
    )
    assert {x.info.run_id: x for x in runs(tracking_uri, "reap")}[parent].info.status == "KILLED"
    complete = check_complete_results(spec.storage, "reap", tracking_uri, "reap")
    assert len(complete) == 4


def test_a_preempted_trial_resumes_first_without_spending_a_retry(tmp_path, tracking_uri):
    """A trial stopped on request (exit 75, checkpoint written, marked pre-empted) whose workers were
    then restarted: the reaper enqueues its point again at the same attempt (max_retries 0 would
    otherwise drop it), and the retry runs before the points after it in the grid (the slice order
    holds), resuming from the checkpoint."""
    spec = load_spec(
        fixture_spec(tmp_path, "pre", tracking_uri=tracking_uri, fixture={"steps": 3}, max_retries=0), env={}
    )
    run.init(spec)
    study = load_study(spec, open_storage(spec.storage))
    tid = pop_waiting(study, spec)
    t = study._storage.get_trial(tid)
    assert t.number == 0  # the grid's first point
    dead = liveness.Owner(
        host=liveness.Owner.current().host, pid=_dead_pid(), pid_start="1", slurm_job_id=None, slurm_restart=0
    )
    study._storage.set_trial_user_attr(tid, "owner", dead.to_json())
    study._storage.set_trial_user_attr(tid, "preempted", 1)
    ck = spec.output_dir / "checkpoints" / "pre" / t.user_attrs["grid_key"]
    ck.mkdir(parents=True)
    (ck / "fixture_state.json").write_text('{"step": 2}')
    assert run.worker(spec, max_trials=1) == 0  # one trial: the retry, not the next point by number
    ts = trials(spec.storage, "pre")
    assert ts[0].state.name == "FAIL" and "pre-empted" in ts[0].user_attrs["error"]
    (retry,) = [x for x in ts if x.user_attrs.get("retry_of") == 0]
    assert (
        retry.state.name == "COMPLETE"
        and retry.user_attrs["attempt"] == 0
        and retry.user_attrs["resumed_from_step"] == 2
    )
    assert [x.state.name for x in ts[1:4]] == ["WAITING"] * 3
    assert run.worker(spec) == 0
    assert len(check_complete_results(spec.storage, "pre", tracking_uri, "pre")) == 4


def test_owner_liveness(tmp_path, monkeypatch):
    Owner, owner_is_dead = liveness.Owner, liveness.owner_is_dead
    me = Owner(
        host="h",
        pid=os.getpid(),
        pid_start=liveness.pid_start(os.getpid()),
        slurm_job_id="7_1",
        slurm_restart=1,
    )
    earlier = Owner(host="h", pid=1, pid_start="x", slurm_job_id="7_1", slurm_restart=0)
    assert owner_is_dead(earlier, me, time.time(), 900)[0]  # adopted after a requeue
    sibling = Owner(host="h", pid=1, pid_start="x", slurm_job_id="7_1", slurm_restart=1)
    assert not owner_is_dead(sibling, me, time.time(), 900)[0]
    far = Owner(host="elsewhere", pid=1, pid_start="x", slurm_job_id=None, slurm_restart=0)
    assert not owner_is_dead(far, me, time.time(), 900)[0]
    assert owner_is_dead(far, me, time.time() - 1000, 900)[0]
    local_dead = Owner(host="h", pid=_dead_pid(), pid_start="1", slurm_job_id=None, slurm_restart=0)
    assert owner_is_dead(local_dead, Owner(**{**me.__dict__, "slurm_job_id": None}), time.time(), 900)[0]
    # another SLURM job: ask scontrol (a stub here; the real one is exercised in test_slurm_sweep.py)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for state, dead in (("CANCELLED", True), ("PENDING", False), ("RUNNING", False), ("TIMEOUT", True)):
        (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho 'JobId=9 JobState={state} Restarts=0'\n")
        (bin_dir / "scontrol").chmod(0o755)
        monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
        other = Owner(host="h", pid=1, pid_start="x", slurm_job_id="9_0", slurm_restart=0)
        assert owner_is_dead(other, me, time.time(), 900)[0] is dead, state


def test_sampler_space_runs_n_trials(tmp_path, tracking_uri):
    space = {
        "kind": "random",
        "params": {
            "circuit": {"choices": ["cp", "btree"]},
            "rank": {"low": 2, "high": 16, "log": True},
            "window": {"choices": [4, 8]},
            "lora_depth": {"choices": [0, 1]},
        },
    }
    spec = load_spec(
        fixture_spec(tmp_path, "tpe", tracking_uri=tracking_uri, space=space, n_trials=3), env={}
    )
    run.init(spec)
    assert run.worker(spec) == 0
    st = by_state(trials(spec.storage, "tpe"))
    assert len(st["COMPLETE"]) == 3 and set(st) == {"COMPLETE"}


@pytest.mark.slow
def test_sigusr1_checkpoints_and_a_later_worker_resumes(tmp_path, tracking_uri):
    """Pre-emption outside SLURM: SIGUSR1 stops the worker after the current step (exit 75, trial
    left RUNNING); the next worker reaps it (its pid is gone) and the re-run resumes the steps."""
    spec_path = fixture_spec(
        tmp_path,
        "usr1",
        tracking_uri=tracking_uri,
        fixture={"steps": 40, "step_seconds": 0.25},
        space={"slices": {"a": {"circuit": ["cp"], "rank": [2], "window": [4], "lora_depth": [0]}}},
    )
    spec = load_spec(spec_path, env={})
    run.init(spec)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.Popen(
        [sys.executable, "-m", "sweeps.run", str(spec_path), "--worker"],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
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
    spec = load_spec(
        fixture_spec(
            tmp_path, "submit", tracking_uri=tracking_uri, slurm={"tasks": 3, "mem": "1G", "partition": "gpu"}
        ),
        env={},
    )
    cmd = run.submit(spec, REPO / "slurm" / "sweep.sh", ["--set", "eval.sets=2"], dry_run=True)
    assert cmd[0] == "sbatch" and "--array=0-2" in cmd and "--mem=1G" in cmd and "--partition=gpu" in cmd
    assert cmd[-4:] == [str(REPO / "slurm" / "sweep.sh"), str(spec.path), "--set", "eval.sets=2"]
    assert len(trials(spec.storage, "submit")) == 4  # initialised before submitting


@pytest.mark.parametrize(
    "slice_, key, expected",
    [
        (
            {"circuit": ["cp"], "rank": [2048], "window": [4], "lora_depth": [0]},
            "space.slices.a.rank",
            "[1, 1024]",
        ),
        (
            {"circuit": ["cp"], "rank": [4], "window": [65], "lora_depth": [0]},
            "space.slices.a.window",
            "[2, 64]",
        ),
    ],
)
def test_check_rejects_what_a_trial_would_reject(tmp_path, slice_, key, expected):
    """--check applies the head's bounds (mtpc.names): it once passed rank 2048, which every trial refused."""
    spec_path = fixture_spec(tmp_path, "toolarge", space={"kind": "grid", "slices": {"a": slice_}})
    r = run_cli([str(spec_path), "--check"])
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"{spec_path}: key '{key}'" in r.stderr and expected in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_a_zombie_worker_counts_as_dead():
    """A worker killed while its parent has not waited for it yet is a zombie: /proc still lists
    its pid with the same start time. It once passed the liveness check, so its trial stayed
    RUNNING for the rest of the run."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    owner = liveness.Owner(
        host=liveness.Owner.current().host,
        pid=p.pid,
        pid_start=liveness.pid_start(p.pid),
        slurm_job_id=None,
        slurm_restart=0,
    )
    me = liveness.Owner(**{**liveness.Owner.current().__dict__, "slurm_job_id": None})
    assert owner.pid_start and not liveness.owner_is_dead(owner, me, time.time(), 900)[0]
    deadline = time.time() + 30
    while time.time() < deadline:
        with open(f"/proc/{p.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
        time.sleep(0.05)
    else:
        pytest.fail("the child never became a zombie")
    dead, why = liveness.owner_is_dead(owner, me, time.time(), 900)
    p.wait()
    assert dead and f"worker pid {p.pid}" in why


@pytest.mark.slow
def test_kill_9_of_one_worker_retries_its_trial_in_the_same_run(tmp_path, tracking_uri):
    """`--workers 2`, one worker killed with kill -9 while the other lives on: the runner waits for
    the dead one at once (no zombie), starts a replacement that reaps the trial and retries it,
    and the run ends 0 with every point COMPLETE and no trial or run left RUNNING. (It exited 247
    with no message, and the trial could stay RUNNING for the rest of the run.)"""
    spec_path = fixture_spec(
        tmp_path, "kill9", tracking_uri=tracking_uri, fixture={"steps": 16, "step_seconds": 0.25}
    )
    spec = load_spec(spec_path, env={})
    err = open(tmp_path / "runner.err", "w")  # noqa: SIM115
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.Popen(
        [sys.executable, "-m", "sweeps.run", str(spec_path), "--workers", "2"],
        env=env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=err,
    )
    try:

        def two_running():  # both workers inside a trial, each with 2+ steps checkpointed
            try:
                ts = trials(spec.storage, "kill9")
            except Exception:  # noqa: BLE001 (the runner's init has not created the study yet)
                return None
            running = [t for t in ts if t.state.name == "RUNNING" and "grid_key" in t.user_attrs]
            ck = [
                spec.output_dir / "checkpoints" / "kill9" / t.user_attrs["grid_key"] / "fixture_state.json"
                for t in running
            ]
            steps = [json.loads(c.read_text())["step"] if c.exists() else 0 for c in ck]
            return running if len(running) == 2 and min(steps) >= 2 else None

        running = wait_for(two_running, 180, "two trials RUNNING at once")
        victim = running[1]
        pid = json.loads(victim.user_attrs["owner"])["pid"]
        os.kill(pid, signal.SIGKILL)
        rc = p.wait(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
        err.close()
    log = (tmp_path / "runner.err").read_text()
    assert rc == 0, log[-3000:]
    assert f"worker pid {pid} was killed by SIGKILL: its trial is reaped and retried" in log
    ts = trials(spec.storage, "kill9")
    st = by_state(ts)
    killed = next(t for t in ts if t.number == victim.number)
    assert (
        killed.state.name == "FAIL"
        and "worker died" in killed.user_attrs["error"]
        and str(pid) in killed.user_attrs["error"]
    )
    (retry,) = [t for t in ts if t.user_attrs.get("retry_of") == victim.number]
    assert (
        retry.state.name == "COMPLETE" and retry.user_attrs["resumed_from_step"] > 0
    )  # resumed its checkpoint
    assert len(st["COMPLETE"]) == 4 and "RUNNING" not in st and "WAITING" not in st
    check_complete_results(spec.storage, "kill9", tracking_uri, "kill9")
    statuses = {r.info.run_id: r.info.status for r in runs(tracking_uri, "kill9")}
    assert statuses[killed.user_attrs["mlflow_parent_run_id"]] == "KILLED"
    assert "RUNNING" not in statuses.values()


def test_status_names_trials_whose_worker_is_gone(tmp_path, tracking_uri):
    spec_path = fixture_spec(tmp_path, "gone", tracking_uri=tracking_uri)
    spec = load_spec(spec_path, env={})
    assert run_cli([str(spec_path), "--init"]).returncode == 0
    study = load_study(spec, open_storage(spec.storage))
    tid = pop_waiting(study)
    dead = liveness.Owner(
        host=liveness.Owner.current().host, pid=_dead_pid(), pid_start="1", slurm_job_id=None, slurm_restart=0
    )
    study._storage.set_trial_user_attr(tid, "owner", dead.to_json())
    r = run_cli([str(spec_path), "--status"])
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["states"] == {"RUNNING": 1, "WAITING": 3}
    (gone,) = out["worker_gone"]
    t = study._storage.get_trial(tid)
    assert gone["trial"] == t.number and gone["grid_key"] == t.user_attrs["grid_key"]
    assert f"worker pid {dead.pid}" in gone["why"] and "is gone" in gone["why"]


def test_every_runner_exit_code_is_documented():
    codes = {v for k, v in vars(run).items() if k.startswith("EXIT_")} | {0, 1}
    assert codes == {0, 1, 2, 65, 69, 70, 75}
    docs = (REPO / "docs" / "sweeps.md").read_text()
    for c in codes:
        assert re.search(rf"^\s+{c}\s+\S", run.__doc__, re.M), (
            f"exit code {c} not in sweeps/run.py's docstring"
        )
        assert re.search(rf"^\| `{c}` \|", docs, re.M), f"exit code {c} not in docs/sweeps.md's table"
