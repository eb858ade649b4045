"""Exactness of every circuit kind against the dense brute-force reference, in float64.

For v <= 4, n in 1..5, r <= 3: normalisation, log_prob, prefix marginals and conditionals equal
the enumeration; `sample` (with and without a prefix) matches the exact (conditional) distribution
by a seeded chi-square test (false-alarm rate ALPHA = 1e-3 each); `greedy` returns a maximiser of the
joint over latents and tokens; `_draft` agrees with sample + conditionals. Broadcasting, dtype rules
and argument errors are in test_circuits_contract.py.
"""

from __future__ import annotations

import pytest
import torch

from mtpc.circuits import CIRCUIT_KINDS, build_circuit
from mtpc.circuits.reference import dense_joint, dense_max_joint
from tests.circuit_helpers import (
    ALPHA,
    CASES,
    all_windows,
    chi_square_pvalue,
    rank_for,
    raw_logits,
    window_index,
)

KINDS = CIRCUIT_KINDS


def _setup(kind, case, batch_shape=(2,), seed=0):
    n, r, v = case
    c = build_circuit(kind, window=n, rank=rank_for(kind, r), vocab=v)
    return c, raw_logits(c, batch_shape, seed=seed), n, v


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_queries_match_enumeration(kind, case):
    c, p, n, v = _setup(kind, case)
    joint = dense_joint(kind, p).reshape(2, -1)  # (2, v^n)
    assert torch.allclose(joint.logsumexp(-1), torch.zeros(2, dtype=torch.float64), atol=1e-12)
    xs = all_windows(n, v)  # (V, n)
    lp = c.log_prob({k: t[:, None] for k, t in p.items()}, xs[None])  # (2, V)
    assert lp.dtype == torch.float64
    torch.testing.assert_close(lp, joint, atol=1e-10, rtol=0)

    # margs[i] = log q(x_1..x_i) as a (2, v^i) table (summing the joint over positions > i)
    grid = dense_joint(kind, p)  # (2, v, ..., v)
    margs = [torch.zeros(2, 1, dtype=torch.float64)]
    for i in range(1, n + 1):
        margs.append(
            grid.logsumexp(dim=tuple(range(1 + i, 1 + n))).reshape(2, -1) if i < n else grid.reshape(2, -1)
        )
    want = torch.stack(
        [margs[i][:, window_index(xs[:, :i], v)] for i in range(1, n + 1)], dim=-1
    )  # (2, V, n)
    pm = c.prefix_log_marginals({k: t[:, None] for k, t in p.items()}, xs[None])
    torch.testing.assert_close(pm, want, atol=1e-10, rtol=0)

    # conditionals: row i = log q(x_<i, x_i = u) - log q(x_<i)
    cond = c.conditionals({k: t[:, None] for k, t in p.items()}, xs[None])  # (2, V, n, v)
    assert cond.shape == (2, v**n, n, v)
    for i in range(n):
        idx = window_index(xs[:, :i], v)[:, None] * v + torch.arange(v)  # (V, v)
        expect = margs[i + 1][:, idx] - margs[i][:, window_index(xs[:, :i], v)][..., None]
        torch.testing.assert_close(cond[:, :, i, :], expect, atol=1e-10, rtol=0)


def _exact_conditional(kind, p, n, v, prefix):
    """Exact q(window | prefix) over all v^n windows (V,) for one context."""
    joint = dense_joint(kind, p).reshape(-1).exp()  # (V,)
    xs = all_windows(n, v)
    k = prefix.numel()
    ok = (xs[:, :k] == prefix).all(-1)
    probs = torch.where(ok, joint, torch.zeros(()))
    return probs / probs.sum()


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [0, 1, "n-1"])
def test_sample_matches_exact_distribution(kind, case, k):
    c, p, n, v = _setup(kind, case, batch_shape=(), seed=1)
    k = n - 1 if k == "n-1" else min(k, n)
    prefix = torch.arange(k) % v  # a fixed prefix x_1..x_k
    draws = 20000
    g = torch.Generator().manual_seed(1234)
    # params broadcast: an expanded view of one context; the prefix carries the batch dim
    x = c.sample(p, generator=g, prefix=prefix.expand(draws, k))
    assert x.shape == (draws, n) and x.dtype == torch.long
    assert (x[:, :k] == prefix).all()
    counts = torch.bincount(window_index(x, v), minlength=v**n)
    probs = _exact_conditional(kind, p, n, v, prefix)
    assert chi_square_pvalue(counts, probs) > ALPHA
    # the unchecked fused draft samples the same distribution (and returns the conditionals of x)
    q = c.normalize({name: t.expand(draws, *t.shape) for name, t in p.items()})
    xd, cond = c._draft(q, prefix.expand(draws, k), generator=torch.Generator().manual_seed(99))
    counts = torch.bincount(window_index(xd, v), minlength=v**n)
    assert chi_square_pvalue(counts, probs) > ALPHA
    torch.testing.assert_close(cond[:50], c.conditionals(p, xd[:50]), atol=1e-10, rtol=0)


def test_sampling_test_can_fail():
    """The same chi-square test rejects a distribution perturbed by 3% of its mass."""
    kind, (n, r, v) = "cp", (3, 2, 4)
    c, p, n, v = _setup(kind, (n, r, v), batch_shape=(), seed=1)
    x = c.sample(
        p, generator=torch.Generator().manual_seed(1234), prefix=torch.zeros(20000, 0, dtype=torch.long)
    )
    counts = torch.bincount(window_index(x, v), minlength=v**n)
    probs = _exact_conditional(kind, p, n, v, torch.zeros(0, dtype=torch.long))
    assert chi_square_pvalue(counts, probs) > ALPHA
    top = probs.argmax()
    bad = probs.clone()
    bad[top] -= 0.03
    bad[(top + 1) % bad.numel()] += 0.03
    assert chi_square_pvalue(counts, bad) < ALPHA


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_is_a_joint_maximiser(kind, case):
    c, p, n, v = _setup(kind, case, batch_shape=(3,), seed=2)
    best = dense_max_joint(kind, p).reshape(3, -1)  # (3, V) max over latents
    xs = all_windows(n, v)
    for k in range(0, n + 1):
        prefix = (torch.arange(k) * 2 + 1) % v
        x = c.greedy(p, prefix=prefix)
        assert x.shape == (3, n) and x.dtype == torch.long
        assert (x[:, :k] == prefix).all()
        ok = (xs[:, :k] == prefix).all(-1)
        target = best.masked_fill(~ok, -float("inf")).amax(-1)  # (3,)
        got = best.gather(-1, window_index(x, v)[:, None]).squeeze(-1)
        torch.testing.assert_close(got, target, atol=1e-10, rtol=0)
        q = c.normalize(p)
        xd, cond = c._draft(q, prefix, greedy=True)
        assert torch.equal(xd, x)
        torch.testing.assert_close(cond, c.conditionals(p, x), atol=1e-10, rtol=0)
    assert torch.equal(c.greedy(p), c.greedy(p, prefix=torch.zeros(0, dtype=torch.long)))
