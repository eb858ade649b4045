"""Numerics at the paper's sizes: n = 16, r = 128 with extreme logits (+-30) in float32.

Values and gradients must be finite, agree with a float64 evaluation of the same logits, and a
bf16 input must be computed in float32 (a bf16 btree was measured 0.46 nats off, DESIGN section 1).
"""

from __future__ import annotations

import pytest
import torch

from mtpc.circuits import CIRCUIT_KINDS, build_circuit

N, R, V = 16, 128, 320  # the paper's sizes (EvaByte vocab)


def _extreme_logits(c, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in c.param_shapes.items():
        sign = torch.randint(0, 2, (batch, *shape), generator=g).float() * 2 - 1  # +-1
        out[name] = (30.0 * sign * torch.rand((batch, *shape), generator=g).sqrt()).requires_grad_(True)
    return out


@pytest.mark.parametrize("kind", CIRCUIT_KINDS)
def test_extreme_logits_finite_values_and_grads_float32(kind):
    c = build_circuit(kind, window=N, rank=1 if kind == "ff" else R, vocab=V)
    p = _extreme_logits(c)
    x = torch.randint(0, V, (2, N), generator=torch.Generator().manual_seed(1))
    lp = c.log_prob(p, x)
    pm = c.prefix_log_marginals(p, x)
    cond = c.conditionals(p, x)
    assert lp.dtype == pm.dtype == cond.dtype == torch.float32
    assert torch.isfinite(lp).all() and torch.isfinite(pm).all() and torch.isfinite(cond).all()
    (lp.sum() + pm.sum() + cond.logsumexp(-1).sum()).backward()
    for name, t in p.items():
        assert t.grad is not None and torch.isfinite(t.grad).all(), name
    # float32 agrees with float64 on the same logits (relative to the size of the numbers)
    p64 = {k: t.detach().double() for k, t in p.items()}
    lp64 = c.log_prob(p64, x)
    torch.testing.assert_close(lp.double(), lp64, atol=1e-3, rtol=1e-5)
    torch.testing.assert_close(pm.double(), c.prefix_log_marginals(p64, x), atol=1e-3, rtol=1e-5)
    torch.testing.assert_close(cond.double(), c.conditionals(p64, x), atol=2e-3, rtol=1e-5)
    # sampling and greedy run on the same extreme parameters
    with torch.no_grad():
        s = c.sample(p, generator=torch.Generator().manual_seed(2), prefix=x[:, :3])
        g = c.greedy(p, prefix=x[:, :3])
    assert s.shape == g.shape == (2, N) and (s[:, :3] == x[:, :3]).all() and (g < V).all()


@pytest.mark.parametrize("kind", CIRCUIT_KINDS)
def test_bf16_input_is_computed_in_float32(kind):
    c = build_circuit(kind, window=N, rank=1 if kind == "ff" else 32, vocab=V)
    p = {k: t.detach().bfloat16() for k, t in _extreme_logits(c, seed=3).items()}
    x = torch.randint(0, V, (2, N), generator=torch.Generator().manual_seed(4))
    out = c.log_prob(p, x)
    assert out.dtype == torch.float32
    exact = c.log_prob({k: t.double() for k, t in p.items()}, x)  # the same bf16 numbers, float64
    torch.testing.assert_close(out.double(), exact, atol=1e-3, rtol=1e-5)
