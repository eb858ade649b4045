"""Helpers for the circuit tests: the tiny structures enumerated, and a seeded goodness-of-fit test.

`chi_square_pvalue(counts, probs)` is Pearson's test with cells of expected count < 5 pooled; each
sampling test rejects when p < ALPHA, so under the null its false-alarm rate is ALPHA (1e-3); with
the fixed seeds every outcome is deterministic, and `test_circuits.py` shows the same test rejecting
a slightly perturbed distribution (it can fail).
"""

from __future__ import annotations

import itertools

import torch
from scipy import stats

ALPHA = 1e-3  # false-alarm rate of each sampling test under the null hypothesis

# (window n, rank r, vocab v): all v^n windows and r^#latents latent states are enumerated.
CASES = [(1, 2, 4), (2, 3, 3), (3, 2, 4), (4, 3, 2), (5, 2, 3)]


def rank_for(kind: str, r: int) -> int:
    return 1 if kind == "ff" else r


def all_windows(n: int, v: int) -> torch.Tensor:
    """(v^n, n) int64, row-major order matching a (v,)*n grid flattened."""
    return torch.tensor(list(itertools.product(range(v), repeat=n)), dtype=torch.long).reshape(-1, n)


def raw_logits(circuit, batch_shape=(), seed=0, scale=1.5, dtype=torch.float64) -> dict[str, torch.Tensor]:
    """Unnormalised logits (the public methods must normalise them)."""
    g = torch.Generator().manual_seed(seed)
    return {
        name: (scale * torch.randn(tuple(batch_shape) + shape, generator=g, dtype=dtype) + 0.7)
        for name, shape in circuit.param_shapes.items()
    }


def window_index(x: torch.Tensor, v: int) -> torch.Tensor:
    """Row-major index of each window x (..., n) in the (v,)*n grid."""
    n = x.shape[-1]
    weights = v ** torch.arange(n - 1, -1, -1)
    return (x * weights).sum(-1)


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value of counts (K,) against probs (K,), pooling cells with expected < 5."""
    counts = counts.double()
    total = counts.sum()
    expected = probs.double() * total
    small = expected < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum().reshape(1)])
        expected = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = expected > 0
    if bool((counts[~keep] > 0).any()):
        return 0.0  # a sample where the distribution has no mass
    counts, expected = counts[keep], expected[keep]
    if counts.numel() < 2:
        return 1.0
    stat = float(((counts - expected) ** 2 / expected).sum())
    return float(stats.chi2.sf(stat, counts.numel() - 1))
