"""The circuit contract beyond exactness: broadcasting, dtype rules, random_params, argument errors."""

from __future__ import annotations

import pytest
import torch

from mtpc.circuits import CIRCUIT_KINDS, build_circuit
from tests.circuit_helpers import raw_logits

KINDS = CIRCUIT_KINDS


def _c(kind, n=4, r=3, v=5):
    return build_circuit(kind, window=n, rank=1 if kind == "ff" else r, vocab=v)


@pytest.mark.parametrize("kind", KINDS)
def test_broadcasting_of_params_x_and_prefix(kind):
    c = _c(kind)
    p = raw_logits(c, (3, 1), seed=3)  # params (3, 1, ...)
    x = torch.randint(0, 5, (1, 4, 4))  # x (1, 4, n) -> out (3, 4)
    # mix: one param broadcast from no batch dims at all, as an expanded view
    name = "leaves"
    p[name] = p[name][0, 0].expand(3, 1, *p[name].shape[2:])
    lp = c.log_prob(p, x)
    pm = c.prefix_log_marginals(p, x)
    cond = c.conditionals(p, x)
    assert lp.shape == (3, 4) and pm.shape == (3, 4, 4) and cond.shape == (3, 4, 4, 5)
    for a in range(3):
        for b in range(4):
            pa = {k: t[a, 0] for k, t in p.items()}
            torch.testing.assert_close(lp[a, b], c.log_prob(pa, x[0, b]))
            torch.testing.assert_close(pm[a, b], c.prefix_log_marginals(pa, x[0, b]))
            torch.testing.assert_close(cond[a, b], c.conditionals(pa, x[0, b]))
    prefix = torch.randint(0, 5, (1, 4, 2))
    s = c.sample(p, generator=torch.Generator().manual_seed(0), prefix=prefix)
    gr = c.greedy(p, prefix=prefix)
    assert s.shape == gr.shape == (3, 4, 4)
    assert (s[..., :2] == prefix).all() and (gr[..., :2] == prefix).all()
    for a in range(3):
        for b in range(4):
            pa = {k: t[a, 0] for k, t in p.items()}
            assert torch.equal(gr[a, b], c.greedy(pa, prefix=prefix[0, b]))
    assert c.sample(p).shape == (3, 1, 4)
    # x with more batch dims than the params
    assert c.log_prob({k: t[0, 0] for k, t in p.items()}, x).shape == (1, 4)


@pytest.mark.parametrize("kind", KINDS)
def test_dtype_rules(kind):
    c = _c(kind)
    x = torch.randint(0, 5, (2, 4), dtype=torch.int32)
    p32 = raw_logits(c, (2,), dtype=torch.float32)
    p64 = {k: t.double() for k, t in p32.items()}
    pbf = {k: t.bfloat16() for k, t in p32.items()}
    mixed = dict(p32, leaves=p64["leaves"])
    assert c.log_prob(p32, x).dtype == torch.float32
    assert c.log_prob(p64, x).dtype == torch.float64
    assert c.conditionals(mixed, x).dtype == torch.float64
    out_bf = c.log_prob(pbf, x)
    assert out_bf.dtype == torch.float32  # bf16 input computed in float32
    ref = c.log_prob({k: t.float() for k, t in pbf.items()}, x)
    torch.testing.assert_close(out_bf, ref)
    assert c.sample(p32).dtype == torch.long and c.greedy(pbf).dtype == torch.long
    q = c.normalize(pbf)
    assert all(t.dtype == torch.float32 for t in q.values())


@pytest.mark.parametrize("kind", KINDS)
def test_random_params_normalised_and_seeded(kind):
    c = _c(kind)
    p = c.random_params((2, 3), generator=torch.Generator().manual_seed(5), dtype=torch.float64, scale=2.0)
    assert set(p) == set(c.param_shapes)
    for name, shape in c.param_shapes.items():
        assert p[name].shape == (2, 3, *shape) and p[name].dtype == torch.float64
        if p[name].numel():
            torch.testing.assert_close(
                p[name].logsumexp(-1), torch.zeros(p[name].shape[:-1], dtype=torch.float64)
            )
        # normalising again is a no-op
        torch.testing.assert_close(c.normalize(p)[name], p[name])
    again = c.random_params(
        (2, 3), generator=torch.Generator().manual_seed(5), dtype=torch.float64, scale=2.0
    )
    assert all(torch.equal(p[k], again[k]) for k in p)


def test_build_circuit_rejects_bad_structure():
    with pytest.raises(ValueError, match="kind"):
        build_circuit("mlp", window=4, rank=2, vocab=5)
    with pytest.raises(ValueError, match="window"):
        build_circuit("cp", window=0, rank=2, vocab=5)
    with pytest.raises(ValueError, match="window"):
        build_circuit("cp", window=2.0, rank=2, vocab=5)
    with pytest.raises(ValueError, match="rank"):
        build_circuit("cp", window=4, rank=0, vocab=5)
    with pytest.raises(ValueError, match="rank"):
        build_circuit("ff", window=4, rank=2, vocab=5)
    with pytest.raises(ValueError, match="vocab"):
        build_circuit("hmm", window=4, rank=2, vocab=0)


@pytest.mark.parametrize("kind", KINDS)
def test_bad_arguments_name_the_argument(kind):
    c = _c(kind)
    p = c.random_params((2,))
    x = torch.randint(0, 5, (2, 4))
    with pytest.raises(ValueError, match="x: ids must lie in"):
        c.log_prob(p, x.clone().fill_(5))
    with pytest.raises(ValueError, match="x: ids must lie in"):
        c.conditionals(p, x.clone().fill_(-1))
    with pytest.raises(ValueError, match="x: expected last dim"):
        c.prefix_log_marginals(p, x[:, :3])
    with pytest.raises(ValueError, match="x: expected an integer"):
        c.log_prob(p, x.float())
    with pytest.raises(ValueError, match="x: leading dims"):
        c.log_prob(p, torch.randint(0, 5, (3, 4)))
    with pytest.raises(ValueError, match=r"params\['leaves'\]: expected shape"):
        c.log_prob(dict(p, leaves=p["leaves"][..., :4]), x)
    with pytest.raises(ValueError, match="params: .* missing"):
        c.log_prob({k: t for k, t in p.items() if k != "leaves"}, x)
    with pytest.raises(ValueError, match="params: .* unexpected"):
        c.log_prob(dict(p, extra=p["leaves"]), x)
    with pytest.raises(ValueError, match="params"):
        c.log_prob(p["leaves"], x)
    if len(p) > 1:
        other = next(k for k in p if k != "leaves")
        with pytest.raises(ValueError, match="params: leading"):
            c.log_prob(dict(p, leaves=p["leaves"][:1].expand(3, *p["leaves"].shape[1:])), x)
        with pytest.raises(ValueError, match=rf"params\['{other}'\]: expected a floating"):
            c.log_prob(dict(p, **{other: p[other].long()}), x)
    with pytest.raises(ValueError, match="prefix: length 5 is longer than the window"):
        c.sample(p, prefix=torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="prefix: ids must lie in"):
        c.greedy(p, prefix=torch.full((2, 2), 7))
    with pytest.raises(ValueError, match="prefix: leading dims"):
        c.sample(p, prefix=torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="generator"):
        c.sample(p, generator=0)
    with pytest.raises(ValueError, match="batch_shape"):
        c.random_params((-1,))
    with pytest.raises(ValueError, match="dtype"):
        c.random_params((2,), dtype=torch.long)
