"""Do two runs of the same sweep agree? Compare their `summary.csv` (written by `python -m analysis`).

    python -m analysis.repeat runs/demoA/analysis/summary.csv runs/demoB/analysis/summary.csv

Per setting (mode, temperature, ... as `analysis` splits them) and configuration: the ratio to its
own STP in each run (the derived one for offline acceptance, as the tables show it) and the
relative difference, mu_acc in each run; then each run's Pareto front and its winner (ranked by the
ratio to own STP, `analysis.paper_tables.ranking_column`), with the configurations within the tie
band of the winner (`analysis.paper_tables.TIE_BAND`) named as unranked; "tied" when each run's
winner lies within the other's band. Prints markdown and a last line `max |Δ ratio| = …`; exit 0 when the two runs hold the
same settings and configurations, 2 otherwise.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.aggregate import config_keys, split_settings
from analysis.paper_tables import TIE_BAND, config_label, ranking_column, tied_with_best


def _settings(path: Path) -> dict[str, pd.DataFrame]:
    agg = pd.read_csv(path)
    out = {}
    for setting, part in split_settings(agg):
        title = setting.title().replace(f", {setting.hardware}", "") if setting.hardware else setting.title()
        out[title] = part
    return out


def _key(row: pd.Series) -> tuple:
    return tuple(None if pd.isna(row.get(k)) else row.get(k) for k in config_keys() if k in row.index)


def _winners(part: pd.DataFrame, band: float) -> tuple[str, list[str]]:
    key = np.nan_to_num(part[ranking_column(part)].to_numpy(dtype=float), nan=-np.inf)
    best = config_label(part.iloc[int(np.argmax(key))])
    return best, [config_label(part.iloc[j]) for j in tied_with_best(part, band)]


def _same_winner(wa: str, ta: list[str], wb: str, tb: list[str]) -> str:
    if wa == wb:
        return "yes"
    if wb in ta and wa in tb:
        return "tied (each run's winner is within the other's tie band)"
    return "no"


def compare(a: Path, b: Path, band: float = TIE_BAND) -> tuple[str, float]:
    """The markdown report and the largest relative difference of a ratio to own STP."""
    sa, sb = _settings(a), _settings(b)
    if set(sa) != set(sb):
        raise ValueError(f"the runs hold different settings: {sorted(set(sa) ^ set(sb))}")
    lines: list[str] = []
    worst = 0.0
    for title in sa:
        pa, pb = sa[title], sb[title]
        ka = {_key(r): r for _, r in pa.iterrows()}
        kb = {_key(r): r for _, r in pb.iterrows()}
        if set(ka) != set(kb):
            raise ValueError(f"{title}: the runs hold different configurations")
        lines += [
            f"### {title}",
            "",
            "| head | μ_acc A | μ_acc B | × own STP A | × own STP B | Δ | front A | front B |",
            "|---|--:|--:|--:|--:|--:|:-:|:-:|",
        ]
        rank = ranking_column(pa)
        for key in sorted(ka, key=lambda k: -float(ka[k][rank])):
            ra, rb = ka[key], kb[key]
            xa, xb = float(ra["speedup_vs_stp_mean"]), float(rb["speedup_vs_stp_mean"])
            delta = xb / xa - 1
            worst = max(worst, abs(delta))
            lines.append(
                f"| {config_label(ra)} | {ra['mu_acc_mean']:.3f} | {rb['mu_acc_mean']:.3f} | {xa:.2f} | {xb:.2f} "
                f"| {delta:+.1%} | {'x' if ra['on_front'] else ''} | {'x' if rb['on_front'] else ''} |"
            )
        (wa, ta), (wb, tb) = _winners(pa, band), _winners(pb, band)
        same_front = {_key(r) for _, r in pa[pa.on_front].iterrows()} == {
            _key(r) for _, r in pb[pb.on_front].iterrows()
        }
        lines += [
            "",
            f"winner A: {wa}" + (f" (within {band:.0%}, not ranked: {', '.join(ta)})" if ta else ""),
            f"winner B: {wb}" + (f" (within {band:.0%}, not ranked: {', '.join(tb)})" if tb else ""),
            f"same winner: {_same_winner(wa, ta, wb, tb)}; same front: {'yes' if same_front else 'no'}",
            "",
        ]
    lines.append(f"max |Δ ratio| = {worst:.1%}")
    return "\n".join(lines), worst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", type=Path, help="summary.csv of the first run")
    p.add_argument("b", type=Path, help="summary.csv of the second run")
    p.add_argument("--tie-band", type=float, default=TIE_BAND)
    args = p.parse_args(argv)
    for path in (args.a, args.b):
        if not path.is_file():
            print(
                f"analysis.repeat: {path} does not exist (expected a summary.csv from python -m analysis)",
                file=sys.stderr,
            )
            return 2
    try:
        text, _ = compare(args.a, args.b, args.tie_band)
    except ValueError as e:
        print(f"analysis.repeat: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
