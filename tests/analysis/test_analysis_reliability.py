"""The analysis against stores a sweep's mishaps leave behind (docs/reliability.md): a grid point
whose trial ran twice (two finished trial runs: a sweep started again after its journal was
emptied) is taken from the newest trial run, never averaged, with a warning naming the point; the
evaluation runs of a deleted (trashed) trial run are left out; a full disk while writing the
outputs leaves the previous set as it was, with one line naming the file and "no space left"."""

from __future__ import annotations

import copy

import pandas as pd
from mlflow.tracking import MlflowClient

from analysis import __main__ as cli
from analysis.load import load
from tests.analysis_helpers import log_sweep, synthetic_evaluations
from tests.faults import fill, full_disk, small_tmpfs
from tests.sweep_helpers import fresh_tracking_uri
from tracking.schema import grid_key


def _rerun(evs, factor: float) -> list:
    """The same evaluations measured again (a second trial run of each point): throughput x factor."""
    out = copy.deepcopy(evs)
    for ev in out:
        ev.metrics["throughput"] *= factor
    return out


def _parents(uri: str, experiment: str) -> list:
    c = MlflowClient(uri)
    exp = c.get_experiment_by_name(experiment)
    return [r for r in c.search_runs([exp.experiment_id]) if "mlflow.parentRunId" not in r.data.tags]


def test_a_point_with_two_finished_trial_runs_is_taken_from_the_newest_never_averaged(tmp_path, capsys):
    """Before: the two trial runs' evaluations were averaged without a word (`n_evals` 2, throughput
    the mean of both sweeps)."""
    uri = fresh_tracking_uri(tmp_path / "mlflow")
    first = synthetic_evaluations(circuits=("cp", "ff"), windows=(8,), prompt_sets=("chat",))
    log_sweep(uri, "dup", first)
    again = _rerun([ev for ev in first if ev.params["circuit"] == "cp"], 2.0)  # cp ran a second time
    log_sweep(uri, "dup", again)
    out = tmp_path / "out"
    assert (
        cli.main(["--tracking-uri", uri, "--experiment", "dup", "--out", str(out), "--no-log-to-mlflow"]) == 0
    )
    err = capsys.readouterr().err
    key = grid_key(again[0].params)
    assert f"warning: grid point {key} " in err and "kept the newest" in err, err
    assert err.count("grid point") == 1, err  # ff ran once: nothing to say about it
    summary = pd.read_csv(out / "summary.csv")
    cp = summary[summary["circuit"] == "cp"].iloc[0]
    assert cp["n_evals"] == 1 and cp["throughput_mean"] == again[0].metrics["throughput"]


def test_the_evaluations_of_a_deleted_trial_run_are_left_out(tmp_path, capsys):
    """A trial run moved to MLflow's trash (its point then re-run): its children stayed in the
    analysis beside the re-run's."""
    uri = fresh_tracking_uri(tmp_path / "mlflow")
    first = synthetic_evaluations(circuits=("cp", "ff"), windows=(8,), prompt_sets=("chat",))
    log_sweep(uri, "del", first)
    (cp_parent,) = [r for r in _parents(uri, "del") if "-cp-" in r.info.run_name]
    MlflowClient(uri).delete_run(cp_parent.info.run_id)
    result, _, _ = load(uri, "del")
    assert set(result.runs["circuit"]) == {"ff"} and result.n_of_deleted == 1
    again = _rerun([ev for ev in first if ev.params["circuit"] == "cp"], 3.0)
    log_sweep(uri, "del", again)  # the point re-run (--resume re-runs a point whose trial run is deleted)
    out = tmp_path / "out"
    assert (
        cli.main(["--tracking-uri", uri, "--experiment", "del", "--out", str(out), "--no-log-to-mlflow"]) == 0
    )
    err = capsys.readouterr().err
    assert "1 evaluation run(s) of deleted trial runs left out" in err and "grid point" not in err, err
    cp = pd.read_csv(out / "summary.csv").query("circuit == 'cp'").iloc[0]
    assert cp["n_evals"] == 1 and cp["throughput_mean"] == again[0].metrics["throughput"]


def test_a_full_disk_while_writing_the_outputs_keeps_the_previous_set(tmp_path, monkeypatch, capsys):
    """Before: the files written before the disk filled up (2 of 19) stood beside the older ones."""
    uri = fresh_tracking_uri(tmp_path / "mlflow")
    evs = synthetic_evaluations(circuits=("cp", "ff"), windows=(8, 16), prompt_sets=("chat", "code"))
    log_sweep(uri, "full", evs)
    out = tmp_path / "out"
    args = ["--tracking-uri", uri, "--experiment", "full", "--out", str(out), "--no-log-to-mlflow"]
    assert cli.main(args) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert len(before) >= 10
    log_sweep(
        uri, "full", synthetic_evaluations(circuits=("btree",), windows=(8, 16), prompt_sets=("chat", "code"))
    )
    capsys.readouterr()
    full_disk(monkeypatch, tmp_path, after=60_000)  # room for a few files, not for the set
    assert cli.main(args) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error:") and "no space left" in err, err
    assert f"{out}/pareto_greedy" in err and "out.tmp" not in err, err  # the file, not its temporary
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the previous set, untouched
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("out.tmp")]  # no temporary left
    monkeypatch.undo()
    assert cli.main(args) == 0  # with space again: the new set replaces the old one
    after = {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(after) == set(before) and after["summary.csv"] != before["summary.csv"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("out.tmp")]


def test_on_a_real_full_tmpfs_the_previous_set_stays(tmp_path, capsys):
    """The same on a real filesystem that fills up (matplotlib, the folder, every write as it is)."""
    uri = fresh_tracking_uri(tmp_path / "mlflow")
    log_sweep(
        uri, "tmpfs", synthetic_evaluations(circuits=("cp", "ff"), windows=(8, 16), prompt_sets=("chat",))
    )
    with small_tmpfs("8m") as d:
        out = d / "analysis"
        args = ["--tracking-uri", uri, "--experiment", "tmpfs", "--out", str(out), "--no-log-to-mlflow"]
        assert cli.main(args) == 0
        before = {p.name: p.read_bytes() for p in out.iterdir()}
        log_sweep(
            uri, "tmpfs", synthetic_evaluations(circuits=("btree",), windows=(8, 16), prompt_sets=("chat",))
        )
        fill(d, leave=0)
        capsys.readouterr()
        assert cli.main(args) == 1
        err = capsys.readouterr().err.strip()
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the previous set, untouched
        assert (
            len(err.splitlines()) == 1 and "no space left" in err and str(out) in err and ".tmp" not in err
        ), err
        assert sorted(p.name for p in d.iterdir()) == ["analysis", "filler"]
