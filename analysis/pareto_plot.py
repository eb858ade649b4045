"""The Pareto figure of one setting: accepted bytes per cycle (x) against mean latency per cycle
mu_lat (y, ms), error bars = std over prompt sets, marker/colour by circuit, n/r/k labels placed off
the points, the Pareto front (mu_lat down, mu_acc up) as a line with outlined points, dashed
iso-throughput lines labelled in bytes/s, the STP baseline with its own dotted iso-line, and any
reference heads (`references`: analysis/reference.py, e.g. the demo's shipped default head) as
labelled yellow stars with their error bars.

One throughput: the logged `throughput` (bytes returned / decoding time, mean over prompt sets),
the one the tables and the sweep objective give. A line of throughput T is y = (x + c) / T; a point
sits at x = throughput × mu_lat − c, the accepted bytes per cycle as returned (= mu_acc unless the
generation's last cycle was cut at max_new_tokens), so it lies on the line of its own throughput, and
STP (one byte per cycle) on the line of the STP row's. Every drawn line is labelled (a line whose
label would collide is not drawn); a point label that finds no free place is left out (the front's
points are placed first).

A reference is placed by the same rule as the points (x = its throughput × its mu_lat − c, from the
same evaluation function and aggregation: analysis/reference.py), so it lies on the iso-line of its
own throughput; it is a legend entry of its own (its label, e.g. "shipped btree-n4-r16-known")
with an n/r/k label beside it, takes part in the box's limits and the iso-lines' range, and is
never on the Pareto front.

Artists carry `gid`s ("circuit-<c>", "errorbar-<c>" (error-bar containers: label "_errorbar-<c>"),
"pareto-front", "iso-throughput", "iso-throughput-stp", "iso-label", "stp", "point-label",
"reference" (one scatter per reference, its legend label the reference's), "errorbar-reference")
so tests and users can find them. The other figures live in analysis/plots.py, the look in analysis/style.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from analysis.aggregate import Setting, stp_baseline
from analysis.reference import ReferencePoint
from analysis.style import (
    COLUMN_WIDTH_IN,
    HEIGHT_IN,
    REFERENCE_STYLE,
    circuit_style,
    circuits_in,
    format_rate,
    nan0,
    overlap,
    paper_style,
    plt,
    wrap_title,
)
from tracking import axes
from tracking.schema import DEGENERATE_WARN_FRACTION

#: above this many points only the Pareto-front points get n/r/k labels
MAX_LABELLED_POINTS = 12


def _degenerate_note(part: pd.DataFrame) -> str:
    """' — ⚠ k/N degenerate' when k configurations have degenerate_fraction > 0.25 (acceptance on looping text)."""
    if "degenerate_fraction_mean" not in part.columns:
        return ""
    frac = part["degenerate_fraction_mean"].to_numpy(dtype=float)
    k = int((frac > DEGENERATE_WARN_FRACTION).sum())
    return f" — ⚠ {k}/{len(part)} configs degenerate > {DEGENERATE_WARN_FRACTION:g}" if k else ""


def iso_offset(setting: Setting, part: pd.DataFrame) -> float:
    """c in tokens_per_cycle = mu_acc + c: exactly 1 with extra_token=keep (every cycle emits its
    accepted drafts plus the verifier's token); with drop a partial acceptance loses that token, so
    c is estimated from the data as the mean of tokens_per_cycle - mu_acc."""
    if setting.extra_token == "keep":
        return 1.0
    diff = (part["tokens_per_cycle_mean"] - part["mu_acc_mean"]).to_numpy(dtype=float)
    diff = diff[np.isfinite(diff)]
    return float(diff.mean()) if len(diff) else 1.0


def returned_accepted(throughput: np.ndarray, mu_lat_s: np.ndarray, c: float) -> np.ndarray:
    """Accepted bytes per cycle as returned, throughput × mu_lat − c: where a configuration sits so
    that the iso-line of its logged throughput passes through it."""
    return throughput * mu_lat_s - c


def iso_levels(t_min: float, t_max: float, n: int = 5) -> np.ndarray:
    """Round throughput levels (bytes/s) spanning [t_min, t_max]."""
    if not (t_max > 0):
        return np.zeros(0)
    lo = max(t_min, t_max * 1e-3)
    ticks = MaxNLocator(nbins=n, steps=[1, 2, 2.5, 5, 10]).tick_values(lo, t_max)
    levels = ticks[(ticks > 0) & (ticks >= lo * 0.95) & (ticks <= t_max * 1.05)]
    if len(levels) < 2:  # a narrow range: the two ends rounded to 2 significant digits
        levels = np.unique([float(f"{lo:.2g}"), float(f"{t_max:.2g}")])
    return levels


def pareto_figure(
    setting: Setting,
    part: pd.DataFrame,
    width: float = COLUMN_WIDTH_IN,
    references: Sequence[ReferencePoint] = (),
) -> Figure:
    """mu_acc (x) vs mu_lat in ms (y) for one setting; `part` from `split_settings` (has on_front);
    `references`: heads measured outside the sweep in this very setting (`analysis.reference.points_for`),
    drawn as labelled stars; none: the figure as without them."""
    with paper_style():
        fig, ax = plt.subplots(figsize=(width, HEIGHT_IN), layout="constrained")
        c_iso = iso_offset(setting, part)
        y = part["mu_lat_mean"].to_numpy(dtype=float) * 1000.0
        x = returned_accepted(part["throughput_mean"].to_numpy(dtype=float), y / 1000.0, c_iso)
        xerr = nan0(part["mu_acc_std"].to_numpy(dtype=float))
        yerr = nan0(part["mu_lat_std"].to_numpy(dtype=float)) * 1000.0
        front = part["on_front"].to_numpy(dtype=bool)
        circuits = part["circuit"].to_numpy()
        for c in circuits_in(part):
            m = circuits == c
            color, marker = circuit_style(c)
            eb = ax.errorbar(
                x[m], y[m], xerr=xerr[m], yerr=yerr[m], fmt="none", ecolor=color, elinewidth=0.6,
                capsize=1.2, alpha=0.7, zorder=2, label=f"_errorbar-{c}",  # "_": not in the legend
            )  # fmt: skip
            for artist in eb.lines[2]:
                artist.set_gid(f"errorbar-{c}")
            edge = np.where(front[m], "black", "none").tolist()
            ax.scatter(
                x[m], y[m], s=16, marker=marker, c=color, edgecolors=edge, linewidths=0.7,
                label=c, zorder=4, gid=f"circuit-{c}",
            )  # fmt: skip
        # the front as a line through its points, in order of mu_acc
        order = np.argsort(x[front])
        ax.plot(
            x[front][order],
            y[front][order],
            color="black",
            lw=0.7,
            zorder=3,
            label="Pareto front",
            gid="pareto-front",
        )
        # STP: one byte per cycle, nothing accepted
        stp = stp_baseline(part)
        xs, ys = list(x - xerr), list(y - yerr)
        xs_hi, ys_hi = list(x + xerr), list(y + yerr)
        stp_lat_ms = None
        stp_rate = None
        if stp is not None:
            stp_lat_ms, stp_rate = stp[0] * 1000.0, stp[2]
            stp_x = float(returned_accepted(np.array([stp_rate]), np.array([stp[0]]), 1.0)[0])
            if not np.isfinite(stp_x):  # no STP throughput logged: one byte per cycle
                stp_x, stp_rate = 0.0, 1000.0 / stp_lat_ms
            ax.scatter([stp_x], [stp_lat_ms], marker="*", s=45, c="black", zorder=5, label="STP", gid="stp")
            xs.append(stp_x)
            ys.append(stp_lat_ms)
            ys_hi.append(stp_lat_ms)
            xs_hi.append(stp_x)
        drawn = _draw_references(ax, references, c_iso)  # (x, y ms, x err, y err ms, text, rate) each
        for rx, ry, xe, ye, _, _ in drawn:
            xs.append(rx - xe)
            ys.append(ry - ye)
            xs_hi.append(rx + xe)
            ys_hi.append(ry + ye)
        ref_x, ref_y = [d[0] for d in drawn], [d[1] for d in drawn]
        # limits from the data (points, error bars, STP, references), then iso-lines across the whole box
        x_lo, x_hi = min(xs), max(xs_hi)
        y_lo, y_hi = min(ys), max(ys_hi)
        dx = (x_hi - x_lo) or 1.0
        dy = (y_hi - y_lo) or max(abs(y_hi), 1e-3)
        ax.set_xlim(x_lo - 0.06 * dx, x_hi + 0.12 * dx)
        ax.set_ylim(max(0.0, y_lo - 0.1 * dy), y_hi + 0.1 * dy)
        _draw_iso_lines(ax, setting, part, stp_rate, [d[5] for d in drawn])
        ax.set_xlabel(r"accepted bytes per cycle $\mu_\mathrm{acc}$ (as returned)")
        ax.set_ylabel(r"latency per cycle $\mu_\mathrm{lat}$ (ms)")
        ax.set_title(wrap_title(setting.title() + _degenerate_note(part)), pad=3)
        ax.grid(False)
        labelled = len(x) <= MAX_LABELLED_POINTS
        n_entries = len(ax.get_legend_handles_labels()[1])
        ncol = min(3 if drawn else 4, max(1, n_entries))  # a reference's long label: one column fewer
        leg = ax.legend(
            # below the axes: inside, any corner can hold points of the front (the demo's did)
            loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=ncol,
            frameon=False, handletextpad=0.3, columnspacing=0.8, labelspacing=0.3, markerscale=0.9,
            title="labels: n/r/k" if labelled else "front labels: n/r/k", title_fontsize=5.5,
        )  # fmt: skip
        # n/r/k labels (only the front when crowded), placed to avoid points and each other
        show = np.ones(len(x), bool) if labelled else front
        texts = [point_label(part.iloc[i]) for i in range(len(x))]
        front_lines = [ln for ln in ax.lines if ln.get_gid() == "pareto-front"]
        _drop_overlapping_iso_labels(ax)  # again: the legend below changed the box's size
        iso_texts = [t for t in ax.texts if t.get_gid() == "iso-label"]
        # a reference's n/r/k label is always wanted, and placed with the front's
        n_ref = len(drawn)
        _place_labels(
            ax, np.append(x, ref_x), np.append(y, ref_y), texts + [d[4] for d in drawn],
            np.append(show, np.ones(n_ref, bool)), avoid=[leg, *iso_texts], lines=front_lines,
            first=np.append(front, np.ones(n_ref, bool)),
        )  # fmt: skip
    return fig


def _std(v: float) -> float:
    """A std for an error bar: 0 where it is unknown (one prompt set)."""
    return float(v) if np.isfinite(v) else 0.0


def _draw_references(
    ax, references: Sequence[ReferencePoint], c: float
) -> list[tuple[float, float, float, float, str, float]]:
    """Each reference with a finite mu_lat and throughput as a star with its error bars, placed as the
    points are (x = throughput × mu_lat − c); per drawn one: x, y (ms), x error, y error (ms), its
    n/r/k label and its throughput."""
    color, marker = REFERENCE_STYLE
    drawn = []
    for ref in references:
        if not (np.isfinite([ref.mu_lat, ref.throughput]).all() and ref.mu_lat > 0):
            continue  # nothing to place it by
        rx = float(returned_accepted(np.array([ref.throughput]), np.array([ref.mu_lat]), c)[0])
        ry, xe, ye = ref.mu_lat * 1000.0, _std(ref.mu_acc_std), _std(ref.mu_lat_std) * 1000.0
        eb = ax.errorbar([rx], [ry], xerr=[xe], yerr=[ye], fmt="none", ecolor="black", elinewidth=0.6,
                         capsize=1.2, zorder=4, label="_errorbar-reference")  # fmt: skip
        for artist in eb.lines[2]:
            artist.set_gid("errorbar-reference")
        ax.scatter([rx], [ry], marker=marker, s=80, c=color, edgecolors="black", linewidths=0.6,
                   zorder=6, label=ref.label, gid="reference")  # fmt: skip
        drawn.append((rx, ry, xe, ye, ref.text, float(ref.throughput)))
    return drawn


_LABEL_OFFSETS = (  # (dx, dy) in points, horizontal alignment, vertical alignment
    (3, 1.5, "left", "bottom"), (3, -1.5, "left", "top"), (-3, 1.5, "right", "bottom"),
    (-3, -1.5, "right", "top"), (0, 4, "center", "bottom"), (0, -4, "center", "top"),
    (6, 5, "left", "bottom"), (6, -5, "left", "top"), (-6, 5, "right", "bottom"), (-6, -5, "right", "top"),
)  # fmt: skip


def point_label(row) -> str:
    """n/r/k (r "–" for a method without a rank: EvaByte's own decoding), then each training axis of
    `tracking.axes` off its default as its mark and value, in `AXES` order (`β0.5` for a distilled
    head, `s1` for a training seed > 0: CE and distilled twins, and seeds, would otherwise carry the
    same label); an axis the row lacks (or NaN) is left out."""
    rank = "–" if pd.isna(row["rank"]) else row["rank"]
    text = f"{row['window']}/{rank}/{row['lora_depth']}"
    for a in axes.axes(axes.TRAINING):
        value = row.get(a.name)
        if value is None or pd.isna(value) or a.at_default(value):
            continue
        text += f" {a.mark or a.label}{a.shown(value)}"
    return text


def _place_labels(
    ax, x: np.ndarray, y: np.ndarray, texts: list[str], show: np.ndarray, avoid=(), lines=(), first=None
) -> None:
    """Annotate the points ``show`` with ``texts``, trying a few offsets per label and keeping the
    first that overlaps no marker, no earlier label, nothing in ``avoid`` and no segment of
    ``lines``; a label with no such place is left out. Points in ``first`` are placed first."""
    from matplotlib.transforms import Bbox

    fig = ax.figure
    fig.canvas.draw()  # fix the layout so display coordinates are final
    renderer = fig.canvas.get_renderer()
    pts = ax.transData.transform(np.column_stack([x, y]))  # (N, 2) pixels
    r = 3.5 * fig.dpi / 72.0  # marker half-size in pixels
    obstacles = [Bbox.from_extents(px - r, py - r, px + r, py + r) for px, py in pts]
    obstacles += [a.get_window_extent(renderer) for a in avoid]
    for line in lines:  # points every ~2 px along each segment, as 2 px boxes
        xy = ax.transData.transform(np.column_stack([line.get_xdata(), line.get_ydata()]))  # (M, 2)
        for (ax0, ay0), (ax1, ay1) in zip(xy[:-1], xy[1:], strict=True):
            k = max(2, int(np.hypot(ax1 - ax0, ay1 - ay0) / 2))
            for t in np.linspace(0, 1, k):
                px, py = ax0 + t * (ax1 - ax0), ay0 + t * (ay1 - ay0)
                obstacles.append(Bbox.from_extents(px - 1, py - 1, px + 1, py + 1))
    box = ax.get_window_extent(renderer)
    first = np.zeros(len(x), bool) if first is None else np.asarray(first, bool)
    order = np.flatnonzero(show)
    order = order[np.lexsort((-y[order], ~first[order]))]  # the front first, each group top to bottom
    for i in order:
        ann = ax.annotate(texts[i], (x[i], y[i]), xytext=(0, 0), textcoords="offset points", fontsize=5,
                          color="#333333", zorder=6, gid="point-label", annotation_clip=True)  # fmt: skip
        ann.set_in_layout(False)
        best, best_cost = None, np.inf
        for dx, dy, ha, va in _LABEL_OFFSETS:
            ann.set_position((dx, dy))
            ann.set_ha(ha)
            ann.set_va(va)
            ext = ann.get_window_extent(renderer)
            cost = sum(overlap(ext, o) for o in obstacles)
            if ext.x0 < box.x0 or ext.x1 > box.x1 or ext.y0 < box.y0 or ext.y1 > box.y1:
                cost += 1e6
            if cost < best_cost:
                best, best_cost = (dx, dy, ha, va, ext), cost
            if cost == 0:
                break
        dx, dy, ha, va, ext = best
        if best_cost > 0:  # no free place: a label over another mark helps nobody
            ann.remove()
            continue
        ann.set_position((dx, dy))
        ann.set_ha(ha)
        ann.set_va(va)
        obstacles.append(ext.padded(fig.dpi / 72.0))  # 1 pt of air: survives small layout shifts


def _draw_iso_lines(
    ax, setting: Setting, part: pd.DataFrame, stp_rate: float | None, ref_rates: Sequence[float] = ()
) -> None:
    """Dashed lines of constant throughput through the plot box, labelled where they leave it. In
    (accepted bytes per cycle, mu_lat[ms]) coordinates: y = 1000 (x + c) / T. The levels span the
    points', STP's and the references' throughputs."""
    c = iso_offset(setting, part)
    rates = part["throughput_mean"].to_numpy(dtype=float)  # the logged throughput, as the tables
    if stp_rate is not None:
        rates = np.append(rates, stp_rate)
    rates = np.append(rates, np.asarray(ref_rates, dtype=float))
    rates = rates[np.isfinite(rates) & (rates > 0)]
    if len(rates) == 0:
        return
    (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
    xx = np.linspace(x0, x1, 200)
    levels = [(float(t), False) for t in iso_levels(float(rates.min()), float(rates.max()))]
    exact = c == 1.0  # keep: tokens_per_cycle = mu_acc + 1 exactly; else lines are approximate
    if stp_rate is not None and exact:  # the line through STP: configurations right of it beat STP
        t_stp = stp_rate
        levels = [(t, s) for t, s in levels if abs(t - t_stp) > 0.04 * t_stp] + [(t_stp, True)]
    for t, is_stp in levels:
        yy = 1000.0 * (xx + c) / t
        inside = (yy >= y0) & (yy <= y1)
        if not inside.any():
            continue
        (line,) = ax.plot(xx, yy, ls="--" if not is_stp else ":", lw=0.6 if not is_stp else 0.8,
                          color="#888888" if not is_stp else "black", zorder=1,
                          gid="iso-throughput" if not is_stp else "iso-throughput-stp")  # fmt: skip
        # label where the line leaves the box: right edge, else top edge
        y_right = 1000.0 * (x1 + c) / t
        if y_right <= y1:
            lx, ly, ha, va = x1, y_right, "right", "bottom"
        else:
            lx, ly, ha, va = t * y1 / 1000.0 - c, y1, "right", "top"
        label = ax.text(
            lx, ly, ("" if exact else "≈") + format_rate(t) + (" (STP)" if is_stp else ""), fontsize=5, color="black" if is_stp else "#666666", ha=ha, va=va, zorder=1, gid="iso-label",
            bbox=dict(boxstyle="square,pad=0.1", fc="white", ec="none", alpha=0.8),
        )  # fmt: skip
        label.iso_line = line  # dropped together
    ax.set_xlim(x0, x1)
    ax.set_ylim(y0, y1)
    _drop_overlapping_iso_labels(ax)


def _drop_overlapping_iso_labels(ax) -> None:
    """Keep iso-throughput labels inside the plot box, then drop any that overlap an earlier one
    (the STP label first) together with its line: no line goes unlabelled."""
    labels = [t for t in ax.texts if t.get_gid() == "iso-label"]
    if not labels:
        return
    fig = ax.figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    box = ax.get_window_extent(renderer)
    for t in labels:
        ext = t.get_window_extent(renderer)
        if ext.x0 < box.x0:  # runs off the left edge: hang it to the right of its anchor
            t.set_ha("left")
        elif ext.x1 > box.x1:
            t.set_ha("right")
        over = max(ext.y1 - box.y1, 0.0) - max(
            box.y0 - ext.y0, 0.0
        )  # its box pads past the top (bottom) edge
        if over:
            px, py = ax.transData.transform(t.get_position())
            t.set_position(ax.transData.inverted().transform((px, py - over - np.sign(over))))
    labels.sort(key=lambda t: "(STP)" not in t.get_text())
    kept = []
    for t in labels:
        ext = t.get_window_extent(renderer).padded(4 * fig.dpi / 72.0)  # keep 4 pt between labels
        if any(overlap(ext, k) > 0 for k in kept):
            t.iso_line.remove()
            t.remove()
        else:
            kept.append(ext)
