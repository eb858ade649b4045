"""The analysis keeps runs trained differently apart and shows degeneracy: kl_beta (CE vs
distillation) and train_seed are configuration keys, eos a setting key; tables carry a
degenerate_fraction column, β / seed key columns when they vary, and a warning when acceptance
comes from degenerate text (> 0.25), as do the Pareto figure's title and the CLI."""

from __future__ import annotations

import copy

import pytest

from analysis import paper_tables as tables
from analysis import pareto_plot, style
from analysis.aggregate import aggregate, split_settings
from tests.analysis_helpers import frame_from_evaluations, synthetic_evaluations


def variants(degenerate=0.0):
    """cp/btree at n = 8: CE (kl_beta 0) and KL (0.5) heads, two training seeds each, EOS banned and allowed."""
    base = synthetic_evaluations(circuits=("cp", "btree"), windows=(8,))
    out = []
    for beta in (0.0, 0.5):
        for seed in (0, 1):
            for eos in ("banned", "allowed"):
                for ev in base:
                    e = copy.deepcopy(ev)
                    e.params.update(kl_beta=beta, kl_temperature=1.0, train_seed=seed, eos=eos)
                    e.metrics["mu_acc"] += beta + 0.01 * seed  # distinct values per variant
                    e.metrics["degenerate_fraction"] = degenerate
                    e.metrics["distinct_4gram_ratio"] = 0.8
                    out.append(e)
    return out


def test_ce_and_kl_runs_and_seeds_are_never_averaged_and_eos_splits_settings():
    evals = variants()
    parts = split_settings(aggregate(frame_from_evaluations(evals)))
    assert sorted(s.eos for s, _ in parts) == ["allowed", "banned"]
    setting, part = next((s, p) for s, p in parts if s.eos == "banned")
    assert "EOS banned" in setting.title() and "eos-banned" in setting.slug()
    assert len(part) == 2 * 2 * 2  # circuits x kl_beta x train_seed
    row = part[(part.circuit == "cp") & (part.kl_beta == 0.5) & (part.train_seed == 1)].iloc[0]
    sel = [
        e
        for e in evals
        if (e.params["circuit"], e.params["kl_beta"], e.params["train_seed"], e.params["eos"])
        == ("cp", 0.5, 1, "banned")
    ]
    assert row["n_evals"] == 3 and row["mu_acc_mean"] == pytest.approx(
        sum(e.metrics["mu_acc"] for e in sel) / 3
    )
    table = tables.build_table(setting, part)
    assert table.keys == ["n", "r", "circuit", "β", "seed"]
    md = tables.to_markdown(table)
    header = next(line for line in md.splitlines() if line.startswith("| n |"))
    assert header.endswith("| degenerate |") and "| β | seed |" in header
    assert "warning" not in md and tables.degeneracy_warning(table) is None
    # the figure's point labels tell the twins and seeds apart too
    labels = {pareto_plot.point_label(r) for _, r in part.iterrows()}
    assert {"8/32/0", "8/32/0 s1", "8/32/0 β0.5", "8/32/0 β0.5 s1"} <= labels, labels


def test_one_training_variant_shows_no_extra_key_columns():
    evals = [
        e
        for e in variants()
        if e.params["kl_beta"] == 0.0 and e.params["train_seed"] == 0 and e.params["eos"] == "banned"
    ]
    setting, part = split_settings(aggregate(frame_from_evaluations(evals)))[0]
    assert tables.build_table(setting, part).keys == ["n", "r", "circuit"]


def test_degenerate_text_is_flagged_in_tables_figure_and_cli_line():
    evals = [e for e in variants(degenerate=0.6) if e.params["eos"] == "banned"]
    setting, part = split_settings(aggregate(frame_from_evaluations(evals)))[0]
    table = tables.build_table(setting, part)
    warning = tables.degeneracy_warning(table)
    assert warning is not None and "8 of 8 row(s)" in warning and "looping text" in warning
    md, tex = tables.to_markdown(table), tables.to_latex(table)
    assert f"> ⚠ {warning}" in md and "0.600 ± 0.000" in md
    assert "looping text" in tex
    fig = pareto_plot.pareto_figure(setting, part)
    assert "8/8 configs degenerate > 0.25" in " ".join(fig.axes[0].get_title().split())
    style.plt.close(fig)
    evals_ok = [e for e in variants(degenerate=0.25) if e.params["eos"] == "banned"]
    setting, part = split_settings(aggregate(frame_from_evaluations(evals_ok)))[0]
    assert tables.degeneracy_warning(tables.build_table(setting, part)) is None  # > 0.25, not >=


def test_point_labels_follow_the_axis_table(monkeypatch):
    """The labels come from tracking/axes.py's training rows: a row added there shows in the label
    off its default (by its mark, else its label), and not at its default or where the row lacks it."""
    from tracking import axes

    lr = axes.Axis("lr", "model.lr", axes.TRAINING, "lr", "lr", float, 3e-4)
    monkeypatch.setattr(axes, "AXES", (*axes.AXES, lr))
    row = {"window": 8, "rank": 32, "lora_depth": 0, "kl_beta": 0.5, "train_seed": 1, "lr": 1e-3}
    assert pareto_plot.point_label(row) == "8/32/0 β0.5 s1 lr0.001"
    assert pareto_plot.point_label({**row, "lr": 3e-4}) == "8/32/0 β0.5 s1"
    assert pareto_plot.point_label({**row, "kl_temperature": 2.0, "lr": None}) == "8/32/0 β0.5 T_kl2 s1"
