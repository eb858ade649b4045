"""The secondary figures of one setting, sized for a paper column, returned as matplotlib Figures:

- `throughput_figure`: logged throughput against window n or LoRA depth k on one slice of the
  other keys (`throughput_slice`), STP as a dotted line.
- `acceptance_figure`: per-position acceptance (acceptance_pos_<i>) of the `representatives`, the
  drafts tested per position beneath and a 95 % Wilson band (counts from the histogram artifacts).
- `accepted_length_figure`: the accepted-length distribution from the histogram artifacts, 0..n−1.

Lines carry `gid`s "circuit-<c>" and "stp". The Pareto figure lives in analysis/pareto_plot.py,
the look (and `save`) in analysis/style.py; data loading and tables elsewhere.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from analysis.aggregate import Setting, stp_baseline
from analysis.hists import drafts_tested
from analysis.load import ACC_POS_RE
from analysis.style import (
    COLUMN_WIDTH_IN,
    HEIGHT_IN,
    circuit_style,
    circuits_in,
    nan0,
    paper_style,
    plt,
    wrap_title,
)


def _config_label(row: pd.Series, vary: tuple[str, ...]) -> str:
    names = {"window": "n", "rank": "r", "lora_depth": "k"}
    return " ".join([str(row["circuit"])] + [f"{names[k]}={row[k]}" for k in vary])


def _mode_value(values: pd.Series, prefer: str):
    """Most frequent value; ties broken towards the largest ("max") or smallest ("min")."""
    counts = values.dropna().value_counts()
    if counts.empty:
        return None
    top = counts[counts == counts.max()].index
    return max(top) if prefer == "max" else min(top)


def throughput_slice(part: pd.DataFrame, x: str) -> tuple[pd.DataFrame, dict[str, int]]:
    """The rows of a throughput-vs-``x`` plot: the other keys held at their most common value
    (rank among non-ff circuits, ties to the largest; window ties to the largest; LoRA depth
    ties to the smallest), as in the paper's slices (RQ2: r = 32, k = 0; RQ3: n = 16, r = 32).
    ff (rank 1) is kept at any rank. Returns (rows, {key: held value})."""
    held: dict[str, int] = {}
    non_ff = part[part["circuit"] != "ff"]
    rank = _mode_value(non_ff["rank"] if len(non_ff) else part["rank"], "max")
    other = "lora_depth" if x == "window" else "window"
    other_v = _mode_value(part[other], "min" if other == "lora_depth" else "max")
    keep = part[other] == other_v
    if rank is not None:
        keep &= (part["rank"] == rank) | (part["circuit"] == "ff")
        held["rank"] = int(rank)
    held[other] = int(other_v)
    return part[keep.to_numpy(dtype=bool, na_value=False)], held


def throughput_figure(
    setting: Setting, part: pd.DataFrame, x: str = "window", width: float = COLUMN_WIDTH_IN
) -> Figure | None:
    """Logged throughput (mean ± std) against ``x`` ("window" or "lora_depth"), one line per
    circuit on the slice of `throughput_slice`; None when ``x`` takes fewer than two values there."""
    if x not in ("window", "lora_depth"):
        raise ValueError(f"x={x!r}: expected 'window' or 'lora_depth'")
    rows, held = throughput_slice(part, x)
    if rows[x].nunique() < 2:
        return None
    xlabel = "window $n$ (bytes)" if x == "window" else "LoRA depth $k$ (layers)"
    names = {"window": "n", "rank": "r", "lora_depth": "k"}
    with paper_style():
        fig, ax = plt.subplots(figsize=(width, HEIGHT_IN), layout="constrained")
        for c in circuits_in(rows):
            g = rows[rows["circuit"] == c].sort_values(x)
            color, marker = circuit_style(c)
            eb = ax.errorbar(
                g[x].to_numpy(dtype=float), g["throughput_mean"].to_numpy(dtype=float),
                yerr=nan0(g["throughput_std"].to_numpy(dtype=float)), color=color, marker=marker, ms=3,
                capsize=1.2, elinewidth=0.6, label=c,
            )  # fmt: skip
            eb.lines[0].set_gid(f"circuit-{c}")  # the data line (caps and bars stay anonymous)
        stp = stp_baseline(part)
        if stp is not None and math.isfinite(stp[2]):
            ax.axhline(stp[2], ls=":", color="black", lw=0.8, label="STP", gid="stp")
        ax.set_xticks(sorted(rows[x].dropna().unique().astype(float)))
        ax.set_xlabel(xlabel)
        ax.set_ylabel("throughput (bytes/s)")
        held_text = ", ".join(f"{names[k]}={v}" for k, v in held.items())
        ax.set_title(  # wrapped: a long hardware string once made this figure 2000 px wide
            f"{wrap_title(setting.title())}\n({held_text}; ff: r=1)" if "rank" in held
            else wrap_title(f"{setting.title()} ({held_text})"),
            pad=3,
        )  # fmt: skip
        ax.legend(
            loc="best", frameon=True, framealpha=0.85, edgecolor="none", handlelength=1.5, labelspacing=0.3
        )
    return fig


_PALETTE = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000")


def representatives(part: pd.DataFrame, top: int) -> list[tuple[pd.Series, str, str]]:
    """The configurations shown in the acceptance plots, with colour and marker: the fastest
    (highest mean throughput) of each circuit, coloured by circuit; when only one circuit is
    present, its ``top`` fastest configurations in distinct colours."""
    ranked = part.sort_values("throughput_mean", ascending=False, kind="stable")
    circuits = circuits_in(part)
    if len(circuits) > 1:
        out = []
        for c in circuits:
            row = ranked[ranked["circuit"] == c].iloc[0]
            color, marker = circuit_style(c)
            out.append((row, color, marker))
        return out
    marker = circuit_style(circuits[0])[1]
    return [
        (row, _PALETTE[j % len(_PALETTE)], marker) for j, (_, row) in enumerate(ranked.head(top).iterrows())
    ]


def _rep_caption(part: pd.DataFrame) -> str:
    return "fastest configuration per circuit" if len(circuits_in(part)) > 1 else "fastest configurations"


def wilson_interval(rate: np.ndarray, n: np.ndarray, z: float = 1.96) -> tuple[np.ndarray, np.ndarray]:
    """The 95 % Wilson score interval of a proportion `rate` out of `n` trials (NaN where n = 0)."""
    n = np.asarray(n, dtype=float)
    with np.errstate(invalid="ignore", divide="ignore"):
        centre = (rate + z * z / (2 * n)) / (1 + z * z / n)
        half = z * np.sqrt(rate * (1 - rate) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return np.where(n > 0, centre - half, np.nan), np.where(n > 0, centre + half, np.nan)


def _pooled(row: pd.Series, hists: dict[str, np.ndarray]) -> np.ndarray | None:
    """The accepted-length counts of a configuration, summed over its prompt sets' runs."""
    counts = [hists[r] for r in row["run_ids"] if r in hists]
    if not counts:
        return None
    total = np.zeros(max(len(c) for c in counts))
    for c in counts:
        total[: len(c)] += c
    return total


def acceptance_figure(
    setting: Setting,
    part: pd.DataFrame,
    top: int = 5,
    width: float = COLUMN_WIDTH_IN,
    hists: dict[str, np.ndarray] | None = None,
) -> Figure | None:
    """Per-position acceptance rate (accepted / tested at window position i) of the
    `representatives`, with the drafts tested at each position beneath (pooled over prompt sets,
    from the accepted-length histograms `hists`) and a 95 % Wilson band from those counts, so a
    0 or 1 from a handful of tests shows as what it is; None when no acceptance_pos_<i> was logged."""
    cols = [c for c in part.columns if str(c).endswith("_mean") and ACC_POS_RE.match(str(c)[: -len("_mean")])]
    cols.sort(key=lambda c: int(ACC_POS_RE.match(c[: -len("_mean")]).group(1)))
    if not cols or not np.isfinite(part[cols].to_numpy(dtype=float)).any():
        return None
    pos = np.array([int(ACC_POS_RE.match(c[: -len("_mean")]).group(1)) for c in cols])
    hists = hists or {}
    with paper_style():
        fig, (ax, ax_n) = plt.subplots(2, 1, figsize=(width, HEIGHT_IN * 1.3), layout="constrained", sharex=True,
                                       gridspec_kw={"height_ratios": (3, 1.2)})  # fmt: skip
        counted = False
        for row, color, marker in representatives(part, top):
            v = row[cols].to_numpy(dtype=float)
            ok = np.isfinite(v)
            if not ok.any():
                continue
            ax.plot(pos[ok], v[ok], marker=marker, ms=3, color=color, label=_config_label(row, ("window", "rank", "lora_depth")),
                    gid=f"circuit-{row['circuit']}")  # fmt: skip
            hist = _pooled(row, hists)
            if hist is None:
                continue
            tested = drafts_tested(hist, int(max(row["window"], pos.max())), setting.extra_token or "keep")[
                pos - 1
            ]
            lo, hi = wilson_interval(v, tested)
            band = ok & (tested > 0)
            ax.fill_between(
                pos[band], lo[band], hi[band], color=color, alpha=0.18, lw=0, gid=f"band-{row['circuit']}"
            )
            shown = ok & (tested > 0)
            ax_n.plot(
                pos[shown],
                tested[shown],
                marker=marker,
                ms=2.5,
                lw=0.8,
                color=color,
                gid=f"tested-{row['circuit']}",
            )
            counted = True
        ax.set_ylim(0, 1.02)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("accepted / tested\nat position $i$")
        ax.set_title(f"{wrap_title(setting.title())}\n{_rep_caption(part)}"
                     + ("; bands: 95 % Wilson" if counted else ""), pad=3)  # fmt: skip
        ax.legend(loc="best", frameon=True, framealpha=0.85, edgecolor="none", labelspacing=0.3)
        ax_n.set_xlabel("window position $i$")
        if counted:
            ax_n.set_yscale("log")
            ax_n.set_ylabel("drafts\ntested")
        else:
            ax_n.text(0.5, 0.5, "tested counts: no accepted-length histograms logged", transform=ax_n.transAxes,
                      ha="center", va="center", fontsize=5.5, color="#666666")  # fmt: skip
            ax_n.set_yticks([])
    return fig


def accepted_length_figure(
    setting: Setting,
    part: pd.DataFrame,
    hists: dict[str, np.ndarray],
    top: int = 4,
    width: float = COLUMN_WIDTH_IN,
) -> Figure | None:
    """Distribution of accepted drafted bytes per cycle (counts pooled over the prompt sets of a
    configuration, normalised) of the `representatives`, on [0, n - 1] (a cycle drafts n - 1 bytes);
    None without histogram artifacts."""
    series = []
    for row, color, marker in representatives(part, top):
        total = _pooled(row, hists)
        if total is None:
            continue
        total = total[
            : int(row["window"])
        ]  # s drafts accepted, 0 <= s <= n - 1 (the evaluator's n + 1-long counts end in a 0)
        if total.sum() > 0:
            series.append((row, color, marker, total / total.sum()))
    if not series:
        return None
    n_len = max(int(row["window"]) for row, *_ in series)
    with paper_style():
        fig, ax = plt.subplots(figsize=(width, HEIGHT_IN), layout="constrained")
        for row, color, marker, freq in series:
            ax.plot(np.arange(len(freq)), freq, marker=marker, ms=2.5, lw=0.8, color=color,
                    label=_config_label(row, ("window", "rank", "lora_depth")), gid=f"circuit-{row['circuit']}")  # fmt: skip
        ax.set_xlim(-0.5, n_len - 0.5)
        ax.set_ylim(bottom=0)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("accepted drafted bytes per cycle")
        ax.set_ylabel("fraction of cycles")
        ax.set_title(f"{wrap_title(setting.title())}\n{_rep_caption(part)}", pad=3)
        ax.legend(loc="upper right", frameon=True, framealpha=0.85, edgecolor="none", labelspacing=0.3)
    return fig
