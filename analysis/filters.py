"""Row filters of the evaluation-runs DataFrame: `Filters` (one tuple of accepted values per
column; values checked against the vocabulary; development prompt sets dev<i> left out unless
asked) and `apply_filters`, which also reports how many
rows each filter left, so an empty result can be explained. No MLflow, no plotting.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from mtpc.names import CIRCUIT_KINDS, DECODE_MODES, EXTRA_TOKEN_OPTIONS
from tracking.schema import BASELINE_METHODS, DEV_SET_PREFIX


@dataclass(frozen=True)
class Filters:
    """Row filters; None = no filter. Each list means "any of these values"."""

    backbone: tuple[str, ...] | None = None
    mode: tuple[str, ...] | None = None
    extra_token: tuple[str, ...] | None = None
    temperature: tuple[float, ...] | None = None
    window: tuple[int, ...] | None = None
    lora_depth: tuple[int, ...] | None = None
    circuit: tuple[str, ...] | None = None
    prompt_sets: str = "reported"
    """reported (default: development sets "dev<i>" left out), dev (only those) or all"""

    def __post_init__(self) -> None:
        if self.prompt_sets not in ("reported", "dev", "all"):
            raise ValueError(f"filter prompt_sets={self.prompt_sets!r}: expected 'reported', 'dev' or 'all'")
        if self.mode is not None:
            bad = [m for m in self.mode if m not in DECODE_MODES]
            if bad:
                raise ValueError(f"filter mode={bad}: expected values in {list(DECODE_MODES)}")
        if self.extra_token is not None:
            bad = [m for m in self.extra_token if m not in EXTRA_TOKEN_OPTIONS]
            if bad:
                raise ValueError(f"filter extra_token={bad}: expected values in {list(EXTRA_TOKEN_OPTIONS)}")
        if self.circuit is not None:
            bad = [m for m in self.circuit if m not in (*CIRCUIT_KINDS, *BASELINE_METHODS)]
            if bad:
                raise ValueError(
                    f"filter circuit={bad}: expected values in {[*CIRCUIT_KINDS, *BASELINE_METHODS]}"
                )

    def active(self) -> dict[str, tuple]:
        return {k: v for k, v in self.__dict__.items() if v is not None and k != "prompt_sets"}

    def describe(self) -> str:
        act = self.active()
        parts = [f"{k} in {list(v)}" if len(v) > 1 else f"{k}={v[0]}" for k, v in act.items()]
        if self.prompt_sets != "reported":
            parts.append(f"prompt sets: {self.prompt_sets}")
        return ", ".join(parts) or "no filters"


def apply_filters(df: pd.DataFrame, filters: Filters) -> tuple[pd.DataFrame, list[tuple[str, int]]]:
    """Rows that pass every filter, and the row count after each filter (to explain an empty
    result). Float filters compare with a tolerance (temperature 0.7 == "0.7000001")."""
    trail: list[tuple[str, int]] = []
    out = df
    if filters.prompt_sets != "all":  # development sets (dev<i>) choose settings; they are not reported
        dev = out["prompt_set"].astype(str).str.startswith(DEV_SET_PREFIX).to_numpy(dtype=bool)
        before = len(out)
        out = out[dev if filters.prompt_sets == "dev" else ~dev]
        if filters.prompt_sets == "dev" or len(out) != before:
            trail.append((f"prompt sets={filters.prompt_sets}", len(out)))
    for name, values in filters.active().items():
        col = out[name]
        if name == "temperature":
            vals = np.asarray(values, dtype=float)
            x = col.to_numpy(dtype=float, na_value=np.nan)
            keep = np.isclose(x[:, None], vals[None, :], rtol=1e-6, atol=1e-9).any(axis=1)
        else:
            keep = col.isin(list(values)).to_numpy(dtype=bool, na_value=False)
        out = out[keep]
        trail.append((f"{name}={list(values) if len(values) > 1 else values[0]}", len(out)))
    return out.reset_index(drop=True), trail
