"""tracking/ on a temporary sqlite store: the tracking-URI rule at each of its four levels, one
experiment however often it is ensured (of the classic kind), the write probe (which leaves no tag),
the run description, a trial's per-label summary, the saved runs view and its link, the one writer of
evaluation runs (name, params, metrics, acceptance, histogram) and the reader, and closing runs
an attempt left RUNNING."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import tracking
from tests.sweep_helpers import fresh_tracking_uri
from tracking.schema import HISTOGRAM_ARTIFACT

PARAMS = {
    "backbone": "tiny",
    "circuit": "cp",
    "window": 4,
    "rank": 8,
    "lora_depth": 0,
    "mode": "sample",
    "extra_token": "keep",
    "eos": "banned",
    "temperature": 1.0,
    "prompt_set": 1,
    "seed": 0,
    "top_p": 1.0,
    "hardware": "cpu",
}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    uri = fresh_tracking_uri(tmp_path_factory.mktemp("tracking"))
    return uri, tracking.ensure_experiment(uri, "t")


def test_the_tracking_uri_rule(tmp_path):
    env = {"MLFLOW_TRACKING_URI": "http://127.0.0.1:5000"}
    assert tracking.resolve_uri(
        "sqlite:///c.db", explicit="sqlite:///flag.db", env=env, cwd=tmp_path
    ) == tracking.TrackingURI(f"sqlite:///{tmp_path / 'flag.db'}", "--tracking-uri")
    assert tracking.resolve_uri("sqlite:///c.db", env=env, cwd=tmp_path) == tracking.TrackingURI(
        "http://127.0.0.1:5000", "MLFLOW_TRACKING_URI"
    )
    got = tracking.resolve_uri(
        "sqlite:///runs/c.db", env={}, cwd=tmp_path, configured_source="x.yaml: mlflow.tracking_uri"
    )
    assert got == tracking.TrackingURI(
        f"sqlite:///{tmp_path / 'runs' / 'c.db'}", "x.yaml: mlflow.tracking_uri"
    )
    assert tracking.resolve_uri(None, env={}, cwd=tmp_path).uri == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert tracking.resolve_uri("sqlite:////abs/m.db", env={}, cwd=tmp_path).uri == "sqlite:////abs/m.db"


def test_one_experiment_with_artifacts_next_to_the_database(store):
    uri, exp_id = store
    c = tracking.client(uri)
    # the classic kind, so MLflow 3's UI opens on the runs; an experiment made elsewhere gets it too
    assert c.get_experiment(exp_id).tags["mlflow.experimentKind"] == "custom_model_development"
    bare = c.create_experiment("made-by-mlflow")
    assert "mlflow.experimentKind" not in c.get_experiment(bare).tags
    assert tracking.ensure_experiment(uri, "made-by-mlflow") == bare
    assert c.get_experiment(bare).tags["mlflow.experimentKind"] == "custom_model_development"
    assert tracking.ensure_experiment(uri, "t") == exp_id
    assert tracking.experiment_id(uri, "t") == exp_id and tracking.experiment_id(uri, "none") is None
    loc = tracking.client(uri).get_experiment(exp_id).artifact_location
    assert loc == (tracking.sqlite_path(uri).parent / "mlartifacts").resolve().as_uri()


def test_write_probe(store, tmp_path):
    uri, exp_id = store
    before = tracking.client(uri).get_experiment(exp_id).tags
    assert tracking.probe_write(uri, exp_id) is None
    assert tracking.client(uri).get_experiment(exp_id).tags == before  # the probe's tag was deleted again
    problem = tracking.probe_write("http://127.0.0.1:9", exp_id)
    assert (
        problem.startswith("MLflow tracking store http://127.0.0.1:9 cannot be written")
        and "\n" not in problem
    )
    blocked = tmp_path / "file"
    blocked.write_text("")
    problem = tracking.probe_write(f"sqlite:///{blocked}/sub/m.db", exp_id)  # its directory cannot exist
    assert f"sqlite:///{blocked}/sub/m.db" in problem and "not writable" in problem


def test_describe_run(store, tmp_path):
    uri, exp_id = store
    rid = tracking.start_parent_run(uri, exp_id, "described", params={}, tags={})
    tracking.describe_run(uri, rid, {"model": {"circuit": "cp"}}, tmp_path, params={"circuit": "cp"})
    run = tracking.client(uri).get_run(rid)
    sha = tracking.git_sha()
    assert sha and all(run.data.tags[t] == sha for t in tracking.GIT_TAGS)
    assert run.data.params["circuit"] == "cp"
    files = {Path(f.path).name for f in tracking.client(uri).list_artifacts(rid, "run")}
    assert files == {"config.yaml", "git_sha.txt", "package_versions.json"}
    versions = json.loads((tmp_path / "description" / "package_versions.json").read_text())
    assert versions["mlflow"] != "absent" and versions["python"]


def test_the_evaluation_writer_and_reader(store, tmp_path):
    uri, exp_id = store
    parent = tracking.start_parent_run(uri, exp_id, "trial", params={}, tags={})
    metrics = {
        "mu_lat": 0.01,
        "mu_acc": 1.5,
        "tokens_per_cycle": 2.5,
        "throughput": 250.0,
        "max_throughput": 400.0,
        "speedup_vs_ff": math.nan,
        "note": "not a number",
    }
    rid = tracking.log_evaluation(
        uri,
        parent,
        PARAMS,
        metrics,
        per_position_acceptance=[None, 0.5, 0.25, None],
        histogram=[3, 2, 1, 0],
        experiment_id=exp_id,
    )
    drop = tracking.log_evaluation(
        uri, parent, {**PARAMS, "extra_token": "drop", "temperature": 0.7, "prompt_set": 0}, metrics
    )
    c = tracking.client(uri)
    run = c.get_run(rid)
    assert run.info.run_name == "cp-r8-n4-k0/sample/set1" and run.info.status == "FINISHED"
    assert c.get_run(drop).info.run_name == "cp-r8-n4-k0/sample-drop-T0.7/set0"
    named = {
        **PARAMS,
        "eos": "allowed",
        "kl_beta": 0.5,
        "train_seed": 1,
        "mode": "greedy",
        "temperature": 0.7,
    }
    assert (
        tracking.evaluation_run_name(named) == "cp-r8-n4-k0-kl0.5-s1/greedy-eos_allowed/set1"
    )  # greedy ignores T
    assert (
        tracking.evaluation_run_name({**named, "kl_beta": "0.0", "train_seed": "0"})
        == "cp-r8-n4-k0/greedy-eos_allowed/set1"
    )
    assert run.data.tags[tracking.PARENT_TAG] == parent
    assert run.data.params == {k: str(v) for k, v in PARAMS.items()}
    assert run.data.metrics == {
        "mu_lat": 0.01,
        "mu_acc": 1.5,
        "tokens_per_cycle": 2.5,
        "throughput": 250.0,
        "max_throughput": 400.0,
        "acceptance_pos_2": 0.5,
        "acceptance_pos_3": 0.25,
    }
    hist = json.loads(Path(c.download_artifacts(rid, HISTOGRAM_ARTIFACT, str(tmp_path))).read_text())
    assert hist == {
        "accepted_length_histogram": [3, 2, 1, 0],
        "per_position_acceptance": [None, 0.5, 0.25, None],
    }
    with pytest.raises(ValueError, match="lack \\['prompt_set'\\]"):
        tracking.log_evaluation(uri, parent, {k: v for k, v in PARAMS.items() if k != "prompt_set"}, metrics)
    summary = c.create_run(exp_id, run_name="summary", tags={tracking.SUMMARY_TAG: "summary"}).info.run_id
    c.log_param(summary, "mode", "greedy")
    c.log_param(summary, "prompt_set", "0")
    assert sorted(r.info.run_id for r in tracking.evaluation_runs(c, [exp_id], parent)) == sorted([rid, drop])
    assert summary not in {r.info.run_id for r in tracking.evaluation_runs(c, [exp_id])}
    assert {r.info.run_id for r in tracking.child_runs(uri, exp_id, parent)} == {rid, drop}


def test_a_trial_summary_per_evaluation_label(store):
    """The parent run's row in the UI: per label (mode and what varied), the mean over the reported
    prompt sets, rounded for reading; development sets are not results and stay out."""
    uri, exp_id = store
    parent = tracking.start_parent_run(uri, exp_id, "summarised", params={}, tags={})
    base = {
        "mu_lat": 0.001,
        "mu_acc": 1.0,
        "tokens_per_cycle": 2.0,
        "throughput": 2000.0,
        "max_throughput": 4000.0,
        "speedup_vs_stp": 1.5,
    }
    for ps, acc in ((0, 1.0), (1, 2.0), ("dev0", 9.0)):
        tracking.log_evaluation(
            uri, parent, {**PARAMS, "prompt_set": ps}, {**base, "mu_acc": acc + 1 / 3}, experiment_id=exp_id
        )
    tracking.log_evaluation(
        uri, parent, {**PARAMS, "mode": "greedy", "temperature": 0.7}, base, experiment_id=exp_id
    )
    tracking.log_evaluation(
        uri, parent, {**PARAMS, "temperature": 0.7}, {**base, "throughput": 1000.0}, experiment_id=exp_id
    )
    got = tracking.log_trial_summary(uri, exp_id, parent)
    assert got["sample/mu_acc"] == 1.833 and got["greedy/mu_acc"] == 1.0  # (4/3 + 7/3) / 2, 4 digits
    assert got["sample-T0.7/throughput"] == 1000.0 and got["sample/throughput"] == 2000.0
    assert sorted(got) == sorted(
        f"{lb}/{m}" for lb in ("greedy", "sample", "sample-T0.7") for m in tracking.SUMMARY_METRICS
    )
    assert tracking.client(uri).get_run(parent).data.metrics == got


def test_the_saved_runs_view_and_its_link(store):
    """The view MLflow's UI lists under "Views" (tag mlflow.sharedViewState.<id>: an envelope with a
    name, a creation time and the state as a JSON string); checked in a browser by tracking/screenshot.py."""
    uri, exp_id = store
    assert tracking.save_runs_view(uri, exp_id, ["greedy", "sample-T0.7"]) == tracking.VIEW_ID
    envelope = json.loads(
        tracking.client(uri).get_experiment(exp_id).tags[f"mlflow.sharedViewState.{tracking.VIEW_ID}"]
    )
    assert envelope["name"] == "compare heads" and isinstance(envelope["createdAt"], int)
    state = json.loads(envelope["state"])
    cols = ["params.`circuit`", "params.`rank`", "params.`window`", "params.`lora_depth`"] + [
        f"metrics.`{lb}/{m}`"
        for lb in ("greedy", "sample-T0.7")
        for m in ("mu_acc", "mu_lat", "throughput", "speedup_vs_stp")
    ]
    assert state["selectedColumns"] == cols and state["columnOrder"] == ["attributes.`Run Name`", *cols]
    assert (
        set(state["columnWidths"]) == set(state["columnOrder"]) and "orderByKey" not in state
    )  # sorting un-nests children
    assert tracking.runs_url("http://127.0.0.1:5000/", "7") == (
        "http://127.0.0.1:5000/#/experiments/7/runs?workflowType=machine_learning&viewStateShareKey=mtpc-compare"
    )


def test_close_if_running_ends_a_stale_parent_and_its_children(store):
    uri, exp_id = store
    parent = tracking.start_parent_run(uri, exp_id, "stale", params={}, tags={})
    kid = (
        tracking.client(uri)
        .create_run(exp_id, run_name="half", tags={tracking.PARENT_TAG: parent})
        .info.run_id
    )
    assert tracking.close_if_running(uri, exp_id, parent, "FAILED", "store was down")
    c = tracking.client(uri)
    assert (
        c.get_run(parent).info.status == "FAILED"
        and c.get_run(parent).data.tags[tracking.ERROR_TAG] == "store was down"
    )
    assert c.get_run(kid).info.status == "KILLED"
    assert not tracking.close_if_running(uri, exp_id, parent, "FAILED", "again")  # idempotent


def test_one_machine_description():
    """`tracking.runs.machine` is what every result records; the evaluation's one-line form is built from it."""
    import platform

    import torch

    from experiments.evaluation.decoding import hardware
    from tracking.runs import cpu_model, machine, machine_line

    m = machine()
    assert m["python"] == platform.python_version() and m["torch"] == torch.__version__
    assert (
        m["cpu"] == (cpu_model() or platform.processor() or platform.machine())
        and m["threads"] == torch.get_num_threads()
    )
    assert ("gpu" in m) == torch.cuda.is_available()
    assert hardware() == machine_line(m)
    if not torch.cuda.is_available():
        assert (
            machine_line(m)
            == f"CPU {m['cpu']} x{m['threads']} threads; torch {torch.__version__}; python {platform.python_version()}"
        )
