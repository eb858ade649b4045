"""MLflow -> DataFrame and the `python -m analysis` CLI against a temporary sqlite store holding a
small synthetic sweep written by the suite's own writer (parent trial runs, evaluation runs, a run
missing a metric, an unfinished run, runs without the optional params), plus every error path of
the CLI.

One store for the whole module: creating a sqlite store runs MLflow's migrations (seconds)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tracking
from analysis import __main__ as cli
from analysis.filters import Filters
from analysis.hists import load_hists, parse_hist
from analysis.load import AnalysisError, load
from tests.analysis_helpers import log_sweep, synthetic_evaluations
from tests.sweep_helpers import fresh_tracking_uri

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow")
    uri = fresh_tracking_uri(root)
    ps = ("chat", "code")
    good = synthetic_evaluations(circuits=("ff", "cp", "btree"), windows=(8,), prompt_sets=ps)
    good += synthetic_evaluations(modes=("sample",), circuits=("cp",), windows=(8, 16), prompt_sets=ps)
    good += synthetic_evaluations(
        backbone="bare", circuits=("cp",), windows=(8,), prompt_sets=ps, with_optional=False
    )
    broken = synthetic_evaluations(circuits=("hmm",), windows=(8,), prompt_sets=("chat",))[0]
    del broken.metrics["mu_lat"]
    broken.trial = "broken-trial"
    running = synthetic_evaluations(circuits=("hmm",), windows=(16,), prompt_sets=("chat",))[0]
    running.status = "RUNNING"
    running.trial = "running-trial"
    ids = log_sweep(uri, "sweep", good + [broken, running])
    only_broken = synthetic_evaluations(circuits=("cp",), windows=(8,), prompt_sets=("chat",))[0]
    del only_broken.metrics["throughput"]
    log_sweep(uri, "allbroken", [only_broken])
    second = synthetic_evaluations(
        backbone="bare", circuits=("ff",), windows=(8,), prompt_sets=("chat",), with_optional=False
    )
    log_sweep(uri, "second", second)
    return {"uri": uri, "good": good, "ids": ids, "broken_id": ids[str(len(good))], "root": root}


def test_dataframe_contents_and_types(store):
    result, client, uri = load(store["uri"], "sweep")
    df = result.runs
    good = store["good"]
    assert uri == store["uri"] and result.experiments == ["sweep"]
    assert len(df) == len(good) == 12  # children only: parents, broken and running runs left out
    assert (
        str(df["window"].dtype) == "Int64"
        and str(df["rank"].dtype) == "Int64"
        and str(df["lora_depth"].dtype) == "Int64"
    )
    assert str(df["seed"].dtype) == "Int64"
    for col in (
        "temperature",
        "top_p",
        "mu_lat",
        "mu_acc",
        "throughput",
        "stp_mu_lat",
        "acceptance_pos_2",
        "acceptance_pos_16",
    ):
        assert df[col].dtype == np.float64, col
    assert df["backbone"].dtype == object and set(df["mode"]) == {"greedy", "sample"}
    assert df["parent_run_id"].notna().all() and df["parent_run_id"].nunique() == 6  # 3 + 2 + 1 trials
    ids = store["ids"]
    for i, ev in enumerate(good):
        row = df[df.run_id == ids[str(i)]].iloc[0]
        for k in ("backbone", "circuit", "window", "rank", "lora_depth", "mode", "prompt_set", "extra_token"):
            assert row[k] == ev.params[k], k
        assert row["temperature"] == pytest.approx(ev.params["temperature"])
        for k, v in ev.metrics.items():
            assert row[k] == pytest.approx(v, rel=1e-12), k
        if ev.params["window"] == 8:
            assert np.isnan(row["acceptance_pos_16"])  # positions a run does not have stay NaN
    bare = df[df.backbone == "bare"]
    assert len(bare) == 2 and bare["hardware"].isna().all() and bare["top_p"].isna().all()
    assert [s.run_id for s in result.skipped] == [store["broken_id"]]
    assert result.skipped[0].missing == ("mu_lat",)
    assert result.n_unfinished == 1


def test_filters_and_no_match_message(store):
    res, *_ = load(store["uri"], "sweep", Filters(mode=("sample",)))
    assert len(res.runs) == 4 and set(res.runs["mode"]) == {"sample"}
    res, *_ = load(store["uri"], "sweep", Filters(mode=("sample",), window=(16,), temperature=(1.0000001,)))
    assert len(res.runs) == 2 and set(res.runs["window"]) == {16}
    res, *_ = load(store["uri"], "sweep", Filters(backbone=("tiny",), lora_depth=(0,), extra_token=("keep",)))
    assert len(res.runs) == 10
    with pytest.raises(AnalysisError) as exc:
        load(store["uri"], "sweep", Filters(backbone=("tiny",), window=(32,)))
    msg = str(exc.value)
    assert "no runs match the filters (backbone=tiny, window=32)" in msg
    assert "12 evaluation runs before filtering -> backbone=tiny: 10 -> window=32: 0" in msg
    with pytest.raises(ValueError, match="filter mode"):
        Filters(mode=("beam",))


def test_experiment_resolution_and_store_errors(store, tmp_path, monkeypatch):
    with pytest.raises(AnalysisError, match="no MLflow experiment named .*'nope'.*allbroken, second, sweep"):
        load(store["uri"], "nope")
    res, client, _ = load(store["uri"], None, Filters(backbone=("bare",)))  # every experiment with runs
    assert sorted(res.experiments) == ["allbroken", "second", "sweep"] and len(res.runs) == 3
    exp_id = client.get_experiment_by_name("sweep").experiment_id
    assert len(load(store["uri"], exp_id)[0].runs) == 12  # by id
    with pytest.raises(
        AnalysisError, match=r"no usable evaluation runs .* 1 evaluation run\(s\) were skipped"
    ):
        load(store["uri"], "allbroken")
    with pytest.raises(tracking.TrackingError, match="no MLflow database at .*missing.db"):
        tracking.open_for_reading(f"sqlite:///{tmp_path}/missing.db")
    assert not (tmp_path / "missing.db").exists()  # not created as a side effect
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store["uri"])
    assert tracking.resolve_uri(explicit=None) == tracking.TrackingURI(store["uri"], "MLFLOW_TRACKING_URI")
    assert (
        tracking.resolve_uri(explicit="sqlite:///x.db").source == "--tracking-uri"
    )  # the flag beats the env
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.chdir(tmp_path)
    assert tracking.resolve_uri().uri == f"sqlite:///{tmp_path}/mlflow.db"


def test_histogram_artifacts(store):
    result, client, _ = load(store["uri"], "sweep", Filters(mode=("greedy",), backbone=("tiny",)))
    hists, problems = load_hists(client, list(result.runs["run_id"]))
    assert problems == [] and len(hists) == 6
    ids, good = store["ids"], store["good"]
    for i, ev in enumerate(good[:6]):
        np.testing.assert_array_equal(hists[ids[str(i)]], ev.hist)


def test_parse_hist_forms():
    np.testing.assert_array_equal(parse_hist([3, 2, 1]), [3, 2, 1])
    np.testing.assert_array_equal(parse_hist({"0": 3, "2": 1}), [3, 0, 1])
    np.testing.assert_array_equal(parse_hist({"counts": [1, 1]}), [1, 1])
    # the layout tracking.log_evaluation writes
    evaluated = {"accepted_length_histogram": [5, 0, 2], "per_position_acceptance": [None, 0.4, 0.1]}
    np.testing.assert_array_equal(parse_hist(evaluated), [5, 0, 2])
    with pytest.raises(ValueError, match="accepted_length_histogram.json"):
        parse_hist({"a": 1})
    with pytest.raises(ValueError, match="accepted_length_histogram.json"):
        parse_hist("x")


def test_cli_writes_figures_tables_and_logs_summary(store, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["--tracking-uri", store["uri"], "--experiment", "sweep", "--out", str(out)]  # logs by default
    rc = cli.main(args + ["--backbone", "tiny"])  # two of the three settings: figures cost seconds
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    # skipped run listed and counted on stderr
    assert (
        "1 evaluation run(s) skipped" in cap.err
        and store["broken_id"] in cap.err
        and "missing mu_lat" in cap.err
    )
    assert "1 unfinished run(s) ignored" in cap.err
    names = {p.name for p in out.iterdir()}
    slugs = ["greedy", "sample"]  # short names: only what differs between the settings
    assert not any(n.startswith("pareto_bare") for n in names)
    for slug in slugs:
        assert {f"pareto_{slug}.png", f"pareto_{slug}.pdf", f"table_{slug}.md", f"table_{slug}.tex"} <= names
    assert "throughput_vs_window_sample.png" in names  # n varies only there
    assert "throughput_vs_window_greedy.png" not in names
    assert "accepted_length_greedy.png" in names
    assert (out / f"pareto_{slugs[0]}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / f"pareto_{slugs[0]}.pdf").read_bytes()[:5] == b"%PDF-"
    assert {"tables.md", "tables.tex", "summary.csv"} <= names
    # table value: the logged throughput of greedy cp, mean ± std over the two prompt sets, bold (best)
    thr = [e.metrics["throughput"] for e in store["good"][:6] if e.params["circuit"] == "btree"]
    md = (out / "table_greedy.md").read_text()
    assert (
        f"**{np.mean(thr):.0f} ± {np.std(thr, ddof=1):.0f}**" in md
        or f"**{np.mean(thr):.1f} ± {np.std(thr, ddof=1):.1f}**" in md
    )
    best_lines = [ln for ln in cap.out.splitlines() if ln.startswith("best [")]
    assert len(best_lines) == 2 and any("btree n=8 r=32 k=0" in ln for ln in best_lines)
    # the summary run: in the same experiment, tagged, with the artifacts; never read back as data
    result, client, _ = load(store["uri"], "sweep")
    assert len(result.runs) == 12
    exp = client.get_experiment_by_name("sweep")
    (summary,) = client.search_runs(
        [exp.experiment_id], filter_string=f"tags.`{tracking.SUMMARY_TAG}` = 'summary'"
    )
    assert summary.info.status == "FINISHED" and summary.data.params["n_evaluation_runs"] == "10"
    assert summary.data.params["filter_backbone"] == "tiny"
    figs = {Path(f.path).name for f in client.list_artifacts(summary.info.run_id, "figures")}
    tabs = {Path(f.path).name for f in client.list_artifacts(summary.info.run_id, "tables")}
    assert f"pareto_{slugs[0]}.png" in figs and f"pareto_{slugs[0]}.pdf" in figs
    assert f"table_{slugs[0]}.md" in tabs and "summary.csv" in tabs
    saved = json.loads(json.dumps(summary.data.params))
    assert saved["n_skipped_runs"] == "1"
    # a later analysis replaces the summary run (the earlier one goes to MLflow's trash)
    again = cli.log_summary(
        client, result, [out / "summary.csv"], cli.build_parser().parse_args(args), Filters()
    )
    (active,) = client.search_runs(
        [exp.experiment_id], filter_string=f"tags.`{tracking.SUMMARY_TAG}` = 'summary'"
    )
    assert active.info.run_id == again != summary.info.run_id
    assert client.get_run(summary.info.run_id).info.lifecycle_stage == "deleted"


def test_cli_logs_nothing_when_told_or_when_the_runs_span_experiments(store, tmp_path, capsys):
    c = tracking.client(store["uri"])
    exp_ids = [c.get_experiment_by_name(n).experiment_id for n in ("sweep", "second")]

    def summaries():
        return c.search_runs(exp_ids, filter_string=f"tags.`{tracking.SUMMARY_TAG}` = 'summary'")

    before = len(summaries())
    base = ["--tracking-uri", store["uri"], "--backbone", "bare", "--mode", "greedy", "--out", str(tmp_path)]
    assert cli.main(base + ["--experiment", "second", "--no-log-to-mlflow"]) == 0
    assert cli.main(base) == 0  # "bare" runs live in two experiments: a note, no summary run
    err = capsys.readouterr().err
    assert "not logged to MLflow: the runs come from several experiments" in err
    assert len(summaries()) == before


def test_cli_errors_exit_1_without_traceback(store, tmp_path, capsys):
    rc = cli.main(
        [
            "--tracking-uri",
            store["uri"],
            "--experiment",
            "sweep",
            "--mode",
            "sample",
            "--window",
            "32",
            "--out",
            str(tmp_path),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 1 and "no runs match the filters (mode=sample, window=32)" in err and "Traceback" not in err
    rc = cli.main(["--tracking-uri", f"sqlite:///{tmp_path}/none.db", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 1 and "no MLflow database" in err and "from --tracking-uri" in err
    rc = cli.main(["--tracking-uri", store["uri"], "--experiment", "allbroken", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 1 and "no usable evaluation runs" in err and "missing throughput" in err
    rc = cli.main(
        [
            "--tracking-uri",
            store["uri"],
            "--backbone",
            "bare",
            "--log-to-mlflow",
            "--out",
            str(tmp_path / "o"),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 1 and "--log-to-mlflow needs one experiment, but the runs come from 2" in err
    assert not (tmp_path / "o").exists()  # failed before writing anything
    with pytest.raises(SystemExit) as exc:
        cli.main(["--mode", "beam"])
    assert exc.value.code == 2


def test_module_cli_unreachable_server_is_a_clear_error(tmp_path):
    """`python -m analysis` against a port nothing listens on, run from another directory: no
    sys.path hack (a module entry point never puts analysis/ on sys.path)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "analysis", "--tracking-uri", "http://127.0.0.1:9", "--out", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "cannot reach the MLflow tracking store 'http://127.0.0.1:9' (from --tracking-uri)" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_documented_script_runs_the_same_cli_without_shadowing_pypi_modules(tmp_path):
    """`python analysis/pareto.py` (the product's command) is `python -m analysis`: same parser, and
    run as a script its directory does not shadow installed modules."""
    repo = Path(__file__).resolve().parents[2]
    r = subprocess.run(
        [sys.executable, "analysis/pareto.py", "--help"],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "usage: python -m analysis" in r.stdout and "--tracking-uri" in r.stdout
    r = subprocess.run(
        [
            sys.executable,
            "analysis/pareto.py",
            "--tracking-uri",
            f"sqlite:///{tmp_path / 'none.db'}",
            "--experiment",
            "nothing",
            "--out",
            str(tmp_path / "o"),
        ],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and r.stderr.strip().startswith("error:") and "Traceback" not in r.stderr, (
        r.stderr[-2000:]
    )


def test_the_analysis_warns_when_the_store_holds_fewer_points_than_the_sweep(tmp_path, capsys):
    """A sweep's init tags its experiment with its number of grid points; a store that lost runs
    (or a sweep still running) is analysed with a warning naming both counts."""
    from mlflow.tracking import MlflowClient

    from tracking.schema import POINTS_TAG

    uri = fresh_tracking_uri(tmp_path / "mlflow")
    log_sweep(
        uri, "partial", synthetic_evaluations(circuits=("ff", "cp"), windows=(8,), prompt_sets=("chat",))
    )
    client = MlflowClient(uri)
    exp_id = client.get_experiment_by_name("partial").experiment_id
    client.set_experiment_tag(exp_id, POINTS_TAG, "3")
    args = ["--tracking-uri", uri, "--experiment", "partial", "--out", str(tmp_path / "out")]
    assert cli.main(args) == 0
    assert (
        "experiment 'partial' holds evaluation runs of 2 of the sweep's 3 grid points"
        in capsys.readouterr().err
    )
    client.set_experiment_tag(exp_id, POINTS_TAG, "2")
    assert cli.main(args) == 0
    assert "grid points" not in capsys.readouterr().err


def test_no_analysis_file_is_named_like_an_installed_module():
    """`python analysis/pareto.py` puts analysis/ on sys.path: a file there named like an installed
    module (as tables.py once was, PyTables' `tables`, which pandas imports) would shadow it."""
    here = Path(__file__).resolve().parents[2] / "analysis"
    stems = sorted(p.stem for p in here.glob("*.py") if not p.stem.startswith("_"))
    code = (
        "import importlib.util, json, sys; "
        f"print(json.dumps([s for s in {stems!r} if importlib.util.find_spec(s) is not None]))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd="/",
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [] and not {"tables"} & set(stems), (
        r.stdout
    )  # tables: named even where not installed


class _OwnMtpBackbone:
    """Just what `evabyte_mtp_runs` reads of an EvaByte backbone: its own `multi_byte_generate`
    (here: the prompt + 12 bytes in steps of 3, 4, 2, 3 bytes), its config and its stop ids."""

    name = "evabyte-tiny"
    stop_token_ids = (2, 11)
    eos_token_id = 2

    def __init__(self):
        import types

        self.model = self
        self.config = types.SimpleNamespace(num_pred_heads=8, return_dict=True)

    def multi_byte_generate(self, ids, max_new_tokens, return_acc_lengths):
        import torch

        new = torch.arange(100, 112)[None]
        return torch.cat([ids, new], 1)[:, : ids.shape[1] + max_new_tokens], [3, 4, 2, 3]


class _OwnMtpModel:
    def __init__(self):
        self.backbone = _OwnMtpBackbone()

    def generate_plain(self, p, **kw):
        import types

        import torch

        return types.SimpleNamespace(ids=torch.arange(100, 100 + kw["max_new_tokens"]))


def test_evabyte_mtp_runs_are_rows_of_the_analysis_and_a_design_of_their_own(tmp_path, capsys):
    """EvaByte's own multi-byte decoding (`evaluate --evabyte-mtp`) logged beside a head through the
    evaluator's own writer: `python -m analysis` shows it as a row (table, summary.csv) and the Pareto
    plot draws it as a design of its own (circuit `evabyte-mtp`, no rank), not skipped for missing
    metrics or an undefined rank."""
    import pandas as pd
    import torch

    from analysis import pareto_plot, style
    from analysis.aggregate import aggregate, split_settings
    from experiments.evaluation.decoding import log_evaluation_to_mlflow, summarize
    from experiments.evaluation.evabyte_mtp import METHOD, evabyte_mtp_runs

    prompts = [[torch.tensor([1, 72, 105]), torch.tensor([1, 80])] for _ in range(2)]
    own = evabyte_mtp_runs(_OwnMtpModel(), prompts, 12, set_names=["chat", "code"], eos=("banned",))
    assert len(own) == 2 and {r["circuit"] for r in own} == {METHOD}
    m = own[0]["metrics"]
    assert (
        m["tokens_per_cycle"] == 2 * 12 / 8 and m["mu_acc"] == m["tokens_per_cycle"] - 1
    )  # 3 bytes a step: 1 verified + 2
    heads = []
    for ev in synthetic_evaluations(circuits=("cp",), windows=(8,), prompt_sets=("chat", "code")):
        p = ev.params
        heads.append(
            {
                **{
                    k: p[k]
                    for k in (
                        "backbone",
                        "circuit",
                        "window",
                        "rank",
                        "lora_depth",
                        "mode",
                        "prompt_set",
                        "seed",
                    )
                },
                "head": "head",
                "backbone": "evabyte-tiny",
                "extra_token": "keep",
                "eos": "banned",
                "temperature": None,
                "top_p": None,
                "metrics": {
                    **{k: v for k, v in ev.metrics.items() if not k.startswith("acceptance_pos_")},
                    "per_position_acceptance": [None],
                    "accepted_length_histogram": ev.hist,
                },
            }
        )
    results = {
        "hardware": "test",
        "config": {"ff_head": None, "max_new_tokens": 12},
        "stp": {},
        "runs": heads + own,
    }
    results["summary"] = summarize(results)
    uri = fresh_tracking_uri(tmp_path / "mlflow")
    exp = tracking.ensure_experiment(uri, "evabyte")
    parent = tracking.start_parent_run(uri, exp, "trial", params={}, tags={})
    assert len(log_evaluation_to_mlflow(results, parent, tracking_uri=uri)) == 4

    result, _, _ = load(uri, "evabyte")
    assert not result.skipped, result.skipped
    df = result.runs
    assert sorted(df["circuit"]) == ["cp", "cp", METHOD, METHOD]
    assert df.loc[df.circuit == METHOD, "rank"].isna().all()
    names = {r.info.run_name for r in tracking.evaluation_runs(tracking.client(uri), [exp])}
    assert {n.split("/")[0] for n in names} == {"cp-r32-n8-k0", f"{METHOD}-n8-k0"}, (
        names
    )  # no rank named for it
    ((_, part),) = split_settings(aggregate(df))
    assert sorted(part["circuit"]) == ["cp", METHOD]
    row = part[part.circuit == METHOD].iloc[0]
    assert row["n_evals"] == 2 and row["mu_acc_mean"] == pytest.approx(2.0)
    ax = pareto_plot.pareto_figure(*split_settings(aggregate(df))[0]).axes[0]
    assert {c.get_gid() for c in ax.collections} >= {"circuit-cp", f"circuit-{METHOD}"}
    assert style.circuit_style(METHOD) != style.circuit_style("cp")  # its own colour and marker
    assert "8/–/0" in [t.get_text() for t in ax.texts if t.get_gid() == "point-label"]

    out = tmp_path / "out"
    assert (
        cli.main(["--tracking-uri", uri, "--experiment", "evabyte", "--out", str(out), "--no-log-to-mlflow"])
        == 0
    )
    assert "skipped" not in capsys.readouterr().err
    summary = pd.read_csv(out / "summary.csv")
    assert sorted(summary["circuit"]) == ["cp", METHOD]
    assert METHOD in (out / "table_greedy.md").read_text()


def _spy_pareto(monkeypatch) -> list:
    """Record the (setting, references) of every Pareto figure the CLI draws (and still draw it)."""
    from analysis import pareto_plot

    calls, real = [], pareto_plot.pareto_figure
    monkeypatch.setattr(
        pareto_plot,
        "pareto_figure",
        lambda setting, part, **kw: (
            calls.append((setting, kw.get("references"))) or real(setting, part, **kw)
        ),
    )
    return calls


def test_cli_reference_is_drawn_in_its_setting_and_logged_with_the_figures(
    store, tmp_path, capsys, monkeypatch
):
    """--reference FILE: drawn in the Pareto figure of the setting it was measured in (greedy, tiny,
    cpu-test, prompt sets chat and code), in no other; no flag: no figure gets one; a reference
    filtered out or measured elsewhere is a note; an unreadable file an error before anything loads."""
    from analysis.reference import write_reference
    from tests.analysis_helpers import evaluation_result

    ref = write_reference(
        tmp_path / "shipped_head.json", "shipped h (m=4)",
        evaluation_result(prompt_sets=("chat", "code"), acceptance=None, eos=None), "measured so",
    )  # fmt: skip
    base = ["--tracking-uri", store["uri"], "--experiment", "sweep", "--backbone", "tiny"]
    calls = _spy_pareto(monkeypatch)
    assert cli.main([*base, "--out", str(tmp_path / "a"), "--reference", str(ref)]) == 0  # logs the summary
    drawn = {s.mode: refs for s, refs in calls}
    assert [r.label for r in drawn["greedy"]] == ["shipped h (m=4)"] and drawn["sample"] == []
    assert "not drawn" not in capsys.readouterr().err
    client = tracking.client(store["uri"])
    exp = client.get_experiment_by_name("sweep")
    (summary,) = client.search_runs(
        [exp.experiment_id], filter_string=f"tags.`{tracking.SUMMARY_TAG}` = 'summary'"
    )
    logged = [Path(f.path).name for f in client.list_artifacts(summary.info.run_id, "references")]
    assert logged == ["shipped_head.json"]
    # no flag: every figure as before, without a reference
    calls.clear()
    assert cli.main([*base, "--out", str(tmp_path / "b"), "--no-log-to-mlflow"]) == 0
    assert calls and all(refs == [] for _, refs in calls)
    # the reference's setting filtered out: a note, no figure with it
    calls.clear()
    rc = cli.main(
        [
            *base,
            "--mode",
            "sample",
            "--out",
            str(tmp_path / "c"),
            "--reference",
            str(ref),
            "--no-log-to-mlflow",
        ]
    )
    assert rc == 0 and all(refs == [] for _, refs in calls)
    assert "reference 'shipped h (m=4)'" in capsys.readouterr().err
    # measured on other hardware: a note naming where, not drawn beside incomparable points
    other = write_reference(
        tmp_path / "other.json", "elsewhere", evaluation_result(prompt_sets=("chat", "code"), hardware="gpu-x",
                                                                acceptance=None, eos=None), "about",
    )  # fmt: skip
    calls.clear()
    assert (
        cli.main([*base, "--out", str(tmp_path / "d"), "--reference", str(other), "--no-log-to-mlflow"]) == 0
    )
    assert all(refs == [] for _, refs in calls)
    err = capsys.readouterr().err
    assert "'elsewhere'" in err and "measured in no setting" in err and "gpu-x" in err
    # an unreadable file: exit 1, one line, nothing written
    rc = cli.main([*base, "--out", str(tmp_path / "e"), "--reference", str(tmp_path / "missing.json")])
    err = capsys.readouterr().err
    assert rc == 1 and f"error: --reference {tmp_path / 'missing.json'}: no such file" in err
    assert "Traceback" not in err and not (tmp_path / "e").exists()


def test_a_reference_is_aggregated_as_the_same_evaluation_logged_by_a_trial(store, tmp_path):
    """The reference reader and the trial's path (log_evaluation_to_mlflow, then analysis.load) give
    one setting and one point: the reference is measured and aggregated as the sweep's points are."""
    from analysis.aggregate import aggregate, split_settings
    from analysis.reference import points_for, read_reference, reference_points, write_reference
    from experiments.evaluation.decoding import log_evaluation_to_mlflow
    from tests.analysis_helpers import evaluation_result

    results = evaluation_result(
        modes=("greedy", "sample"), temperature=1.0, hardware="cpu; engine compact/onednn"
    )
    uri = store["uri"]
    exp_id = tracking.ensure_experiment(uri, "reference-check")
    parent = tracking.start_parent_run(uri, exp_id, "shipped", tags={}, params={})
    log_evaluation_to_mlflow(results, parent, tracking_uri=uri)
    tracking.terminate(uri, [parent], "FINISHED")
    result, _, _ = load(uri, "reference-check")
    parts = split_settings(aggregate(result.runs))
    points = reference_points(read_reference(write_reference(tmp_path / "r.json", "ref", results, "about")))
    assert len(parts) == 2 and set(points) == {s for s, _ in parts}
    for setting, part in parts:
        (point,) = points_for(setting, part, [points])
        row = part.iloc[0]
        assert point.mu_lat == pytest.approx(row["mu_lat_mean"]) and point.mu_acc == pytest.approx(
            row["mu_acc_mean"]
        )
        assert point.throughput == pytest.approx(row["throughput_mean"])  # the derived one: offline
        assert (
            point.mu_acc_std == pytest.approx(row["mu_acc_std"]) and point.prompt_sets == row["prompt_sets"]
        )
