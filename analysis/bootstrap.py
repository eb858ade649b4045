"""Paired bootstrap over prompts for "head A accepts x times more than head B" (docs/fidelity.md).

The statistic is a ratio of pooled means, e.g. mu_acc = sum accepted / sum cycles over prompts,
so A / B = (sum_i acc_A,i / sum_i cyc_A,i) / (sum_i acc_B,i / sum_i cyc_B,i). A and B were evaluated
on the same prompts (same prompt sets, same sampling seed per prompt), so prompts are resampled
*paired*: one draw of prompt indices, with replacement, serves both heads. With several training
seeds, each prompt's numerator and denominator are summed over the seeds before resampling (the
point ratio is the seed-pooled one) and every seed's own ratio is reported beside it.

Decision rule, fixed before any result (docs/fidelity.md): a hypothesis "A >= t x B" is
*reproduced* iff (1) the pooled ratio is >= t, (2) the 95 % percentile interval of the paired
bootstrap excludes 1.0 (lower end > 1), and (3) every training seed's ratio is > 1 (with fewer
than `min_seeds` seeds it is *not decided*). Otherwise *not reproduced*; the reason says which
condition failed. Whether the lower end also clears t is reported (`lower_clears_threshold`).

Pure numpy; reading per-prompt records from MLflow lives in analysis/fidelity.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

REPRODUCED = "reproduced"
NOT_REPRODUCED = "not reproduced"
NOT_DECIDED = "not decided"


@dataclass(frozen=True)
class PairedSample:
    """One training seed's per-prompt numerators and denominators for heads A and B, aligned by prompt."""

    num_a: np.ndarray  # (P,) e.g. accepted drafts of head A on prompt i
    den_a: np.ndarray  # (P,) e.g. cycles of head A on prompt i
    num_b: np.ndarray
    den_b: np.ndarray

    def __post_init__(self) -> None:
        shapes = {np.shape(x) for x in (self.num_a, self.den_a, self.num_b, self.den_b)}
        if len(shapes) != 1 or len(next(iter(shapes))) != 1 or next(iter(shapes))[0] == 0:
            raise ValueError(
                f"PairedSample: expected four 1-D arrays of one length P >= 1 (one entry per prompt), got shapes {sorted(shapes)}"
            )

    def ratio(self) -> float:
        return _ratio(self.num_a.sum(), self.den_a.sum(), self.num_b.sum(), self.den_b.sum())


def _ratio(na: float, da: float, nb: float, db: float) -> float:
    a = na / da if da else math.nan
    b = nb / db if db else math.nan
    return a / b if b else math.nan


@dataclass(frozen=True)
class BootstrapResult:
    ratio: float
    """seed-pooled ratio of pooled means A / B"""
    low: float
    high: float
    """percentile interval of the paired bootstrap at `level`"""
    level: float
    per_seed: tuple[float, ...]
    """each training seed's own ratio"""
    prompts: int
    resamples: int


def paired_bootstrap(
    samples: Sequence[PairedSample], resamples: int = 10_000, level: float = 0.95, seed: int = 0
) -> BootstrapResult:
    """Paired bootstrap over prompts of the ratio of pooled means (see the module docstring)."""
    if not samples:
        raise ValueError("paired_bootstrap: no samples (one PairedSample per training seed)")
    if len({len(s.num_a) for s in samples}) != 1:
        raise ValueError("paired_bootstrap: every training seed must cover the same prompts (equal P)")
    if not 0 < level < 1 or resamples < 1:
        raise ValueError(
            f"paired_bootstrap: expected 0 < level < 1 and resamples >= 1, got {level}, {resamples}"
        )
    stack = lambda f: np.sum([np.asarray(getattr(s, f), dtype=float) for s in samples], axis=0)  # noqa: E731
    na, da, nb, db = (stack(f) for f in ("num_a", "den_a", "num_b", "den_b"))  # (P,) pooled over seeds
    P = len(na)
    idx = np.random.default_rng(seed).integers(0, P, size=(resamples, P))  # (R, P) one draw for A and B
    with np.errstate(divide="ignore", invalid="ignore"):
        boot = (na[idx].sum(1) / da[idx].sum(1)) / (nb[idx].sum(1) / db[idx].sum(1))  # (R,)
    boot = boot[np.isfinite(boot)]
    alpha = (1 - level) / 2
    low, high = (
        (float(np.quantile(boot, q)) for q in (alpha, 1 - alpha)) if len(boot) else (math.nan, math.nan)
    )
    return BootstrapResult(
        _ratio(na.sum(), da.sum(), nb.sum(), db.sum()),
        low,
        high,
        level,
        tuple(s.ratio() for s in samples),
        P,
        resamples,
    )


@dataclass(frozen=True)
class Decision:
    hypothesis: str
    threshold: float
    result: BootstrapResult
    verdict: str
    reason: str
    lower_clears_threshold: bool


def decide(hypothesis: str, result: BootstrapResult, threshold: float, min_seeds: int = 2) -> Decision:
    """The fixed decision rule of the module docstring applied to one bootstrap result."""
    r = result
    clears = bool(r.low >= threshold)
    if len(r.per_seed) < min_seeds:
        return Decision(
            hypothesis,
            threshold,
            r,
            NOT_DECIDED,
            f"{len(r.per_seed)} training seed(s), the rule needs {min_seeds}",
            clears,
        )
    failed = []
    if not r.ratio >= threshold:
        failed.append(f"ratio {r.ratio:.3f} < {threshold:g}")
    if not r.low > 1.0:
        failed.append(f"{r.level:.0%} interval [{r.low:.3f}, {r.high:.3f}] does not exclude 1.0")
    if not all(x > 1.0 for x in r.per_seed):
        failed.append("a training seed's ratio is <= 1 (" + ", ".join(f"{x:.3f}" for x in r.per_seed) + ")")
    if failed:
        return Decision(hypothesis, threshold, r, NOT_REPRODUCED, "; ".join(failed), clears)
    return Decision(
        hypothesis,
        threshold,
        r,
        REPRODUCED,
        f"ratio {r.ratio:.3f} >= {threshold:g}, {r.level:.0%} interval [{r.low:.3f}, {r.high:.3f}] "
        "excludes 1.0, every seed > 1",
        clears,
    )
