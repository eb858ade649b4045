"""Tests for analysis/bootstrap.py: the pooled ratio, pairing (a shared per-prompt difficulty cancels),
coverage of the interval on a known ratio, seed pooling, and each branch of the decision rule."""

from __future__ import annotations

import numpy as np
import pytest

from analysis.bootstrap import NOT_DECIDED, NOT_REPRODUCED, REPRODUCED, PairedSample, decide, paired_bootstrap


def sample(rng, P, ratio, noise=0.05, difficulty=None):
    """Per-prompt cycles 100; B accepts d_i per cycle, A accepts ratio * d_i (times noise)."""
    d = rng.uniform(0.5, 3.0, P) if difficulty is None else difficulty
    cyc = np.full(P, 100.0)
    acc_b = d * cyc
    acc_a = ratio * d * cyc * rng.normal(1.0, noise, P)
    return PairedSample(acc_a, cyc, acc_b, cyc)


def test_pooled_ratio_and_pairing_narrows_the_interval():
    rng = np.random.default_rng(0)
    s = sample(rng, 96, 1.1, noise=0.02)
    assert s.ratio() == pytest.approx(s.num_a.sum() / s.num_b.sum())
    paired = paired_bootstrap([s])
    # the same numbers, unpaired (B's prompts shuffled): the shared difficulty no longer cancels
    unpaired = paired_bootstrap([PairedSample(s.num_a, s.den_a, rng.permutation(s.num_b), s.den_b)])
    assert paired.ratio == pytest.approx(unpaired.ratio)
    assert (paired.high - paired.low) < 0.5 * (unpaired.high - unpaired.low)
    assert paired.low < 1.1 < paired.high


def test_interval_covers_the_true_ratio_about_95_percent():
    rng = np.random.default_rng(1)
    hits = 0
    for i in range(200):
        r = paired_bootstrap([sample(rng, 32, 1.2, noise=0.2)], resamples=800, seed=i)
        hits += r.low <= 1.2 <= r.high
    assert 0.88 <= hits / 200 <= 0.99


def test_seeds_are_pooled_per_prompt_and_reported_one_by_one():
    rng = np.random.default_rng(2)
    d = rng.uniform(0.5, 3.0, 40)
    s1, s2 = sample(rng, 40, 1.3, difficulty=d), sample(rng, 40, 1.1, difficulty=d)
    r = paired_bootstrap([s1, s2])
    assert r.per_seed == (pytest.approx(s1.ratio()), pytest.approx(s2.ratio()))
    assert r.ratio == pytest.approx((s1.num_a.sum() + s2.num_a.sum()) / (s1.num_b.sum() + s2.num_b.sum()))
    with pytest.raises(ValueError, match="same prompts"):
        paired_bootstrap([s1, sample(rng, 39, 1.0)])
    with pytest.raises(ValueError, match="one length"):
        PairedSample(np.ones(3), np.ones(3), np.ones(2), np.ones(3))


def test_decision_rule_branches():
    rng = np.random.default_rng(3)
    d = rng.uniform(0.5, 3.0, 64)
    clear = paired_bootstrap([sample(rng, 64, 1.3, 0.03, d), sample(rng, 64, 1.3, 0.03, d)])
    assert decide("h", clear, 1.25).verdict == REPRODUCED
    assert decide("h", paired_bootstrap([sample(rng, 64, 1.3, 0.03, d)]), 1.25).verdict == NOT_DECIDED
    small = paired_bootstrap([sample(rng, 64, 1.03, 0.01, d), sample(rng, 64, 1.03, 0.01, d)])
    dec = decide("h", small, 1.05)
    assert dec.verdict == NOT_REPRODUCED and "< 1.05" in dec.reason  # significant, but below the threshold
    noisy = paired_bootstrap([sample(rng, 8, 1.02, 0.3, d[:8]), sample(rng, 8, 1.02, 0.3, d[:8])])
    dec = decide("h", noisy, 1.0)
    assert dec.verdict == NOT_REPRODUCED and "does not exclude 1.0" in dec.reason
    split = paired_bootstrap([sample(rng, 64, 1.6, 0.01, d), sample(rng, 64, 0.98, 0.01, d)])
    dec = decide("h", split, 1.05)
    assert dec.verdict == NOT_REPRODUCED and "seed's ratio is <= 1" in dec.reason
    assert decide("h", clear, 1.25).lower_clears_threshold == (clear.low >= 1.25)
