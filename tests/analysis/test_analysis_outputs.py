"""Aggregation, tables and figures on a synthetic sweep with known values (no MLflow store: the
runs DataFrame is built by the same `run_record`/`records_to_frame` the loader uses). Figures are
checked through their matplotlib objects: scatter offsets, error bars, iso-throughput lines."""

import math
import re

import numpy as np
import pandas as pd
import pytest

from analysis import paper_tables as tables
from analysis import pareto_plot, plots, style
from analysis.aggregate import aggregate, split_settings, stp_baseline
from analysis.front import pareto_mask
from analysis.hists import drafts_tested
from mtpc.names import CIRCUIT_KINDS
from tests.analysis_helpers import frame_from_evaluations, synthetic_evaluations


@pytest.fixture(scope="module")
def evals():
    return synthetic_evaluations(ranks=(8, 32), lora_depths=(0, 2))


@pytest.fixture(scope="module")
def runs(evals):
    return frame_from_evaluations(evals)


@pytest.fixture(scope="module")
def setting_part(runs):
    parts = split_settings(aggregate(runs))
    assert len(parts) == 1
    return parts[0]


def _expected(evals, **key):
    """Logged metric values of the evaluations of one configuration."""
    sel = [e for e in evals if all(e.params[k] == v for k, v in key.items())]
    assert sel
    return sel


def test_aggregate_is_mean_and_sample_std_of_logged_values(evals, setting_part):
    _, part = setting_part
    assert len(part) == 28  # ff: 2 n x 2 k; cp/hmm/btree: 2 n x 2 r x 2 k
    row = part[
        (part.circuit == "hmm") & (part.window == 16) & (part["rank"] == 8) & (part.lora_depth == 2)
    ].iloc[0]
    sel = _expected(evals, circuit="hmm", window=16, rank=8, lora_depth=2)
    thr = np.array([e.metrics["throughput"] for e in sel])
    assert row["n_evals"] == 3 and row["prompt_sets"] == "chat,code,math"
    assert row["throughput_mean"] == pytest.approx(thr.mean(), rel=1e-12)
    assert row["throughput_std"] == pytest.approx(thr.std(ddof=1), rel=1e-12)
    # the logged throughput is used, not tokens_per_cycle / mu_lat (3 % apart in the synthetic data)
    recomputed = np.mean([e.metrics["tokens_per_cycle"] / e.metrics["mu_lat"] for e in sel])
    assert abs(row["throughput_mean"] - recomputed) > 0.02 * recomputed
    assert row["acceptance_pos_16_mean"] == pytest.approx(
        np.mean([e.metrics["acceptance_pos_16"] for e in sel])
    )
    assert sorted(row["run_ids"]) == sorted(f"run{evals.index(e)}" for e in sel)
    # sorted by n, r, circuit (ff, cp, hmm, btree), k
    first = part.iloc[:6][["window", "rank", "circuit", "lora_depth"]].values.tolist()
    assert first == [
        [8, 1, "ff", 0],
        [8, 1, "ff", 2],
        [8, 8, "cp", 0],
        [8, 8, "cp", 2],
        [8, 8, "hmm", 0],
        [8, 8, "hmm", 2],
    ]


def test_split_settings_front_matches_mask(setting_part):
    setting, part = setting_part
    assert (setting.backbone, setting.mode, setting.extra_token, setting.hardware) == (
        "tiny",
        "greedy",
        "keep",
        "cpu-test",
    )
    pts = part[["mu_lat_mean", "mu_acc_mean"]].to_numpy()
    np.testing.assert_array_equal(part["on_front"].to_numpy(), pareto_mask(pts, ("min", "max")))
    assert 2 <= part["on_front"].sum() < len(part)


def test_settings_split_by_mode_and_extra_token(evals):
    more = evals + synthetic_evaluations(modes=("sample",), circuits=("cp",), windows=(8,))
    more += synthetic_evaluations(circuits=("cp",), windows=(8,), with_optional=False)
    parts = split_settings(aggregate(frame_from_evaluations(more)))
    titles = sorted(s.title() for s, _ in parts)
    # hardware/top_p absent on the third group: its own setting, not mixed with the first
    assert titles == [
        "tiny, greedy, extra=keep",
        "tiny, greedy, extra=keep, cpu-test",
        "tiny, sample, extra=keep, T=1, top-p=1, cpu-test",
    ]
    assert sorted(len(p) for _, p in parts) == [1, 1, 28]
    slugs = [s.slug() for s, _ in parts]
    assert len(set(slugs)) == 3 and all(re.fullmatch(r"[A-Za-z0-9._=-]+", s) for s in slugs)


def test_offline_and_online_runs_never_share_a_setting(evals):
    """acceptance_method is part of the setting: offline runs get their own figures and tables; a run
    without the param (a store from before it) is online."""
    import copy

    from analysis.aggregate import short_slugs

    offline = copy.deepcopy([e for e in evals if e.params["circuit"] == "cp"])
    for e in offline:
        e.params["acceptance_method"] = "offline"
        e.metrics["derived_throughput"] = e.metrics["throughput"] * 1.5
        e.metrics["derived_speedup_vs_stp"] = e.metrics["speedup_vs_stp"] * 1.5
    runs = frame_from_evaluations(evals + offline)
    assert set(runs["acceptance_method"]) == {"online", "offline"}  # the old runs read as online
    parts = split_settings(aggregate(runs))
    assert len(parts) == 2
    by = {s.acceptance_method: (s, p) for s, p in parts}
    assert set(by["offline"][1]["circuit"]) == {"cp"} and set(by["online"][1]["circuit"]) == set(
        CIRCUIT_KINDS
    )
    assert "offline acceptance" in by["offline"][0].title() and "offline" not in by["online"][0].title()
    assert short_slugs([by["online"][0], by["offline"][0]]) == ["greedy_online", "greedy_offline"]
    table = tables.to_markdown(tables.build_table(*by["offline"]))
    assert "offline acceptance" in table
    # the offline setting's figures and table read the derived throughput, as logged; the measured one is kept
    off = by["offline"][1]
    assert np.allclose(off["throughput_mean"], off["derived_throughput_mean"])
    assert np.allclose(off["throughput_mean"], 1.5 * off["measured_throughput_mean"])
    assert np.allclose(off["speedup_vs_stp_mean"], off["derived_speedup_vs_stp_mean"])
    assert (
        "derived_throughput_mean" not in by["online"][1]
        or by["online"][1]["derived_throughput_mean"].isna().all()
    )


def test_table_values_bold_and_stp_row(evals, setting_part):
    setting, part = setting_part
    table = tables.build_table(setting, part)
    assert table.keys == ["n", "r", "circuit", "k"]  # k varies, so it is a column
    rows = table.rows
    assert rows.iloc[0]["is_stp"] and rows.iloc[0]["circuit"] == "STP"
    stp_lat = np.mean([e.metrics["stp_mu_lat"] for e in evals])
    assert rows.iloc[0]["mu_lat"] == pytest.approx(stp_lat * 1000, rel=1e-3)
    sel = _expected(evals, circuit="btree", window=8, rank=32, lora_depth=0)
    r = rows[(rows.circuit == "btree") & (rows.n == 8) & (rows.r == 32) & (rows.k == 0)].iloc[0]
    assert r["mu_lat"] == pytest.approx(1000 * np.mean([e.metrics["mu_lat"] for e in sel]))
    assert r["mu_lat_std"] == pytest.approx(1000 * np.std([e.metrics["mu_lat"] for e in sel], ddof=1))
    assert r["speedup_vs_stp"] == pytest.approx(np.mean([e.metrics["speedup_vs_stp"] for e in sel]))
    # best = max logged throughput over configurations, bold exactly there
    best = part.loc[part["throughput_mean"].idxmax()]
    assert table.best["throughput"] == pytest.approx(best["throughput_mean"])
    md = tables.to_markdown(table)
    d = table.decimals["throughput"]
    cell = f"**{best['throughput_mean']:.{d}f} ± {best['throughput_std']:.{d}f}**"
    assert cell in md
    lines = [ln for ln in md.splitlines() if ln.startswith("| ")]
    assert len(lines) == 1 + 1 + len(part)  # header, STP, configurations
    assert sum(ln.count("**") for ln in lines) == 2 * 5  # one bold cell per column
    tex = tables.to_latex(table)
    assert tex.count(r"\mathbf{") == 5 and r"\toprule" in tex and tex.count(r" \\") == len(part) + 2
    assert f"$\\mathbf{{{best['throughput_mean']:.{d}f} \\pm {best['throughput_std']:.{d}f}}}$" in tex
    line = tables.best_configuration(setting, part)
    ranked = part.loc[part["speedup_vs_stp_mean"].idxmax()]  # the line ranks by × own STP (test below)
    assert line.split(" — ")[0].endswith(tables.config_label(ranked))
    assert f"{ranked['throughput_mean']:.1f}" in line
    if "kl_beta" in part.columns and pd.notna(best.get("kl_beta")):  # CE and distilled heads told apart
        assert f" β={best['kl_beta']:g}" in line
    twin = part.copy()
    twin["kl_beta"], twin["train_seed"] = 0.5, 1
    assert " β=0.5 seed=1 — " in tables.best_configuration(setting, twin)


def test_best_configuration_ranks_by_own_stp_ratio_and_does_not_rank_within_the_tie_band(setting_part):
    """ "Best" ranks by the ratio to each evaluation's own STP (it cancels the machine's drift between
    trials), the throughput only when no STP was logged; heads within the tie band of the best are
    named beside it, unranked; one just outside is not."""
    setting, part = setting_part
    part = part.reset_index(drop=True).copy()
    assert tables.ranking_column(part) == "speedup_vs_stp_mean"
    order = part["speedup_vs_stp_mean"].sort_values(ascending=False).index
    top = float(part.loc[order[0], "speedup_vs_stp_mean"])
    part.loc[order[1], "speedup_vs_stp_mean"] = top * 0.97  # inside 5 %
    part.loc[order[2:], "speedup_vs_stp_mean"] = top * 0.94  # outside
    part.loc[order[-1], "throughput_mean"] = 10 * part["throughput_mean"].max()  # fastest in B/s, not best
    line = tables.best_configuration(setting, part)
    first, second = part.loc[order[0]], part.loc[order[1]]
    assert line.startswith(f"best [{setting.title()}]: {tables.config_label(first)} — ")
    tail = line.split("not ranked: ", 1)[1]
    assert tail == f"{tables.config_label(second)} ({top * 0.97:.2f})"
    assert "; within 5% of it in × own STP, not ranked: " in line
    assert "not ranked" not in tables.best_configuration(setting, part, tie_band=0.01)
    no_stp = part.drop(columns=["speedup_vs_stp_mean"])
    assert tables.ranking_column(no_stp) == "throughput_mean"
    assert (
        tables.config_label(part.loc[order[-1]]) in tables.best_configuration(setting, no_stp).split(" — ")[0]
    )


def test_table_stp_row_and_its_x_stp_column_agree(evals):
    """Each trial measures its own STP; when the machine's speed drifts between trials (the demo's
    STP ran at 97 to 215 B/s), the logged speedup_vs_stp (throughput / the trial's own STP) is not
    throughput / the STP row. The table says which ratio is which and shows both: the `× STP row`
    column is the configuration's throughput over the STP row's, and the STP row is 1 in both."""
    drifting = []
    trials = sorted({e.trial for e in evals})
    for e in evals:  # the STP of each trial scaled by a trial-dependent factor (0.5x .. 2x)
        f = 0.5 + 1.5 * trials.index(e.trial) / (len(trials) - 1)
        m = dict(
            e.metrics, stp_mu_lat=e.metrics["stp_mu_lat"] * f, stp_throughput=e.metrics["stp_throughput"] / f
        )
        m["speedup_vs_stp"] = m["throughput"] / m["stp_throughput"]
        drifting.append(type(e)(e.params, m, e.hist, trial=e.trial))
    setting, part = split_settings(aggregate(frame_from_evaluations(drifting)))[0]
    table = tables.build_table(setting, part)
    rows, stp = table.rows.iloc[1:], table.rows.iloc[0]
    assert stp["is_stp"] and stp["speedup_vs_stp"] == 1.0 and stp[tables.STP_ROW_RATIO] == 1.0
    np.testing.assert_allclose(rows[tables.STP_ROW_RATIO], rows["throughput"] / stp["throughput"], rtol=1e-12)
    # the other column is each trial's own ratio, as logged, and here it differs from the row ratio
    np.testing.assert_allclose(rows["speedup_vs_stp"], part["speedup_vs_stp_mean"], rtol=1e-12)
    assert (
        np.abs(rows["speedup_vs_stp"].to_numpy(float) / rows[tables.STP_ROW_RATIO].to_numpy(float) - 1).max()
        > 0.1
    )
    md = tables.to_markdown(table)
    header = next(ln for ln in md.splitlines() if ln.startswith("| n "))
    assert "× own STP" in header and "× STP row" in header and "× own STP: each evaluation's throughput" in md
    assert r"$\times$ STP row" in tables.to_latex(table)


def test_table_single_prompt_set_has_no_std(evals):
    one = [e for e in evals if e.params["prompt_set"] == "chat"]
    setting, part = split_settings(aggregate(frame_from_evaluations(one)))[0]
    md = tables.to_markdown(tables.build_table(setting, part))
    assert "±" not in md.split("\n", 3)[3].replace("(mean ± std", "")
    assert part["throughput_std"].isna().all()


def _iso_lines(ax):
    return [ln for ln in ax.lines if ln.get_gid() == "iso-throughput"]


def test_pareto_figure_points_errorbars_front_stp(setting_part):
    setting, part = setting_part
    fig = pareto_plot.pareto_figure(setting, part)
    ax = fig.axes[0]
    for c in CIRCUIT_KINDS:
        sub = part[part.circuit == c]
        (sc,) = [col for col in ax.collections if col.get_gid() == f"circuit-{c}"]
        # accepted bytes as returned: each point lies on the iso-line of its logged throughput
        expected = np.column_stack(
            [sub["throughput_mean"] * sub["mu_lat_mean"] - 1, sub["mu_lat_mean"] * 1000]
        )
        np.testing.assert_allclose(sc.get_offsets(), expected)
        xy = sc.get_offsets()
        np.testing.assert_allclose(1000 * (xy[:, 0] + 1) / xy[:, 1], sub["throughput_mean"], rtol=1e-9)
        # error bars: one vertical and one horizontal segment per point, of length 2 std
        (eb,) = [cont for cont in ax.containers if cont.get_label() == f"_errorbar-{c}"]
        _, _, (xbars, ybars) = eb.lines
        xs = np.array([seg[1, 0] - seg[0, 0] for seg in xbars.get_segments()])
        ys = np.array([seg[1, 1] - seg[0, 1] for seg in ybars.get_segments()])
        np.testing.assert_allclose(xs, 2 * sub["mu_acc_std"], rtol=1e-9)
        np.testing.assert_allclose(ys, 2 * sub["mu_lat_std"] * 1000, rtol=1e-9)
    (front,) = [ln for ln in ax.lines if ln.get_gid() == "pareto-front"]
    fp = part[part.on_front].assign(x=lambda d: d.throughput_mean * d.mu_lat_mean - 1).sort_values("x")
    np.testing.assert_allclose(front.get_xdata(), fp["x"])
    np.testing.assert_allclose(front.get_ydata(), fp["mu_lat_mean"] * 1000)
    (stp,) = [col for col in ax.collections if col.get_gid() == "stp"]
    lat, _, thr, _ = stp_baseline(part)
    np.testing.assert_allclose(stp.get_offsets(), [[thr * lat - 1, lat * 1000]])  # on the STP row's line
    # labels n/r/k: 28 points > MAX_LABELLED_POINTS, so only the front is labelled (where a label fits)
    labels = [t.get_text() for t in ax.texts if t.get_gid() == "point-label"]
    want = sorted(f"{r.window}/{r.rank}/{r.lora_depth}" for r in fp.itertuples())
    assert set(labels) <= set(want) and len(labels) >= len(want) - 2, (labels, want)
    style.plt.close(fig)


def test_pareto_figure_iso_lines(setting_part):
    setting, part = setting_part
    fig = pareto_plot.pareto_figure(setting, part)
    ax = fig.axes[0]
    lines = _iso_lines(ax)
    assert len(lines) >= 3
    x0, x1 = ax.get_xlim()
    levels = []
    for ln in lines:
        x, y = ln.get_xdata(), ln.get_ydata()
        assert ln.get_linestyle() == "--"
        assert x[0] == pytest.approx(x0) and x[-1] == pytest.approx(x1)  # spans the whole box
        t = 1000 * (x + 1.0) / y  # extra_token=keep: tokens_per_cycle = mu_acc + 1
        np.testing.assert_allclose(t, t[0], rtol=1e-9)  # constant throughput along the line
        slope = np.polyfit(x, y, 1)[0]
        assert slope == pytest.approx(1000 / t[0], rel=1e-9)
        levels.append(t[0])
    rates = part["throughput_mean"]  # the tables' throughput, not tokens_per_cycle / mu_lat
    assert min(levels) <= rates.max() and max(levels) >= rates.min()
    assert min(levels) <= rates.min() * 1.3 and max(levels) >= rates.max() / 1.3  # spans the data
    # every label names one of the drawn levels in bytes/s
    texts = [t.get_text() for t in ax.texts if t.get_gid() == "iso-label"]
    assert texts and any("(STP)" in t for t in texts)
    assert len(texts) == len(lines) + 1  # every line labelled (the STP line too)
    for t in texts:
        if "(STP)" in t:
            continue
        value = float(re.fullmatch(r"([\d.]+) B/s", t).group(1))
        assert any(math.isclose(value, lv, rel_tol=1e-3) for lv in levels), (t, levels)
    (stp_line,) = [ln for ln in ax.lines if ln.get_gid() == "iso-throughput-stp"]
    lat, _, thr, _ = stp_baseline(part)
    assert np.interp(thr * lat - 1, stp_line.get_xdata(), stp_line.get_ydata()) == pytest.approx(lat * 1000)
    assert f"{style.format_rate(thr)} (STP)" in texts  # the STP row's throughput, not 1 / stp_mu_lat
    style.plt.close(fig)


def test_iso_offset_and_levels():
    from analysis.aggregate import Setting

    part = pd.DataFrame({"tokens_per_cycle_mean": [1.5, 2.5], "mu_acc_mean": [1.2, 2.0]})
    assert pareto_plot.iso_offset(Setting("b", "greedy", "keep"), part) == 1.0
    assert pareto_plot.iso_offset(Setting("b", "greedy", "drop"), part) == pytest.approx(0.4)
    lv = pareto_plot.iso_levels(43.0, 141.0)
    assert lv.min() >= 43 * 0.95 and lv.max() <= 141 * 1.05 and len(lv) >= 3
    assert style.format_rate(1234.0) == "1.23 kB/s" and style.format_rate(80.0) == "80 B/s"


def test_throughput_figures_use_the_slice(evals, setting_part):
    setting, part = setting_part
    fig = plots.throughput_figure(setting, part, x="window")
    ax = fig.axes[0]
    assert "r=32, k=0" in ax.get_title()  # ranks 8/32 tie -> largest; k 0/2 tie -> smallest
    for c, rank in (("ff", 1), ("cp", 32), ("btree", 32)):
        (ln,) = [ln for ln in ax.lines if ln.get_gid() == f"circuit-{c}"]
        want = [
            np.mean(
                [
                    e.metrics["throughput"]
                    for e in _expected(evals, circuit=c, window=n, rank=rank, lora_depth=0)
                ]
            )
            for n in (8, 16)
        ]
        np.testing.assert_allclose(ln.get_xdata(), [8, 16])
        np.testing.assert_allclose(ln.get_ydata(), want)
    (stp,) = [ln for ln in ax.lines if ln.get_gid() == "stp"]
    assert stp.get_ydata()[0] == pytest.approx(stp_baseline(part)[2])
    style.plt.close(fig)
    fig = plots.throughput_figure(setting, part, x="lora_depth")
    (ln,) = [ln for ln in fig.axes[0].lines if ln.get_gid() == "circuit-hmm"]
    want = [
        np.mean(
            [
                e.metrics["throughput"]
                for e in _expected(evals, circuit="hmm", window=16, rank=32, lora_depth=k)
            ]
        )
        for k in (0, 2)
    ]
    np.testing.assert_allclose(ln.get_ydata(), want)
    style.plt.close(fig)
    assert plots.throughput_figure(setting, part[part.window == 8], x="window") is None
    with pytest.raises(ValueError, match="x='rank'"):
        plots.throughput_figure(setting, part, x="rank")


def test_acceptance_and_accepted_length_figures(evals, runs, setting_part):
    setting, part = setting_part
    fig = plots.acceptance_figure(setting, part)
    ax = fig.axes[0]
    assert {ln.get_gid() for ln in ax.lines} == {"circuit-ff", "circuit-cp", "circuit-hmm", "circuit-btree"}
    best_bt = part[part.circuit == "btree"].sort_values("throughput_mean").iloc[-1]
    (ln,) = [ln for ln in ax.lines if ln.get_gid() == "circuit-btree"]
    n = int(best_bt["window"])
    np.testing.assert_allclose(ln.get_xdata(), np.arange(2, n + 1))
    np.testing.assert_allclose(ln.get_ydata(), [best_bt[f"acceptance_pos_{i}_mean"] for i in range(2, n + 1)])
    style.plt.close(fig)

    hists = {f"run{i}": np.asarray(e.hist, float) for i, e in enumerate(evals)}
    # with the counts: the drafts tested per position beneath, and a 95 % Wilson band from them
    fig = plots.acceptance_figure(setting, part, hists=hists)
    ax, ax_n = fig.axes
    total = sum(hists[r] for r in best_bt["run_ids"])
    tested = drafts_tested(total, n, "keep")[1:]  # positions 2..n
    (counts,) = [ln for ln in ax_n.lines if ln.get_gid() == "tested-btree"]
    np.testing.assert_allclose(counts.get_xdata(), np.arange(2, n + 1))
    np.testing.assert_allclose(counts.get_ydata(), tested)
    (band,) = [b for b in ax.collections if b.get_gid() == "band-btree"]
    lo, hi = plots.wilson_interval(
        np.array([best_bt[f"acceptance_pos_{i}_mean"] for i in range(2, n + 1)]), tested
    )
    ys = band.get_paths()[0].vertices[:, 1]
    assert ys.min() == pytest.approx(lo.min()) and ys.max() == pytest.approx(hi.max())
    assert "95 % Wilson" in ax.get_title()
    style.plt.close(fig)

    fig = plots.accepted_length_figure(setting, part, hists)
    (ln,) = [ln for ln in fig.axes[0].lines if ln.get_gid() == "circuit-btree"]
    np.testing.assert_allclose(ln.get_ydata(), total / total.sum())
    style.plt.close(fig)
    # the evaluator's counts run to s = n (always 0: a cycle drafts n - 1 bytes): the axis stops at n - 1
    longer = {r: np.append(h, 0.0) for r, h in hists.items()}
    fig = plots.accepted_length_figure(setting, part, longer)
    n_max = max(int(row["window"]) for row, *_ in plots.representatives(part, 4))
    assert fig.axes[0].get_xlim() == (-0.5, n_max - 0.5)
    assert all(ln.get_xdata().max() <= n_max - 1 for ln in fig.axes[0].lines)
    style.plt.close(fig)
    assert plots.accepted_length_figure(setting, part, {}) is None
    no_acc = part.drop(columns=[c for c in part.columns if c.startswith("acceptance_pos_")])
    assert plots.acceptance_figure(setting, no_acc) is None


def _extents(fig, gid):
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    return [t.get_window_extent(r) for t in fig.axes[0].texts if t.get_gid() == gid]


def test_pareto_labels_readable_no_overlap_inside_box(setting_part):
    """Readability regressions: n/r/k labels overlap no other label (n/r/k or iso-throughput); iso
    labels stay inside."""
    setting, part = setting_part
    fig = pareto_plot.pareto_figure(setting, part)
    labels = _extents(fig, "point-label")
    iso = _extents(fig, "iso-label")
    for i in range(len(labels)):
        for j in range(i + 1, len(labels)):
            assert style.overlap(labels[i], labels[j]) == 0, (i, j)
        assert all(style.overlap(labels[i], e) == 0 for e in iso), i
    box = fig.axes[0].get_window_extent(fig.canvas.get_renderer())
    for ext in _extents(fig, "iso-label"):
        assert box.x0 - 1 <= ext.x0 and ext.x1 <= box.x1 + 1 and box.y0 - 1 <= ext.y0 and ext.y1 <= box.y1 + 1
    style.plt.close(fig)


def test_pareto_figure_drop_mode_marks_iso_lines_approximate(evals):
    sel = [e for e in evals if e.params["lora_depth"] == 0 and e.params["rank"] in (1, 32)]
    runs = frame_from_evaluations(sel)
    runs["extra_token"] = "drop"
    runs["tokens_per_cycle"] = runs["mu_acc"] + 0.3  # mean max(s, 1): not mu_acc + 1
    setting, part = split_settings(aggregate(runs))[0]
    assert setting.extra_token == "drop" and pareto_plot.iso_offset(setting, part) == pytest.approx(0.3)
    fig = pareto_plot.pareto_figure(setting, part)
    ax = fig.axes[0]
    texts = [t.get_text() for t in ax.texts if t.get_gid() == "iso-label"]
    assert texts and all(t.startswith("≈") for t in texts)
    assert not [ln for ln in ax.lines if ln.get_gid() == "iso-throughput-stp"]
    for ln in _iso_lines(ax):
        t = 1000 * (ln.get_xdata() + 0.3) / ln.get_ydata()
        np.testing.assert_allclose(t, t[0], rtol=1e-9)
    assert len([t for t in ax.texts if t.get_gid() == "point-label"]) == len(
        part
    )  # <= 12 points: all labelled
    style.plt.close(fig)


def test_drafts_tested_follows_the_decoding_loops_bookkeeping():
    """The counts derived from the accepted-length histogram equal what DecodeStats records when
    called as mtpc/speculative/loop.py calls it (keep: positions 2..s+2; drop: 1..s+1)."""
    import random

    from mtpc.speculative.loop import DecodeStats

    for extra in ("keep", "drop"):
        for n in (2, 4, 7):
            st, rnd = DecodeStats(window=n, extra_token=extra), random.Random(n)
            for _ in range(300):
                s = rnd.randint(0, n - 1)
                if extra == "keep":
                    st.record_cycle(0.0, s, s + 1, 1, min(s + 1, n - 1))
                else:
                    st.record_cycle(0.0, s, max(s, 1), 0, min(s + 1, n))
            hist = np.bincount(st.accepted, minlength=n + 1)
            assert list(drafts_tested(hist, n, extra)) == st.tested_at, (extra, n)


def test_short_file_names_and_png_width(setting_part, tmp_path):
    from analysis.aggregate import Setting, short_slugs

    g, s1 = (
        Setting("default", "greedy", "keep", 1.0, 1.0, "cpu"),
        Setting("default", "sample", "keep", 1.0, 1.0, "cpu"),
    )
    assert short_slugs([g, s1]) == ["greedy", "sample"]
    assert short_slugs([g, s1, Setting("default", "sample", "keep", 0.7, 1.0, "cpu")]) == [
        "greedy",
        "sample_T1",
        "sample_T0.7",
    ]
    assert short_slugs([g, Setting("tiny", "greedy", "drop", 1.0, 1.0, "cpu")]) == [
        "greedy_keep_default",
        "greedy_drop_tiny",
    ]
    setting, part = setting_part
    fig = pareto_plot.pareto_figure(setting, part, width=8.0)  # 8 in at 300 dpi would be 2400 px
    (png, _) = style.save(fig, tmp_path, "pareto_greedy")
    from PIL import Image

    assert Image.open(png).size[0] <= style.MAX_PNG_PX
