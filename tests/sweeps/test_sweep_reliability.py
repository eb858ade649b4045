"""The sweep runner and the demo on misuse and mishaps (docs/reliability.md, "Cases that failed"):
an emptied journal after a finished sweep, a sqlite tracking URI that is a folder, `--status`
before any run (and the demo's hint to it), `--submit` without a SLURM controller, the demo's
`--out FILE` and `--workers 0`, the demo re-run after a Ctrl-C, a failing trial (exit code and its
real error), an empty spec file. Fixture objective throughout; in-process where a subprocess
adds nothing."""

from __future__ import annotations

import dataclasses
import json
import shlex
import subprocess

import pytest

from sweeps import demo, liveness, run
from sweeps.spec import SpecError, load_spec
from sweeps.study import PREEMPTED_ATTR, load_study, open_storage, pop_waiting
from tests.sweep_helpers import REPO, by_state, fixture_spec, fresh_tracking_uri, run_cli, runs, trials


@pytest.fixture(scope="module")
def tracking_uri(tmp_path_factory):
    return fresh_tracking_uri(tmp_path_factory.mktemp("mlflow"))


def _dead_owner() -> liveness.Owner:
    p = subprocess.Popen(["true"])
    p.wait()
    return liveness.Owner(
        host=liveness.Owner.current().host, pid=p.pid, pid_start="1", slurm_job_id=None, slurm_restart=0
    )


def test_an_emptied_journal_after_a_finished_sweep_is_refused_not_rerun(tmp_path, tracking_uri):
    """Before: `--resume` created the study anew, every point ran again and MLflow held two finished
    trial runs per point."""
    spec = load_spec(fixture_spec(tmp_path, "emptied", tracking_uri=tracking_uri), env={})
    run.init(spec)
    assert run.worker(spec) == 0
    n_runs = len(runs(tracking_uri, "emptied"))
    journal = spec.output_dir / "optuna.journal"
    journal.write_bytes(b"")  # emptied (a deleted journal reads the same)
    r = run_cli([str(spec.path), "--resume"])
    assert r.returncode == 2, r.stderr[-3000:]
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert (
        "already holds 4 finished trial run(s)" in line
        and str(spec.path) in line
        and "restore the journal" in line
    )
    assert "Traceback" not in r.stderr and "started" not in r.stderr
    assert len(runs(tracking_uri, "emptied")) == n_runs  # nothing ran
    assert journal.read_bytes() == b""  # and no study was created


def test_check_refuses_a_sqlite_uri_that_is_a_folder(tmp_path, capsys):
    """Before: `--check` passed, then the first trial failed with a traceback, exit 1."""
    folder = tmp_path / "store"
    folder.mkdir()
    spec_path = fixture_spec(tmp_path, "folder", tracking_uri=f"sqlite:///{folder}")
    assert run.main([str(spec_path), "--check"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{folder} is a directory, not a database file" in err, err


def test_status_before_any_run_says_so_and_the_demo_hint_points_at_its_folder(tmp_path, monkeypatch, capsys):
    """Before: `--status` before any run was a FileNotFoundError traceback, and the demo's hint named
    smoke.yaml's own folder (runs/smoke), not the demo's."""
    monkeypatch.delenv("MTPC_OPTUNA_STORAGE", raising=False)
    spec_path = fixture_spec(tmp_path, "nothing", tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert run.main([str(spec_path), "--status"]) == 0
    out, err = capsys.readouterr()
    journal = tmp_path / "out" / "optuna.journal"
    assert (
        err.strip() == f"no study 'nothing' yet in journal:{journal}: nothing has run with this spec there; "
        f"start it with `python -m sweeps.run {spec_path} --workers N` (or --init)"
    )
    assert json.loads(out) == {"study": "nothing", "exists": False, "storage": f"journal:{journal}"}
    assert not (tmp_path / "out").exists()  # looking wrote nothing
    monkeypatch.chdir(REPO)  # where the hint is typed
    hint = shlex.split(demo.status_command(tmp_path / "demo"))
    assert hint[:3] == ["python", "-m", "sweeps.run"]
    assert run.main(hint[3:]) == 0
    assert (
        f"no study 'mtpc-demo' yet in journal:{tmp_path / 'demo' / 'optuna.journal'}"
        in capsys.readouterr().err
    )
    ran = load_spec(demo.SMOKE, overrides=demo.demo_overrides(tmp_path / "demo", "fixture"))
    assert (ran.study, ran.storage) == ("mtpc-demo", f"journal:{tmp_path / 'demo' / 'optuna.journal'}")


def test_submit_without_a_slurm_controller_is_one_line(tmp_path, tracking_uri, monkeypatch, capsys):
    """Before: FileNotFoundError (no sbatch) or CalledProcessError (sbatch failing) tracebacks."""
    spec_path = fixture_spec(tmp_path, "nosbatch", tracking_uri=tracking_uri)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    assert run.main([str(spec_path), "--submit"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "error: sbatch not found on PATH: --submit needs a SLURM client and controller "
        "(run locally with `--workers N`, or `slurm/local_cluster.sh start DIR`)"
    ), err
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(
        "#!/bin/sh\necho 'sbatch: error: Batch job submission failed: Unable to contact slurm controller "
        "(connect failure)' >&2\nexit 1\n"
    )
    sbatch.chmod(0o755)
    assert run.main([str(spec_path), "--submit"]) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert (
        "sbatch failed (exit code 1): sbatch: error: Batch job submission failed: Unable to contact slurm controller"
        in line
    )


def test_the_demo_refuses_an_out_file_and_no_workers_before_any_work(tmp_path, capsys):
    """Before: `--out FILE` was a FileExistsError traceback; `--workers 0` was accepted."""
    f = tmp_path / "results.txt"
    f.write_text("mine")
    assert demo.main(["--objective", "fixture", "--out", str(f)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: --out {f}: {f} exists and is not a directory; give a folder for the demo's results"
    assert f.read_text() == "mine"
    assert demo.main(["--objective", "fixture", "--out", str(tmp_path / "d"), "--workers", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: --workers 0: expected at least 1 worker process"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.txt"]  # nothing created


def test_the_demo_rerun_after_a_ctrl_c_resumes_the_trial_and_exits_0(tmp_path, monkeypatch, capsys):
    """A Ctrl-C leaves the running trial RUNNING and marked pre-empted; the re-run reaps it (FAIL,
    enqueued again without spending a retry) and resumes it from its checkpoint. Before: the re-run
    counted that FAIL trial and exited 1 with every point COMPLETE."""
    for var in ("MLFLOW_TRACKING_URI", "MTPC_OPTUNA_STORAGE"):
        monkeypatch.delenv(var, raising=False)
    out = tmp_path / "demo"
    fresh_tracking_uri(out)  # the demo's store, already migrated
    spec = load_spec(demo.SMOKE, overrides=demo.demo_overrides(out, "fixture"))
    run.init(spec)
    study = load_study(spec, open_storage(spec.storage))
    tid = pop_waiting(study, spec)  # what the Ctrl-C'd demo left: a RUNNING trial of a gone worker
    study._storage.set_trial_user_attr(tid, "owner", _dead_owner().to_json())
    study._storage.set_trial_user_attr(tid, PREEMPTED_ATTR, 1)
    key = study._storage.get_trial(tid).user_attrs["grid_key"]
    spec.trial_dir(key).mkdir(parents=True)
    (spec.trial_dir(key) / "fixture_state.json").write_text('{"step": 1}')
    real_run = subprocess.run

    def no_analysis(cmd, *a, **kw):  # the analysis step is not what this test is about
        if cmd[1:3] == ["-m", "analysis"]:
            return subprocess.CompletedProcess(cmd, 0)
        return real_run(cmd, *a, **kw)

    monkeypatch.setattr(demo.subprocess, "run", no_analysis)
    assert demo.main(["--objective", "fixture", "--out", str(out), "--workers", "1"]) == 0
    stdout = capsys.readouterr().out
    assert "trials: {'FAIL': 1, 'COMPLETE': 5}" in stdout and "failed" not in stdout, stdout[-2000:]
    ts = trials(spec.storage, "mtpc-demo")
    (retry,) = [t for t in ts if t.user_attrs.get("retry_of") is not None]
    assert retry.user_attrs["grid_key"] == key and retry.user_attrs["resumed_from_step"] == 1
    st = run.status(spec)
    assert (
        st["failed"] == [] and [p["grid_key"] for p in st["preempted"]] == [key] and st["failed_points"] == []
    )


def test_a_failed_point_makes_the_sweep_exit_non_zero(tmp_path, tracking_uri):
    """Before: a sweep whose trials failed exited 0 (the NaN temperature of a spec: every trial
    failed, `--workers` said 0)."""
    spec_path = fixture_spec(
        tmp_path, "fails", tracking_uri=tracking_uri, fixture={"steps": 1, "fail": [{"circuit": "hmm"}]}
    )
    r = run_cli([str(spec_path), "--workers", "1"])
    assert r.returncode == 65, r.stderr[-3000:]
    assert run.EXIT_POINTS_FAILED == 65
    lines = [x for x in r.stderr.splitlines() if "error: grid point" in x]
    assert len(lines) == 2 and all("fixture: forced failure" in x for x in lines), r.stderr[-3000:]
    assert "2 of 4 grid point(s) failed" in r.stderr
    spec = load_spec(spec_path, env={})
    assert {k: len(v) for k, v in by_state(trials(spec.storage, "fails")).items()} == {
        "COMPLETE": 2,
        "FAIL": 2,
    }


def test_a_trial_that_stores_no_evaluation_fails_with_its_real_error(tmp_path, tracking_uri, monkeypatch):
    """A trial whose evaluation ran no pass (a NaN temperature: `t == temperature` never holds) failed
    with "TrackingError: ... the evaluation did not store its results", as if the store had failed."""
    from sweeps import worker as worker_mod

    spec = load_spec(
        fixture_spec(
            tmp_path,
            "noeval",
            tracking_uri=tracking_uri,
            space={"slices": {"a": {"circuit": ["cp"], "rank": [2], "window": [4], "lora_depth": [0]}}},
        ),
        env={},
    )
    run.init(spec)
    monkeypatch.setattr(worker_mod, "run_trial", lambda ctx: None)  # trained, evaluated nothing
    assert run.worker(spec) == 0
    (t,) = trials(spec.storage, "noeval")
    err = t.user_attrs["error"]
    assert t.state.name == "FAIL" and err.startswith(
        "IncompleteResults: the trial stored no greedy evaluation for 1 of 1"
    )
    assert "TrackingError" not in err and "eval.temperatures [1.0]" in err, err
    assert [p["grid_key"] for p in run.failed_points(spec)] == ["cp-r2-n4-k0"]
    odd = dataclasses.replace(spec, eval=dataclasses.replace(spec.eval, temperatures=(float("nan"),)))
    with pytest.raises(
        worker_mod.IncompleteResults, match=r"holds \[nan\]: a temperature must be a finite number"
    ):
        worker_mod.read_back(odd, t.user_attrs["mlflow_experiment_id"], t.user_attrs["mlflow_parent_run_id"])


@pytest.mark.parametrize("text", ["", "# a spec, one day\n", "---\n"])
def test_an_empty_spec_file_is_one_line_naming_it(tmp_path, text):
    """Before: `key 'study': missing (required)`, as if one key were missing from a real spec."""
    path = tmp_path / "sweep.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as e:
        load_spec(path, env={})
    assert str(e.value).startswith(f"{path}: the sweep spec is empty; expected a YAML mapping")
    path.write_text("- study: x\n")
    with pytest.raises(SpecError, match=rf"^{path}: expected a YAML mapping of spec keys .*got a list$"):
        load_spec(path, env={})
