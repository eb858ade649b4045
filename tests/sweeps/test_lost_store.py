"""A tracking store lost mid-sweep: on `--resume`, the trials Optuna counts COMPLETE whose MLflow
runs are gone are named in a warning and their points run again, so the store ends with every
point's results (the analysis reads MLflow only: it would have analysed the survivors silently)."""

from __future__ import annotations

import shutil

from sweeps import run
from sweeps.spec import load_spec
from tests.sweep_helpers import fixture_spec, fresh_tracking_uri, run_cli, runs, trials


def test_resume_reruns_points_whose_mlflow_runs_were_lost(tmp_path):
    store = tmp_path / "mlflow"
    uri = fresh_tracking_uri(store)
    spec = load_spec(fixture_spec(tmp_path, "lost", tracking_uri=uri), env={})
    run.init(spec)
    assert run.worker(spec, max_trials=2) == 0  # two of the four points done
    shutil.copyfile(store / "mlflow.db", tmp_path / "first.db")
    fresh_tracking_uri(store)  # the store deleted mid-sweep (a new empty one in its place)
    r = run_cli([str(spec.path), "--resume"])
    assert r.returncode == 0, r.stderr[-3000:]
    done = [t for t in trials(spec.storage, "lost") if t.state.name == "COMPLETE"]
    first_two = sorted(t.number for t in done if t.user_attrs["attempt"] == 0)[:2]
    for n in first_two:
        assert f"trial {n} (" in r.stderr and "is COMPLETE in Optuna, but its MLflow run" in r.stderr, (
            r.stderr[-3000:]
        )
    parents = {x.info.run_id for x in runs(uri, "lost") if "mlflow.parentRunId" not in x.data.tags}
    keys = {t.user_attrs["grid_key"] for t in done if t.user_attrs["mlflow_parent_run_id"] in parents}
    assert len(keys) == 4  # every point has a COMPLETE trial whose results are in the store
    from mlflow.tracking import MlflowClient

    from tracking.schema import POINTS_TAG

    assert (
        MlflowClient(uri).get_experiment_by_name("lost").tags[POINTS_TAG] == "4"
    )  # what the analysis checks
    from sweeps.study import requeue_lost_runs

    assert requeue_lost_runs(spec) == []  # a second --resume: every point has its results again
    assert all(
        t.state.name == "COMPLETE" for t in trials(spec.storage, "lost")
    )  # re-runs not taken for duplicates
