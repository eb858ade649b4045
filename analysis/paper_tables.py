"""Paper-style tables of one setting: rows (n, r, circuit [, k] [, β] [, seed]), columns mu_lat,
mu_acc, throughput, two speed-ups over STP and degenerate_fraction, each mean ± std over prompt
sets, the best value of each column in bold (not the degeneracy: it describes the text, not the
head); rendered as Markdown and LaTeX, with a warning line when acceptance comes from degenerate
text (degenerate_fraction > 0.25). Also the one-line "best configuration" summary.

Values come from `aggregate.aggregate` (logged metrics averaged; throughput and `speedup_vs_stp`
are the logged ones, never recomputed). An STP row comes first when ``stp_mu_lat`` was logged
(never bolded): the setting's STP runs, each measured beside one head in the same process, pooled
(`aggregate.stp_baseline`). Each trial measures its own STP, and on a shared machine those differ,
so the table shows both ratios and says which is which:

- `× own STP`: each evaluation's throughput / the STP run measured beside it (the logged
  `speedup_vs_stp`), averaged: the fair comparison when the machine's speed drifts between trials;
- `× STP row`: the configuration's mean throughput / the STP row's throughput: what a reader
  gets by dividing the table's own columns, so the STP row and this column always agree.
No plotting here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from analysis.aggregate import Setting, stp_baseline
from tracking import axes
from tracking.schema import DEGENERATE_WARN_FRACTION


@dataclass(frozen=True)
class Column:
    """One numeric column of the table."""

    metric: str  # aggregate column stem: "<metric>_mean" / "<metric>_std"
    header_md: str
    header_tex: str
    best: str  # "min" or "max"
    scale: float = 1.0  # display unit = logged value * scale
    highlight: bool = True  # bold the best value


#: the derived column: mean throughput / the STP row's throughput (not a logged metric)
STP_ROW_RATIO = "speedup_vs_stp_row"
COLUMNS: tuple[Column, ...] = (
    Column("mu_lat", "μ_lat (ms) ↓", r"$\mu_\mathrm{lat}$ (ms) $\downarrow$", "min", 1000.0),
    Column("mu_acc", "μ_acc (B) ↑", r"$\mu_\mathrm{acc}$ (B) $\uparrow$", "max"),
    Column("throughput", "throughput (B/s) ↑", r"throughput (B/s) $\uparrow$", "max"),
    Column("speedup_vs_stp", "× own STP ↑", r"$\times$ own STP $\uparrow$", "max"),
    Column(STP_ROW_RATIO, "× STP row ↑", r"$\times$ STP row $\uparrow$", "max"),
    Column("degenerate_fraction", "degenerate", "degenerate", "min", highlight=False),
)
NOTE = (
    "× own STP: each evaluation's throughput over the STP run measured beside it, averaged; "
    "× STP row: mean throughput over the STP row's"
)
NOTE_TEX = NOTE.replace("× ", r"$\times$ ")


def train_keys() -> tuple[tuple[str, str], ...]:
    """Training axes shown as key columns when they vary within a setting: (aggregate column, header
    = the axis's label in `tracking.axes`)."""
    return tuple((a.name, a.label) for a in axes.axes(axes.TRAINING))


#: the shipped table's (for reading; build_table calls train_keys)
TRAIN_KEYS: tuple[tuple[str, str], ...] = train_keys()


@dataclass
class Table:
    """A rendered-ready table: key columns, numeric (mean, std) per column in display units,
    and which cells are best."""

    setting: Setting
    keys: list[str]  # e.g. ["n", "r", "circuit"] (+ "k")
    rows: pd.DataFrame  # key columns + "<metric>" / "<metric>_std" in display units + "is_stp"
    best: dict[str, float]  # metric -> best mean (display units) among non-STP rows
    decimals: dict[str, int]


def _decimals(values: np.ndarray) -> int:
    """Decimals that give about three significant digits to the column's largest value."""
    v = np.abs(values[np.isfinite(values)])
    if len(v) == 0 or v.max() == 0:
        return 2
    return int(min(4, max(0, 2 - math.floor(math.log10(v.max())))))


def build_table(setting: Setting, part: pd.DataFrame) -> Table:
    """The table of one setting from its aggregated rows (output of `split_settings`)."""
    show_k = part["lora_depth"].nunique(dropna=False) > 1
    shown = [
        (col, head)
        for col, head in train_keys()
        if col in part.columns and part[col].nunique(dropna=False) > 1
    ]
    keys = ["n", "r", "circuit"] + (["k"] if show_k else []) + [head for _, head in shown]
    rows = pd.DataFrame(
        {
            "n": part["window"].astype(object),
            "r": part["rank"].astype(object),
            "circuit": part["circuit"].astype(object),
        }
    )
    if show_k:
        rows["k"] = part["lora_depth"].astype(object)
    for col, head in shown:
        rows[head] = part[col].astype(object)
    stp = stp_baseline(part)
    for col in COLUMNS:
        if col.metric == STP_ROW_RATIO:
            continue
        mean = part.get(f"{col.metric}_mean", pd.Series(np.nan, index=part.index)).to_numpy(dtype=float)
        std = part.get(f"{col.metric}_std", pd.Series(np.nan, index=part.index)).to_numpy(dtype=float)
        rows[col.metric] = mean * col.scale
        rows[f"{col.metric}_std"] = std * col.scale
    stp_thr = stp[2] if stp is not None else np.nan
    rows[STP_ROW_RATIO] = rows["throughput"] / stp_thr
    rows[f"{STP_ROW_RATIO}_std"] = rows["throughput_std"] / stp_thr  # the configuration's spread only
    rows["is_stp"] = False
    rows = rows.reset_index(drop=True)
    best = {}
    for col in COLUMNS:
        if not col.highlight:
            continue
        v = rows[col.metric].to_numpy(dtype=float)
        if np.isfinite(v).any():
            best[col.metric] = float(np.nanmin(v) if col.best == "min" else np.nanmax(v))
    if stp is not None:
        lat, lat_std, thr, thr_std = stp
        stp_row = {k: "" for k in keys}
        stp_row["circuit"] = "STP"
        stp_row.update(
            mu_lat=lat * 1000.0, mu_lat_std=lat_std * 1000.0, mu_acc=0.0, mu_acc_std=np.nan,
            throughput=thr, throughput_std=thr_std, speedup_vs_stp=1.0, speedup_vs_stp_std=np.nan,
            degenerate_fraction=np.nan, degenerate_fraction_std=np.nan, is_stp=True,
            **{STP_ROW_RATIO: 1.0, f"{STP_ROW_RATIO}_std": np.nan},
        )  # fmt: skip
        rows = pd.concat([pd.DataFrame([stp_row]), rows], ignore_index=True)
    decimals = {c.metric: _decimals(rows[c.metric].to_numpy(dtype=float)) for c in COLUMNS}
    return Table(setting, keys, rows, best, decimals)


def _cell(table: Table, i: int, metric: str, latex: bool) -> str:
    row = table.rows.iloc[i]
    mean, std = float(row[metric]), float(row[f"{metric}_std"])
    if not math.isfinite(mean):
        return "–" if not latex else "--"
    d = table.decimals[metric]
    pm = r" \pm " if latex else " ± "
    text = f"{mean:.{d}f}" + (f"{pm}{std:.{d}f}" if math.isfinite(std) else "")
    bold = not row["is_stp"] and metric in table.best and mean == table.best[metric]
    if latex:
        return f"$\\mathbf{{{text}}}$" if bold else f"${text}$"
    return f"**{text}**" if bold else text


def _key_cell(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)) or v is pd.NA:
        return ""
    return str(v)


def degenerate_rows(table: Table) -> list[str]:
    """Labels (n=.. r=.. circuit ..) of the rows whose mean degenerate_fraction > DEGENERATE_WARN_FRACTION."""
    out = []
    for i in range(len(table.rows)):
        row = table.rows.iloc[i]
        frac = float(row["degenerate_fraction"])
        if not row["is_stp"] and math.isfinite(frac) and frac > DEGENERATE_WARN_FRACTION:
            out.append(" ".join(f"{k}={_key_cell(row[k])}" for k in table.keys))
    return out


def degeneracy_warning(table: Table) -> str | None:
    """One line saying which rows' acceptance was measured on looping text, or None."""
    rows = degenerate_rows(table)
    if not rows:
        return None
    shown = "; ".join(rows[:6]) + (f"; ... {len(rows) - 6} more" if len(rows) > 6 else "")
    return (
        f"warning [{table.setting.title()}]: degenerate_fraction > {DEGENERATE_WARN_FRACTION} in "
        f"{len(rows)} of {int((~table.rows['is_stp']).sum())} row(s) ({shown}): their acceptance is "
        "measured on looping text"
    )


def to_markdown(table: Table) -> str:
    """GitHub Markdown: a title line, the header, one line per configuration (+ the degeneracy warning)."""
    headers = table.keys + [c.header_md for c in COLUMNS]
    warning = degeneracy_warning(table)
    lines = [
        f"**{table.setting.title()}** (mean ± std over prompt sets; {NOTE})",
        *(["", f"> ⚠ {warning}"] if warning else []),
        "",
        "| " + " | ".join(headers) + " |",
        "|" + "|".join(":--" if h in table.keys else "--:" for h in headers) + "|",
    ]
    for i in range(len(table.rows)):
        keys = [_key_cell(table.rows.iloc[i][k]) for k in table.keys]
        cells = [_cell(table, i, c.metric, latex=False) for c in COLUMNS]
        lines.append("| " + " | ".join(keys + cells) + " |")
    return "\n".join(lines) + "\n"


def _tex_escape(text: str) -> str:
    for a, b in (("\\", r"\textbackslash{}"), ("_", r"\_"), ("%", r"\%"), ("&", r"\&"), ("#", r"\#")):
        text = text.replace(a, b)
    return text


def to_latex(table: Table) -> str:
    """A booktabs ``table`` environment (needs \\usepackage{booktabs})."""
    headers = [f"${k}$" if k in ("n", "r", "k") else k for k in table.keys] + [c.header_tex for c in COLUMNS]
    spec = "l" * len(table.keys) + "r" * len(COLUMNS)
    lines = [
        r"\begin{table}[t]",
        r"\centering",
        r"\small",
        rf"\caption{{{_tex_escape(table.setting.title())}: mean $\pm$ std over prompt sets; {NOTE_TEX}."
        + (
            f" {_tex_escape(str(len(degenerate_rows(table))))} row(s) with degenerate fraction $>$ "
            f"{DEGENERATE_WARN_FRACTION}: acceptance measured on looping text."
            if degenerate_rows(table)
            else ""
        )
        + "}",
        rf"\begin{{tabular}}{{{spec}}}",
        r"\toprule",
        " & ".join(headers) + r" \\",
        r"\midrule",
    ]
    for i in range(len(table.rows)):
        keys = [_tex_escape(_key_cell(table.rows.iloc[i][k])) for k in table.keys]
        cells = [_cell(table, i, c.metric, latex=True) for c in COLUMNS]
        lines.append(" & ".join(keys + cells) + r" \\")
        if table.rows.iloc[i]["is_stp"]:
            lines.append(r"\midrule")
    lines += [r"\bottomrule", r"\end{tabular}", r"\end{table}"]
    return "\n".join(lines) + "\n"


#: Heads within this fraction of the best are not ranked against it: on the 2-core CPU two identical
#: demo runs give each head's ratio to its own STP within about ±4 % (docs/results.md, "The demo").
TIE_BAND = 0.05


def config_label(row: pd.Series) -> str:
    return f"{row['circuit']} n={row['window']} r={row['rank']} k={row['lora_depth']}" + "".join(
        f" {a.label}={row[a.name]:g}"
        for a in axes.axes(axes.TRAINING)  # kl_beta, train_seed always; another axis off its default
        if a.name in row.index and pd.notna(row[a.name]) and (a.always or row[a.name] != a.default)
    )


def ranking_column(part: pd.DataFrame) -> str:
    """What "best" ranks by: the ratio to each evaluation's own STP when logged (it cancels the
    machine's speed drift between trials timed at different times: the demo's STP ranged ±10 % within
    one run, the ratios repeated within ±4 %), else the logged throughput."""
    col = "speedup_vs_stp_mean"
    if col in part.columns and np.isfinite(part[col].to_numpy(dtype=float)).any():
        return col
    return "throughput_mean"


def best_configuration(setting: Setting, part: pd.DataFrame, tie_band: float = TIE_BAND) -> str:
    """One line naming the configuration ranked first (`ranking_column`) and the others within
    `tie_band` of it (a timing difference that small is not a ranking)."""
    col = ranking_column(part)
    key = np.nan_to_num(part[col].to_numpy(dtype=float), nan=-np.inf)
    i = int(np.argmax(key))
    row = part.iloc[i]
    std = row["throughput_std"]
    text = f"{row['throughput_mean']:.1f}" + (f" ± {std:.1f}" if math.isfinite(std) else "")
    line = (
        f"best [{setting.title()}]: {config_label(row)}"
        + f" — throughput {text} B/s, mu_acc {row['mu_acc_mean']:.2f}, mu_lat {row['mu_lat_mean'] * 1000:.2f} ms"
    )
    sp = row.get("speedup_vs_stp_mean", float("nan"))
    if sp is not None and math.isfinite(sp):
        line += f", ×{sp:.2f} own STP"
    line += f" ({int(row['n_evals'])} evaluations)"
    close = tied_with_best(part, tie_band)
    if close:
        what = "× own STP" if col == "speedup_vs_stp_mean" else "throughput"
        line += f"; within {tie_band:.0%} of it in {what}, not ranked: " + ", ".join(
            f"{config_label(part.iloc[j])} ({key[j]:.{2 if col == 'speedup_vs_stp_mean' else 1}f})"
            for j in close
        )
    return line


def tied_with_best(part: pd.DataFrame, tie_band: float = TIE_BAND) -> list[int]:
    """Row positions (best first) of the configurations within `tie_band` of the best, the best excluded."""
    key = np.nan_to_num(part[ranking_column(part)].to_numpy(dtype=float), nan=-np.inf)
    i = int(np.argmax(key))
    return [int(j) for j in np.argsort(-key, kind="stable") if j != i and key[j] >= key[i] * (1 - tie_band)]
