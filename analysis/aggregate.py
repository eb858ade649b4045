"""Group evaluation runs into settings and configurations, mean ± std over prompt sets.

A *setting* is what a figure or table holds fixed: backbone, mode, extra_token, eos, temperature,
top_p, hardware and acceptance_method (offline: acceptance teacher-forced, mu_lat timed on a
subset; online: every prompt timed through the loop), so the two methods never share a figure,
a table or an average. A *configuration* is a point in it: circuit, window n, rank r, LoRA depth k, and
the training axes kl_beta (0: cross-entropy), kl_temperature and train_seed, so runs trained
differently (CE vs distillation, two seeds) are never averaged together.
Every metric is averaged as logged (the logged ``throughput`` is never recomputed); std is the
sample std (ddof = 1) over the evaluations of a configuration, NaN when there is only one.
Plots and tables live elsewhere.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from analysis.front import pareto_front
from analysis.load import ACC_POS_RE, OPTIONAL_METRICS, REQUIRED_METRICS, axis_names
from mtpc.names import CIRCUIT_KINDS
from tracking import axes

SETTING_KEYS: tuple[str, ...] = (
    "backbone",
    "mode",
    "extra_token",
    "eos",
    "temperature",
    "top_p",
    "hardware",
    "acceptance_method",
)


def config_keys() -> tuple[str, ...]:
    """What makes a configuration: every sweep axis (`tracking.axes`, read now), architecture first."""
    return tuple(axis_names())


#: the shipped table's configuration keys at import (for reading; the functions here call config_keys)
CONFIG_KEYS: tuple[str, ...] = config_keys()


def _is_missing(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v)) or v is pd.NA


@dataclass(frozen=True)
class Setting:
    """The values held fixed by one figure/table (None = not logged)."""

    backbone: str
    mode: str
    extra_token: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    hardware: str | None = None
    eos: str | None = None
    acceptance_method: str | None = None  # None: online (stores from before the param)

    def title(self) -> str:
        parts = [self.backbone, self.mode]
        if self.extra_token is not None:
            parts.append(f"extra={self.extra_token}")
        if self.eos is not None:
            parts.append(f"EOS {self.eos}")
        if self.temperature is not None and self.mode == "sample":
            parts.append(f"T={self.temperature:g}")
        if self.top_p is not None and self.mode == "sample":
            parts.append(f"top-p={self.top_p:g}")
        if self.hardware is not None:
            parts.append(self.hardware)
        if self.acceptance_method == "offline":
            parts.append("offline acceptance, throughput derived (bytes/cycle ÷ mu_lat timed on a subset)")
        return ", ".join(parts)

    def slug(self) -> str:
        """A file-name-safe identifier, unique per setting."""
        parts = [self.backbone, self.mode]
        if self.extra_token is not None:
            parts.append(self.extra_token)
        if self.eos is not None:
            parts.append(f"eos-{self.eos}")
        if self.temperature is not None:
            parts.append(f"T{self.temperature:g}")
        if self.top_p is not None:
            parts.append(f"p{self.top_p:g}")
        if self.hardware is not None:
            parts.append(self.hardware)
        if self.acceptance_method == "offline":
            parts.append("offline")
        return re.sub(r"[^A-Za-z0-9._=-]+", "-", "_".join(parts)).strip("-")


def short_slugs(settings: list[Setting]) -> list[str]:
    """File-name parts for `settings`, as short as they can be and still unique: the mode, then only
    what differs between the settings (temperature, extra token, EOS, top-p, backbone, hardware),
    e.g. `greedy`, `sample`, `sample_T0.7`; the full `slug()` where that would not be unique."""
    parts_of = (  # each: the file-name part of a setting (None: nothing to say)
        lambda s: f"T{s.temperature:g}" if s.mode == "sample" and s.temperature is not None else None,
        lambda s: s.extra_token,
        lambda s: None if s.eos is None else f"eos-{s.eos}",
        lambda s: f"p{s.top_p:g}" if s.mode == "sample" and s.top_p is not None else None,
        lambda s: s.backbone,
        lambda s: s.hardware,
        lambda s: s.acceptance_method or "online",
    )
    varying = [f for f in parts_of if len({f(s) for s in settings} - {None}) > 1]
    out = []
    for s in settings:
        parts = [s.mode] + [v for f in varying if (v := f(s)) is not None]
        out.append(re.sub(r"[^A-Za-z0-9._=-]+", "-", "_".join(parts)).strip("-"))
    return out if len(set(out)) == len(out) else [s.slug() for s in settings]


def metric_columns(df: pd.DataFrame) -> list[str]:
    """The metric columns of a runs DataFrame: the named metrics plus acceptance_pos_<i>."""
    named = [m for m in (*REQUIRED_METRICS, *OPTIONAL_METRICS) if m in df.columns]
    acc = sorted(
        (c for c in df.columns if ACC_POS_RE.match(str(c))), key=lambda c: int(ACC_POS_RE.match(c).group(1))
    )
    return named + acc


def aggregate(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per (setting, configuration): `<metric>_mean`, `<metric>_std` for every metric,
    `n_evals`, `prompt_sets` (comma-joined), `run_ids` (list). Sorted by setting, then n, r,
    circuit (ff, cp, hmm, btree), k."""
    if runs.empty:
        raise ValueError("aggregate: the runs DataFrame is empty")
    keys = [k for k in (*SETTING_KEYS, *config_keys()) if k in runs.columns]
    metrics = metric_columns(runs)
    g = runs.groupby(keys, dropna=False, sort=False)
    mean = g[metrics].mean().add_suffix("_mean")
    std = g[metrics].std(ddof=1).add_suffix("_std")
    extra = g.agg(
        n_evals=("run_id", "size"),
        prompt_sets=("prompt_set", lambda s: ",".join(sorted(map(str, s.unique())))),
        run_ids=("run_id", list),
    )
    out = pd.concat([mean, std, extra], axis=1).reset_index()
    # interleave mean/std per metric for readability
    ordered = (
        keys + [c for m in metrics for c in (f"{m}_mean", f"{m}_std")] + ["n_evals", "prompt_sets", "run_ids"]
    )
    out = out[ordered]
    out = _attach_stp(runs, out)
    for k in (a.name for a in axes.axes() if a.type is int):
        if k in out.columns:
            out[k] = out[k].astype("Int64")
    # groupby turns None into NaN in object keys: give None back
    for k in (
        "backbone",
        "mode",
        "extra_token",
        "eos",
        "hardware",
        "acceptance_method",
        *(a.name for a in axes.axes() if a.type is str),
    ):
        if k in out.columns:
            out[k] = out[k].astype(object).where(out[k].notna(), None)
    out["_circuit_order"] = (
        out["circuit"].map({c: i for i, c in enumerate(CIRCUIT_KINDS)}).fillna(len(CIRCUIT_KINDS))
    )
    sort_keys = [k for k in SETTING_KEYS if k in out.columns]
    train_keys = [k for k in axis_names(axes.TRAINING) if k in out.columns]
    out = out.sort_values(
        sort_keys + ["window", "rank", "_circuit_order", "lora_depth", *train_keys],
        na_position="last",
        kind="stable",
    )
    return out.drop(columns="_circuit_order").reset_index(drop=True)


STP_COLUMNS = (
    "setting_stp_mu_lat_mean",
    "setting_stp_mu_lat_std",
    "setting_stp_throughput_mean",
    "setting_stp_throughput_std",
)


def _attach_stp(runs: pd.DataFrame, out: pd.DataFrame) -> pd.DataFrame:
    """The STP baseline of each setting: stp_mu_lat and stp_throughput averaged over the runs of a
    prompt set, then mean ± std over prompt sets; repeated on every row of the setting."""
    skeys = [k for k in SETTING_KEYS if k in runs.columns]
    have = [m for m in ("stp_mu_lat", "stp_throughput") if m in runs.columns]
    if not have:
        return out.assign(**{c: np.nan for c in STP_COLUMNS})
    per_ps = runs.groupby([*skeys, "prompt_set"], dropna=False, sort=False)[have].mean()
    g = per_ps.groupby(level=list(range(len(skeys))), dropna=False, sort=False)
    stp = pd.concat(
        [
            g.mean().add_prefix("setting_").add_suffix("_mean"),
            g.std(ddof=1).add_prefix("setting_").add_suffix("_std"),
        ],
        axis=1,
    )
    stp = stp.reindex(columns=[c for c in STP_COLUMNS if c in stp.columns]).reset_index()

    # merge on setting keys; NaN keys must match NaN keys, so merge on a string form
    def keycol(df):
        cols = [df[k].map(lambda v: "<na>" if _is_missing(v) else repr(v)) for k in skeys]
        return pd.Series(["|".join(t) for t in zip(*cols, strict=True)], index=df.index)

    stp.index = keycol(stp)
    merged = stp.drop(columns=skeys).reindex(keycol(out))
    merged.index = out.index
    for c in STP_COLUMNS:
        out[c] = merged[c] if c in merged.columns else np.nan
    return out


def _setting_of(row: pd.Series) -> Setting:
    def get(name):
        v = row.get(name)
        return None if _is_missing(v) else v

    temp = get("temperature")
    top_p = get("top_p")
    return Setting(
        backbone=str(row["backbone"]),
        mode=str(row["mode"]),
        extra_token=get("extra_token"),
        temperature=None if temp is None else float(temp),
        top_p=None if top_p is None else float(top_p),
        hardware=get("hardware"),
        eos=get("eos"),
        acceptance_method=get("acceptance_method"),
    )


def _derived_as_throughput(part: pd.DataFrame) -> pd.DataFrame:
    """An offline setting's rows with the derived figures in the throughput columns (the measured ones
    of the timed subset kept as `measured_<metric>_*`), so its figures and table use one definition
    throughout: bytes per cycle (offline) / mu_lat (timed), as logged (never recomputed here)."""
    for metric in ("throughput", "speedup_vs_stp"):
        for stat in ("mean", "std"):
            col, derived = f"{metric}_{stat}", f"derived_{metric}_{stat}"
            if col in part.columns:
                part[f"measured_{col}"] = part[col]
            part[col] = part[derived] if derived in part.columns else np.nan
    return part


def split_settings(agg: pd.DataFrame) -> list[tuple[Setting, pd.DataFrame]]:
    """The aggregated configurations split by setting, each with an `on_front` column: the Pareto
    front of (mu_lat_mean down, mu_acc_mean up) within the setting. In an offline setting the
    throughput columns hold the logged derived throughput (`_derived_as_throughput`)."""
    out: list[tuple[Setting, pd.DataFrame]] = []
    settings: dict[Setting, list[int]] = {}
    for idx, row in agg.iterrows():
        settings.setdefault(_setting_of(row), []).append(idx)
    for setting, rows in settings.items():
        part = agg.loc[rows].copy()
        if setting.acceptance_method == "offline":
            part = _derived_as_throughput(part)
        part["on_front"] = pareto_front(part, x="mu_acc_mean", y="mu_lat_mean", x_dir="max", y_dir="min")
        out.append((setting, part.reset_index(drop=True)))
    return out


def stp_baseline(part: pd.DataFrame) -> tuple[float, float, float, float] | None:
    """(stp_mu_lat mean, std, stp_throughput mean, std) of a setting's rows (from `aggregate`):
    per prompt set the mean over its runs, then mean ± std over prompt sets; None if not logged."""
    if len(part) == 0 or "setting_stp_mu_lat_mean" not in part.columns:
        return None
    row = part.iloc[0]
    lat = float(row["setting_stp_mu_lat_mean"])
    if not math.isfinite(lat):
        return None
    return (
        lat,
        float(row["setting_stp_mu_lat_std"]),
        float(row["setting_stp_throughput_mean"]),
        float(row["setting_stp_throughput_std"]),
    )
