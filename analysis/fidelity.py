"""`python -m analysis.fidelity`: the fidelity study's hypotheses and findings, decided from MLflow.

    python -m analysis.fidelity --experiment mtpc-fidelity [--tracking-uri URI] [--out fidelity_results.md]

Reads every finished evaluation child run of the experiment (reported and development prompt sets)
and their per-prompt records (`per_prompt.json`), then, with the rule of analysis/bootstrap.py
(paired bootstrap over prompts, 95 % interval excluding 1.0, two training seeds):

- H1: sampling (T = 1, EOS banned) mu_acc of the distilled head >= 1.05x the cross-entropy head
  at equal steps, for every circuit at n = 8 (k = 0). beta is chosen on the development sets
  (the candidate kl_beta > 0 with the highest pooled dev mu_acc over all circuits) and is the same
  for every circuit. Reproduced iff reproduced for every circuit.
- H2: at n = 16 (k = 0), sampling T = 1: the best of cp / hmm / btree (chosen on the development
  sets) >= 1.25x ff in mu_acc; heads trained with `--h2-kl-beta` (default 0: cross-entropy).
- Findings: (a) cp mu_acc grows with r (largest r over smallest: interval > 1) and tails off (the
  last doubling's interval includes 1, or its ratio is below the first step's); (b) at n = 16
  btree and hmm each accept more than cp and ff (all four intervals > 1); (c) mu_lat of hmm above
  every other circuit at n = 16 and btree's throughput the highest (intervals on per-prompt
  seconds per cycle and bytes per second); (d) for ff and btree at n = 16, the best k in > 0
  accepts more than k = 0 (interval > 1), "optimum at small k" only if the best k is not the
  largest k measured (else "not measurable here": the grid stops at that k).
- Undertrained heads (child param converged = 0) are listed; their figures are flagged.

Selections (beta, the best head) read development sets only; every reported figure and decision
reads the reported sets only. Writes Markdown (stdout or --out). Leaves out: figures (`python -m analysis`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from analysis.bootstrap import NOT_DECIDED, PairedSample, decide, paired_bootstrap  # noqa: E402
from mtpc.names import CIRCUIT_KINDS
from tracking.schema import DEV_SET_PREFIX, PER_PROMPT_ARTIFACT

#: per-prompt (numerator, denominator) of each ratio-of-pooled-means metric
PARTS = {
    "mu_acc": ("accepted", "cycles"),
    "mu_lat": ("decode_s", "cycles"),
    "throughput": ("decode_generated", "decode_s"),
}
H1_THRESHOLD, H2_THRESHOLD = 1.05, 1.25
#: metrics read from per-prompt decode times: an offline run has them for its timed subset only
TIMED_METRICS = ("mu_lat", "throughput")
#: `load_per_prompt` key suffix of an offline run's timed-subset records (`latency_per_prompt`)
LATENCY_KEY = "/latency"


@dataclass(frozen=True)
class Slice:
    """What one comparison holds fixed: decoding mode, temperature (sampling only), EOS treatment."""

    mode: str = "sample"
    temperature: float | None = 1.0
    eos: str = "banned"


#: selections (beta, the best head, the best k) always read the development sets in this slice, so a
#: reading at another temperature (`--temperature`) compares the same heads the T = 1 study chose
SELECT = Slice()


def is_dev(prompt_set: Any) -> bool:
    return str(prompt_set).startswith(DEV_SET_PREFIX)


def select(df: pd.DataFrame, sl: Slice, dev: bool, **config: Any) -> pd.DataFrame:
    """Child runs of one configuration (any keys of the runs frame) in a slice, dev or reported sets."""
    keep = (df["mode"] == sl.mode) & (df["eos"].fillna("banned") == sl.eos)
    if sl.mode == "sample" and sl.temperature is not None:
        keep &= np.isclose(df["temperature"].astype(float), sl.temperature)
    keep &= df["prompt_set"].map(is_dev) == dev
    for k, v in config.items():
        col = df[k]
        keep &= np.isclose(col.astype(float), float(v)) if isinstance(v, float) else (col == v)
    return df[keep.to_numpy(dtype=bool)]


def _records(
    runs: pd.DataFrame, per_prompt: dict[str, list[dict]], metric: str = "mu_acc"
) -> dict[tuple[int, str, int], dict]:
    """(train_seed, prompt_set, prompt) -> record, over the given runs. The timed metrics (mu_lat,
    throughput) of an offline run read its timed subset's records (`<run id>/latency`)."""
    out = {}
    for rid, seed in zip(runs["run_id"], runs["train_seed"].fillna(0).astype(int), strict=True):
        key = (
            f"{rid}{LATENCY_KEY}" if metric in TIMED_METRICS and f"{rid}{LATENCY_KEY}" in per_prompt else rid
        )
        for rec in per_prompt.get(key, []):
            out[(seed, str(rec["prompt_set"]), int(rec["prompt"]))] = rec
    return out


def paired(
    df: pd.DataFrame,
    per_prompt: dict[str, list[dict]],
    a: dict,
    b: dict,
    sl: Slice,
    metric: str = "mu_acc",
    dev: bool = False,
) -> list[PairedSample]:
    """One PairedSample per training seed that both configurations have, over the prompts both saw."""
    ra, rb = (
        _records(select(df, sl, dev, **a), per_prompt, metric),
        _records(select(df, sl, dev, **b), per_prompt, metric),
    )
    num, den = PARTS[metric]
    out = []
    for seed in sorted({k[0] for k in ra} & {k[0] for k in rb}):
        keys = sorted(k for k in ra if k[0] == seed and k in rb)
        if not keys:
            continue
        for k in keys:
            if ra[k]["prompt_sha"] != rb[k]["prompt_sha"]:
                raise ValueError(
                    f"prompt {k[1:]} differs between {a} and {b} (prompt_sha): not a paired comparison"
                )
        out.append(
            PairedSample(
                *(
                    np.array([recs[k][f] for k in keys], dtype=float)
                    for recs, f in ((ra, num), (ra, den), (rb, num), (rb, den))
                )
            )
        )
    return out


def pooled(
    df: pd.DataFrame,
    per_prompt: dict[str, list[dict]],
    config: dict,
    sl: Slice,
    metric: str = "mu_acc",
    dev: bool = True,
) -> float:
    """The ratio of pooled per-prompt sums of one configuration (all seeds) — for selections on dev sets."""
    recs = list(_records(select(df, sl, dev, **config), per_prompt, metric).values())
    num, den = PARTS[metric]
    d = sum(r[den] for r in recs)
    return sum(r[num] for r in recs) / d if d else math.nan


def _configs(df: pd.DataFrame, **fixed: Any) -> list[dict]:
    sub = df
    for k, v in fixed.items():
        sub = sub[np.isclose(sub[k].astype(float), v)] if isinstance(v, float) else sub[sub[k] == v]
    keys = ["circuit", "window", "rank", "lora_depth", "kl_beta"]
    plain = lambda v: v.item() if hasattr(v, "item") else v  # noqa: E731  (numpy scalars print as np.int64(..))
    return [
        {k: plain(v) for k, v in zip(keys, t, strict=True)}
        for t in sub[keys].drop_duplicates().itertuples(index=False)
    ]


def _cfg(c: dict) -> dict:
    return {k: (float(v) if k == "kl_beta" else v) for k, v in c.items()}


def _label(c: dict) -> str:
    return f"{c['circuit']} n={c['window']} r={c['rank']} k={c['lora_depth']} β={c['kl_beta']:g}"


def _row(name: str, dec, note: str = "") -> str:
    r = dec.result
    seeds = ", ".join(f"{x:.3f}" for x in r.per_seed)
    return (
        f"| {name} | {r.ratio:.3f} | [{r.low:.3f}, {r.high:.3f}] | {seeds} | {r.prompts} | ≥ {dec.threshold:g} | "
        f"**{dec.verdict}** | {dec.reason}{'; ' + note if note else ''} |"
    )


HEADER = "| comparison | ratio | 95 % interval | per seed | prompts/seed | threshold | verdict | reason |\n|:--|--:|--:|--:|--:|--:|:--|:--|"


def _compare(df, pp, a, b, sl, threshold, name, metric="mu_acc", resamples=10_000) -> tuple[str, Any]:
    samples = paired(df, pp, _cfg(a), _cfg(b), sl, metric)
    if not samples:
        return (
            f"| {name} | – | – | – | 0 | ≥ {threshold:g} | **{NOT_DECIDED}** | no paired runs on the reported sets |",
            None,
        )
    dec = decide(name, paired_bootstrap(samples, resamples=resamples), threshold)
    return _row(name, dec), dec


def h1(df, pp, resamples=10_000, sl: Slice = SELECT) -> tuple[list[str], str]:
    n8 = df[(df["window"] == 8) & (df["lora_depth"] == 0)]
    betas = sorted({b for b in n8["kl_beta"].dropna() if b > 0})
    if not betas:
        return ["no distilled heads (kl_beta > 0) at n = 8"], NOT_DECIDED

    def dev_score(beta):
        return np.nanmean([pooled(df, pp, _cfg(c), SELECT) for c in _configs(n8, kl_beta=beta)])

    has_dev = bool(n8["prompt_set"].map(is_dev).any())
    if not has_dev and len(betas) > 1:
        return [f"kl_beta candidates {betas} but no development sets to choose among them"], NOT_DECIDED
    if len(betas) == 1:
        beta = betas[0]
        chosen = (
            f"beta = {beta:g}: the only candidate, fixed in advance (nothing chosen on the development sets)"
        )
    else:  # several candidates: has_dev holds here
        scores = {b: dev_score(b) for b in betas}
        beta = max(betas, key=scores.__getitem__)
        chosen = (
            f"beta chosen on the development sets: {beta:g} (pooled dev mu_acc "
            + ", ".join(f"β={b:g}: {v:.3f}" for b, v in scores.items())
            + ")"
        )
    lines = [chosen, "", HEADER]
    verdicts = []
    for circ in (
        CIRCUIT_KINDS
    ):  # "every circuit": a circuit without both heads leaves H1 undecided, unless another fails
        # twins: the CE head of the same rank (a CE rank sweep at n = 8 must not stand in for it)
        pairs = [
            (kl, ce)
            for kl in _configs(n8, circuit=circ, kl_beta=beta)
            for ce in _configs(n8, circuit=circ, rank=kl["rank"], kl_beta=0.0)
        ]
        if not pairs:
            lines.append(
                f"| {circ}: KL vs CE | – | – | – | 0 | ≥ {H1_THRESHOLD} | **{NOT_DECIDED}** | missing CE or KL head |"
            )
            verdicts.append(NOT_DECIDED)
            continue
        for kl, ce in pairs:
            rank = f" r={kl['rank']}" if circ != "ff" else ""
            row, dec = _compare(
                df, pp, kl, ce, sl, H1_THRESHOLD, f"{circ} n=8{rank}: β={beta:g} vs CE", resamples=resamples
            )
            lines.append(row)
            verdicts.append(dec.verdict if dec else NOT_DECIDED)
    # "every circuit": one circuit decided against it refutes H1 whatever the missing ones would show
    overall = (
        "reproduced"
        if all(v == "reproduced" for v in verdicts)
        else "not reproduced"
        if any(v == "not reproduced" for v in verdicts)
        else NOT_DECIDED
    )
    return lines, overall


def h2(df, pp, kl_beta=0.0, resamples=10_000, sl: Slice = SELECT) -> tuple[list[str], str]:
    n16 = df[
        (df["window"] == 16) & (df["lora_depth"] == 0) & np.isclose(df["kl_beta"].astype(float), kl_beta)
    ]
    ff = _configs(n16, circuit="ff")
    rivals = [c for c in _configs(n16) if c["circuit"] in ("cp", "hmm", "btree")]
    if not ff or not rivals:
        return ["needs ff and at least one of cp/hmm/btree at n = 16, k = 0"], NOT_DECIDED
    if len(rivals) > 1 and not n16["prompt_set"].map(is_dev).any():
        return ["several of cp/hmm/btree but no development sets to choose the best"], NOT_DECIDED
    scores = {_label(c): pooled(df, pp, _cfg(c), SELECT) for c in rivals}
    best = max(rivals, key=lambda c: scores[_label(c)])
    lines = [
        f"best of cp/hmm/btree on the development sets: {_label(best)} (pooled dev mu_acc "
        + ", ".join(f"{k}: {v:.3f}" for k, v in scores.items())
        + ")",
        "",
        HEADER,
    ]
    row, dec = _compare(
        df, pp, best, ff[0], sl, H2_THRESHOLD, f"n=16: {best['circuit']} vs ff", resamples=resamples
    )
    lines.append(row)
    return lines, dec.verdict if dec else NOT_DECIDED


def findings(df, pp, resamples=10_000, sl: Slice = SELECT) -> list[str]:
    out = ["### (a) cp acceptance grows with r and tails off (n = 8, k = 0, CE)", "", HEADER]
    cps = sorted(
        _configs(df[(df["window"] == 8) & (df["lora_depth"] == 0)], circuit="cp", kl_beta=0.0),
        key=lambda c: c["rank"],
    )
    if len(cps) >= 3:
        row, grow = _compare(
            df,
            pp,
            cps[-1],
            cps[0],
            sl,
            1.0,
            f"cp r={cps[-1]['rank']} vs r={cps[0]['rank']}",
            resamples=resamples,
        )
        out.append(row)
        row1, first = _compare(
            df,
            pp,
            cps[1],
            cps[0],
            sl,
            1.0,
            f"cp r={cps[1]['rank']} vs r={cps[0]['rank']}",
            resamples=resamples,
        )
        row2, last = _compare(
            df,
            pp,
            cps[-1],
            cps[-2],
            sl,
            1.0,
            f"cp r={cps[-1]['rank']} vs r={cps[-2]['rank']}",
            resamples=resamples,
        )
        out += [row1, row2, ""]
        if grow and first and last:
            tails = last.result.low <= 1.0 or last.result.ratio < first.result.ratio
            out.append(
                f"verdict (a): **{'reproduced' if grow.verdict == 'reproduced' and tails else 'not reproduced'}** "
                f"(grows: {grow.verdict}; tails off: {tails})"
            )
    else:
        out.append(f"verdict (a): **{NOT_DECIDED}** (needs cp at >= 3 ranks, found {len(cps)})")
    out += ["", "### (b) at n = 16 btree and hmm accept more than cp and ff", "", HEADER]
    n16 = df[(df["window"] == 16) & (df["lora_depth"] == 0)]
    by = {c["circuit"]: c for c in _configs(n16, kl_beta=0.0)}
    verdicts = []
    for a in ("btree", "hmm"):
        for b in ("cp", "ff"):
            if a in by and b in by:
                row, dec = _compare(df, pp, by[a], by[b], sl, 1.0, f"{a} vs {b}", resamples=resamples)
                out.append(row)
                verdicts.append(dec.verdict if dec else NOT_DECIDED)
    out.append("")
    out.append(
        f"verdict (b): **{'reproduced' if verdicts and all(v == 'reproduced' for v in verdicts) else NOT_DECIDED if not verdicts else 'not reproduced'}**"
    )
    out += [
        "",
        "### (c) hmm has the highest latency, btree the best throughput (n = 16, per-prompt timings)",
        "",
        HEADER,
    ]
    verdicts = []
    for b in ("ff", "cp", "btree"):
        if "hmm" in by and b in by:
            row, dec = _compare(
                df, pp, by["hmm"], by[b], sl, 1.0, f"mu_lat hmm vs {b}", metric="mu_lat", resamples=resamples
            )
            out.append(row)
            verdicts.append(dec.verdict if dec else NOT_DECIDED)
    for b in ("ff", "cp", "hmm"):
        if "btree" in by and b in by:
            row, dec = _compare(
                df,
                pp,
                by["btree"],
                by[b],
                sl,
                1.0,
                f"throughput btree vs {b}",
                metric="throughput",
                resamples=resamples,
            )
            out.append(row)
            verdicts.append(dec.verdict if dec else NOT_DECIDED)
    out += [
        "",
        f"verdict (c): **{'reproduced' if verdicts and all(v == 'reproduced' for v in verdicts) else NOT_DECIDED if not verdicts else 'not reproduced'}**"
        " (CPU timings: the head-to-backbone cost ratio differs from the paper's GPU setting)",
    ]
    out += ["", "### (d) LoRA depth raises acceptance with an optimum at small k (n = 16)", "", HEADER]
    for circ in ("ff", "btree"):
        ks = sorted(
            _configs(df[df["window"] == 16], circuit=circ, kl_beta=0.0), key=lambda c: c["lora_depth"]
        )
        if len(ks) < 2 or ks[0]["lora_depth"] != 0:
            out.append(
                f"| {circ}: k > 0 vs k = 0 | – | – | – | 0 | > 1 | **{NOT_DECIDED}** | needs k = 0 and k > 0 |"
            )
            continue
        best = max(ks[1:], key=lambda c: pooled(df, pp, _cfg(c), SELECT))  # chosen on dev
        row, dec = _compare(
            df,
            pp,
            best,
            ks[0],
            sl,
            1.0,
            f"{circ}: k={best['lora_depth']} (best on dev) vs k=0",
            resamples=resamples,
        )
        if dec is None or dec.verdict != "reproduced":
            small = "– (no gain from k > 0 to place an optimum)"
        elif best["lora_depth"] == ks[-1]["lora_depth"]:
            small = "not measurable here (best k is the largest measured)"
        else:
            small = "yes"
        out.append(row)
        out.append(
            f"| {circ}: optimum at small k | | | | | | {small} | ks measured: {[c['lora_depth'] for c in ks]} |"
        )
    return out


def undertrained(df: pd.DataFrame) -> list[str]:
    if "converged" not in df.columns:
        return ["(no `converged` param logged: the stopping rule was not checked)"]
    bad = df[df["converged"] == 0]
    keys = ["circuit", "window", "rank", "lora_depth", "kl_beta", "train_seed"]
    rows = bad[keys].drop_duplicates().sort_values(keys)
    if rows.empty:
        return ["every head met the stopping rule (held-out window NLL changed < 1 % over the last fifth)"]
    return ["undertrained (stopping rule not met), their figures are marked so:"] + [
        "- " + " ".join(f"{k}={v}" for k, v in zip(keys, r, strict=True))
        for r in rows.itertuples(index=False)
    ]


TRAINING_COLUMNS = ("val_window_nll", "val_window_kl", "val_nll_1", "val_kl_1", "val_stp_nll")


def trial_frame(client, experiment_ids: list[str]) -> pd.DataFrame:
    """One row per finished trial (parent) run: its grid point and final held-out training metrics."""
    import tracking

    rows = []
    for r in tracking.iter_runs(client, experiment_ids, "attributes.status = 'FINISHED'"):
        if "mtpc.grid_key" not in r.data.tags or "val_window_nll" not in r.data.metrics:
            continue
        p, m = r.data.params, r.data.metrics
        window = int(p["window"])
        row = {
            "circuit": p["circuit"],
            "window": window,
            "rank": int(p["rank"]),
            "lora_depth": int(p["lora_depth"]),
            "kl_beta": float(p.get("kl_beta", 0.0)),
            "train_seed": int(p.get("train_seed", 0)),
            "val_nll_n": m.get(f"val_nll_{window}", math.nan),
            "val_kl_n": m.get(f"val_kl_{window}", math.nan),
        }
        row.update({k: m.get(k, math.nan) for k in TRAINING_COLUMNS})
        rows.append(row)
    return pd.DataFrame(rows)


def training_table(trials: pd.DataFrame) -> list[str]:
    """Held-out per-position NLL and KL(p || q) to the verifier (nats) per configuration, mean ± std over
    training seeds: the window NLL the heads were trained to lower, and the KL that decides acceptance."""
    if trials.empty:
        return ["(no finished trial runs with held-out training metrics)"]
    cols = ["val_window_nll", "val_nll_1", "val_nll_n", "val_window_kl", "val_kl_1", "val_kl_n"]
    keys = ["window", "circuit", "rank", "lora_depth", "kl_beta"]
    out = [
        "held-out validation at the end of training, in nats (mean ± std over seeds): `val_window_*` summed "
        "over the n window positions, `_1` and `_n` the first and last position alone; the frozen backbone's "
        f"own next-byte NLL on the same windows (STP): {trials['val_stp_nll'].mean():.3f}",
        "",
        "| n | circuit | r | k | β | seeds | " + " | ".join(cols) + " |",
        "|--:|:--|--:|--:|--:|--:|" + "--:|" * len(cols),
    ]
    order = {c: i for i, c in enumerate(CIRCUIT_KINDS)}
    groups = sorted(
        trials.groupby(keys), key=lambda g: (g[0][0], order.get(g[0][1], 9), g[0][2], g[0][3], g[0][4])
    )
    for (n, circ, r, k, b), g in groups:
        cells = [
            f"{g[c].mean():.3f} ± {g[c].std(ddof=1):.3f}" if len(g) > 1 else f"{g[c].mean():.3f}"
            for c in cols
        ]
        out.append(f"| {n} | {circ} | {r} | {k} | {b:g} | {len(g)} | " + " | ".join(cells) + " |")
    return out


def report(
    df: pd.DataFrame,
    pp: dict[str, list[dict]],
    h2_kl_beta: float = 0.0,
    resamples: int = 10_000,
    trials: pd.DataFrame | None = None,
    temperature: float = 1.0,
) -> str:
    methods = (
        sorted(set(df["acceptance_method"].fillna("online"))) if "acceptance_method" in df else ["online"]
    )
    if len(methods) > 1:
        raise ValueError(
            f"the experiment holds evaluation runs of both acceptance methods {methods}: the decisions "
            "compare one; evaluate every head with one method (eval.acceptance), or read a store that holds one"
        )
    sl = Slice(temperature=temperature)
    l1, v1 = h1(df, pp, resamples, sl)
    l2, v2 = h2(df, pp, h2_kl_beta, resamples, sl)
    title = "# Fidelity study: decisions" + (
        ""
        if sl == SELECT
        else f" read at sampling T = {temperature:g} (selections on the T = 1 development sets)"
    )
    parts = [
        title,
        "",
        f"{len(df)} evaluation runs ({int(df['prompt_set'].map(is_dev).sum())} on development sets).",
        "",
        f"## H1: distillation >= {H1_THRESHOLD}x CE (sampling mu_acc, n = 8, every circuit): **{v1}**",
        "",
        *l1,
        "",
        f"## H2: best of cp/hmm/btree >= {H2_THRESHOLD}x ff (sampling mu_acc, n = 16): **{v2}**",
        "",
        *l2,
        "",
        "## Findings",
        "",
        *findings(df, pp, resamples, sl),
        "",
        "## Training",
        "",
        *undertrained(df),
        "",
        *(training_table(trials) + [""] if trials is not None else []),
    ]
    return "\n".join(parts)


def load_per_prompt(client, run_ids: list[str]) -> dict[str, list[dict]]:
    """The per-prompt records of each run that has the artifact (one progress bar, not MLflow's per file)."""
    import os

    from tqdm import tqdm

    out = {}
    key = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
    old = os.environ.get(key)
    os.environ[key] = "false"
    try:
        with tempfile.TemporaryDirectory() as tmp:
            bar = tqdm(
                run_ids,
                desc="per-prompt records",
                unit="run",
                leave=False,
                file=sys.stderr,
                disable=len(run_ids) < 50 or not sys.stderr.isatty(),
            )
            for i, rid in enumerate(bar):
                if PER_PROMPT_ARTIFACT not in {f.path for f in client.list_artifacts(rid)}:
                    continue
                d = Path(tmp) / str(i)
                d.mkdir()
                path = client.download_artifacts(rid, PER_PROMPT_ARTIFACT, str(d))
                data = json.loads(Path(path).read_text())
                out[rid] = data["per_prompt"]
                if data.get("latency_per_prompt"):  # offline: the timed subset's online records
                    out[f"{rid}{LATENCY_KEY}"] = data["latency_per_prompt"]
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old
    return out


def main(argv: list[str] | None = None) -> int:
    import tracking
    from analysis.filters import Filters
    from analysis.load import AnalysisError, load, resolve_experiment

    p = argparse.ArgumentParser(prog="python -m analysis.fidelity", description=__doc__.split("\n\n")[0])
    p.add_argument("--tracking-uri")
    p.add_argument("--experiment", default="mtpc-fidelity")
    p.add_argument("--out", type=Path, default=None, help="Markdown file (default: stdout)")
    p.add_argument(
        "--h2-kl-beta", type=float, default=0.0, help="training of the heads compared in H2 (0: CE)"
    )
    p.add_argument("--resamples", type=int, default=10_000)
    p.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="read the comparisons at this sampling temperature (the hypotheses are stated at 1; "
        "selections always read the T = 1 development sets)",
    )
    args = p.parse_args(argv)
    try:
        result, client, _ = load(args.tracking_uri, args.experiment, Filters(prompt_sets="all"))
        df = result.runs
        sample = df[df["mode"] == "sample"]
        ids = [e.experiment_id for e in resolve_experiment(client, args.experiment)]
        text = report(
            df,
            load_per_prompt(client, list(sample["run_id"])),
            args.h2_kl_beta,
            args.resamples,
            trials=trial_frame(client, ids),
            temperature=args.temperature,
        )
    except (AnalysisError, tracking.TrackingError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.out:
        args.out.write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
