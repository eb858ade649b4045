"""The native cycle kernels (mtpc.kernels). The btree drafts (mtpc/csrc/btree_draft.cpp). Greedy: the same
window as the torch max-product path for every tree shape, rank and prefix length, ties included
(parameters rounded before normalising, so many rows hold equal maxima). Sampled: the conditionals
of the drawn window equal the circuit's, and the draws given a prefix follow the dense joint
conditioned on it. The sampling accept (mtpc/csrc/accept.cpp): its accepted length and extra token
follow sample_verify's distributions, read off a fine grid of its two uniforms; a sampled generation
through it. And where the torch paths run instead."""

from __future__ import annotations

import itertools

import pytest
import torch

from mtpc.circuits import build_circuit
from mtpc.circuits.reference import dense_joint
from mtpc.kernels import btree_greedy_draft, btree_sample_draft, native_cycle_unsupported, sample_accept
from mtpc.speculative.acceptance import (
    acceptance_length_distribution,
    acceptance_probs,
    residual_distribution,
)

WHY = native_cycle_unsupported("cpu", torch.float32)
pytestmark = pytest.mark.skipif(WHY is not None, reason=str(WHY))


def _params(circuit, gen, ties: bool, dtype=torch.float32):
    raw = {k: torch.randn(sh, generator=gen, dtype=dtype) for k, sh in circuit.param_shapes.items()}
    if ties:  # integers: equal maxima in most rows, so the first-maximum rule is exercised
        raw = {k: v.round() for k, v in raw.items()}
    return circuit.normalize(raw)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 16])
@pytest.mark.parametrize("r", [1, 3, 16])
def test_native_greedy_window_equals_the_torch_path(n, r, monkeypatch):
    circuit = build_circuit("btree", n, r, 40)
    gen = torch.Generator().manual_seed(n * 100 + r)
    for trial in range(12):
        q = _params(circuit, gen, ties=trial % 2 == 1)
        for k in sorted({0, 1, min(2, n), n}):
            prefix = None if k == 0 else torch.randint(0, 40, (k,), generator=gen)
            native = circuit._native_greedy(q, prefix)
            assert native is not None  # the native path ran (not a silent fallback)
            monkeypatch.setenv("MTPC_NATIVE_CYCLE", "0")
            assert circuit._native_greedy(q, prefix) is None
            ref, conds = circuit._draft(q, prefix, greedy=True, conditionals=False)
            monkeypatch.delenv("MTPC_NATIVE_CYCLE")
            assert conds is None
            assert torch.equal(native, ref), (n, r, k, trial)
            got, _ = circuit._draft(q, prefix, greedy=True, conditionals=False)
            assert torch.equal(got, ref)


def test_the_torch_path_runs_where_the_kernel_does_not_apply():
    circuit = build_circuit("btree", 4, 3, 40)
    gen = torch.Generator().manual_seed(0)
    batch = {k: v.expand(2, *v.shape) for k, v in _params(circuit, gen, ties=False).items()}
    assert circuit._native_greedy(batch, None) is None  # a batch of contexts
    assert circuit._native_greedy(_params(circuit, gen, False, torch.float64), None) is None  # float64
    x, _ = circuit._draft(batch, None, greedy=True, conditionals=False)
    assert x.shape == (2, 4)


def test_kernel_refusals_name_what_was_wrong():
    circuit = build_circuit("btree", 4, 3, 40)
    q = _params(circuit, torch.Generator().manual_seed(1), ties=False)
    plan = circuit._sched(torch.device("cpu")).native_plan
    args = (q["root"], q["internal"], q["leaves"])
    with pytest.raises(RuntimeError, match="prefix id out of range"):
        btree_greedy_draft(*args, torch.tensor([40]), plan)
    with pytest.raises(RuntimeError, match="do not match the plan"):
        btree_greedy_draft(
            q["root"], q["internal"], q["leaves"][:3].contiguous(), torch.zeros(0, dtype=torch.long), plan
        )
    with pytest.raises(RuntimeError, match="float32"):
        btree_greedy_draft(*(t.double() for t in args), torch.zeros(0, dtype=torch.long), plan)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("r", [1, 4, 16])
def test_native_sampled_conditionals_are_the_circuits(n, r):
    circuit = build_circuit("btree", n, r, 40)
    gen = torch.Generator().manual_seed(7 * n + r)
    for _ in range(6):
        q = _params(circuit, gen, ties=False)
        for k in sorted({0, 1, n}):
            prefix = None if k == 0 else torch.randint(0, 40, (k,), generator=gen)
            got = circuit._native_sample(q, prefix, gen)
            assert got is not None  # the native path ran
            x, log_q = got
            assert x.shape == (n,) and log_q.shape == (n, 40)
            if k:
                assert torch.equal(x[:k], prefix)
            ref = circuit.conditionals(q, x)
            assert torch.allclose(log_q, ref, atol=2e-5), (n, r, k, (log_q - ref).abs().max())
            got2, conds = circuit._draft(q, prefix, generator=gen, greedy=False, conditionals=True)
            assert got2.shape == (n,) and conds.shape == (n, 40)


@pytest.mark.parametrize("k", [0, 1, 2])
def test_native_draws_follow_the_joint_given_the_prefix(k):
    """v = 3, n = 4, r = 3, sharp parameters: 20000 draws (a fixed seed) against the dense joint
    conditioned on the prefix. The prefix is the one that moves the rest most, and the rest's
    unconditioned marginal is checked to be far from the conditioned one (TV > 0.1), a draw that ignored the
    prefix would fail; sampling noise is ~0.01."""
    n, r, v = 4, 3, 3
    circuit = build_circuit("btree", n, r, v)
    gen = torch.Generator().manual_seed(14)  # a seed whose root carries the prefix across the tree
    q = circuit.normalize(
        {name: 3 * torch.randn(sh, generator=gen) for name, sh in circuit.param_shapes.items()}
    )
    joint = dense_joint("btree", q).exp()  # (v,) * n
    prefix = None
    if k:
        rest = joint.sum(dim=tuple(range(k))).reshape(-1)
        rest = rest / rest.sum()  # the unconditioned marginal of positions k..n-1

        def far(pre):
            cond = joint[pre].reshape(-1)
            return 0.5 * (cond / cond.sum() - rest).abs().sum().item()

        prefix = torch.tensor(max(itertools.product(range(v), repeat=k), key=far))
        assert far(tuple(prefix.tolist())) > 0.1  # the check can fail
        joint = joint[tuple(prefix.tolist())]
    joint = (joint / joint.sum()).reshape(-1)
    counts = torch.zeros(v ** (n - k), dtype=torch.float64)
    draws = 20000
    for _ in range(draws):
        x, _ = circuit._native_sample(q, prefix, gen)
        idx = 0
        for t in x[k:].tolist():
            idx = idx * v + t
        counts[idx] += 1
    tv = 0.5 * (counts / draws - joint).abs().sum().item()
    assert tv < 0.03, tv


def test_sample_kernel_refusals():
    circuit = build_circuit("btree", 4, 3, 40)
    q = _params(circuit, torch.Generator().manual_seed(1), ties=False)
    plan = circuit._sched(torch.device("cpu")).native_plan
    probs = q["leaves"].exp().contiguous()
    none = torch.zeros(0, dtype=torch.long)
    with pytest.raises(RuntimeError, match="uniforms"):
        btree_sample_draft(q["root"], q["internal"], probs, none, torch.rand(3, dtype=torch.float64), plan)
    with pytest.raises(RuntimeError, match="without siblings"):
        btree_sample_draft(
            q["root"], q["internal"], probs, none, torch.rand(10, dtype=torch.float64), plan[:-4]
        )


def _accept(p, q, draft, budget, u0, u1):
    got = sample_accept(p, q, draft, budget, [], torch.tensor([u0, u1], dtype=torch.float64)).tolist()
    assert got[2] == min(budget, len(draft)) and got[3:] == draft.tolist()
    return got[0], got[1]


@pytest.mark.parametrize("count", [0, 1, 2, 3])
def test_sample_accept_follows_sample_verify(count):
    """m = 3, v = 5: P(s) from a grid of u0 and P(extra | s) from a grid of u1 against the torch rule's
    acceptance-length distribution and residual (testable drafts: the first `count`, the budget)."""
    m, v = 3, 5
    gen = torch.Generator().manual_seed(count)
    p = torch.softmax(2 * torch.randn(m + 1, v, generator=gen), -1)
    q = torch.softmax(2 * torch.randn(m, v, generator=gen), -1)
    draft = torch.tensor([0, 3, 1])
    q[1, 3] = p[1, 3] / 2  # one draft certain to be accepted (a = 1), the others not
    a = acceptance_probs(p[:m], q, draft) * (torch.arange(m) < count)
    want_s = acceptance_length_distribution(a.double())
    grid = (torch.arange(4000, dtype=torch.float64) + 0.5) / 4000
    got_s = torch.zeros(m + 1, dtype=torch.float64)
    for u in grid.tolist():
        got_s[_accept(p, q, draft, count, u, 0.5)[0]] += 1 / len(grid)
    assert torch.allclose(got_s, want_s, atol=1e-3), (got_s, want_s)
    for s in range(m + 1):
        if want_s[s] < 1e-3:
            continue
        u0 = float(want_s[:s].sum() + want_s[s] / 2)  # inside s's interval of the u0 axis
        q_s = q[s] if s < count else torch.zeros(v)
        want = residual_distribution(p[s].double(), q_s.double())
        got = torch.zeros(v, dtype=torch.float64)
        for u in grid.tolist():
            got_s_, extra = _accept(p, q, draft, count, u0, u)
            assert got_s_ == s
            got[extra] += 1 / len(grid)
        assert torch.allclose(got, want, atol=1e-3), (s, got, want)


def test_sampled_generation_runs_the_native_kernels(monkeypatch):
    """A sampled generation of a btree head on the CPU goes through the native draft and accept;
    with them off it runs the torch paths (both valid draws, each the same for the same seed)."""
    import mtpc.speculative.loop as loop
    from experiments.training.module import build_backbone
    from mtpc import MtpcModel

    model = MtpcModel.from_components(build_backbone("tiny", 0), {"kind": "btree", "window": 4, "rank": 4})
    calls = []
    real = loop.sample_accept
    monkeypatch.setattr(loop, "sample_accept", lambda *a: calls.append(1) or real(*a))
    a = model.generate("Hello there", max_new_tokens=24, mode="sample", seed=3, ban_eos=True)
    assert calls and len(a.ids) == 24
    assert torch.equal(
        model.generate("Hello there", max_new_tokens=24, mode="sample", seed=3, ban_eos=True).ids, a.ids
    )
    calls.clear()
    monkeypatch.setenv("MTPC_NATIVE_CYCLE", "0")
    b = model.generate("Hello there", max_new_tokens=24, mode="sample", seed=3, ban_eos=True)
    assert not calls and len(b.ids) == 24


def test_sample_accept_counts_testable_drafts_as_the_device_rule():
    from mtpc.speculative.acceptance import testable_drafts as testable

    p, q = torch.full((4, 5), 0.2), torch.full((3, 5), 0.2)
    u = torch.tensor([0.5, 0.5], dtype=torch.float64)
    for draft in ([1, 2, 3], [2, 2, 0], [4, 1, 2]):
        d = torch.tensor(draft)
        for budget in range(-1, 5):
            for stops in ([], [2], [1, 4]):
                got = sample_accept(p, q, d, budget, stops, u).tolist()
                assert got[2] == int(testable(d, budget, stops).sum()), (draft, budget, stops)


def test_greedy_accept_native_equals_the_torch_rule():
    """Random logits with ties (integers), banned ids, budgets, stop ids, a NaN row: the native call
    gives greedy_target's choices and greedy_accept's s and count."""
    from mtpc.kernels import greedy_accept_native
    from mtpc.speculative.acceptance import greedy_accept, greedy_target

    gen = torch.Generator().manual_seed(5)
    m, v, checked = 4, 6, 0
    for trial in range(200):
        logits = torch.randint(0, 3, (m + 1, v), generator=gen).float()
        if trial % 50 == 0:
            logits[1, 2] = float("nan")
        banned = [[], [0], [1, 5]][trial % 3]
        targets = greedy_target(logits, banned or None).tolist()
        # drafts that follow the choices for a while, then may not
        draft = [t if torch.rand(1, generator=gen) < 0.7 else (t + 1) % v for t in targets[:m]]
        for budget in (0, 2, m):
            for stops in ([], [targets[0]]):
                got = greedy_accept_native(logits, torch.tensor(draft), budget, stops, banned).tolist()
                s, count = greedy_accept(targets, draft, budget, stops)
                assert got == [s, targets[s], count, *draft], (trial, budget, stops)
                checked += 1
    assert checked == 1200


@pytest.mark.slow
@pytest.mark.parametrize("known", [False, True])
def test_native_sampling_cycle_matches_plain_distribution(known, monkeypatch):
    """test_speculative_sampling's chi-square check in float32, where the cycle runs the native
    sampled draft and the native accept (their calls counted): N seeded generate(mode="sample")
    runs of a confident, mismatched btree head against the exact plain distribution of the first
    T bytes; an accept given the wrong draft probabilities is flagged (the check can fail)."""
    import mtpc.kernels as kernels
    import mtpc.speculative.loop as loop
    from mtpc import MtpcModel
    from tests.mtpc.test_speculative import RANK, _peaked_backbone
    from tests.mtpc.test_speculative_sampling import (
        ALPHA,
        N_RUNS,
        _exact_plain,
        _sampled_counts,
        chi_square_pvalue,
    )

    calls = {"draft": 0, "accept": 0}
    draft, accept = kernels.btree_sample_draft, loop.sample_accept

    def counted_draft(*a):
        calls["draft"] += 1
        return draft(*a)

    def counted_accept(*a):
        calls["accept"] += 1
        return accept(*a)

    monkeypatch.setattr(kernels, "btree_sample_draft", counted_draft)
    monkeypatch.setattr(loop, "sample_accept", counted_accept)
    bb = _peaked_backbone(0, vocab=4, scale=2.0, dtype=torch.float32)
    cfg = {"kind": "btree", "window": 3, "rank": RANK["btree"], "seed": 1, "known_byte": known}
    m = MtpcModel.from_components(bb, cfg)
    with torch.no_grad():
        m.head.leaf_weight.mul_(10.0)
    exact = _exact_plain(bb)
    assert chi_square_pvalue(_sampled_counts(m, "keep"), exact, N_RUNS) > ALPHA
    assert calls["draft"] >= N_RUNS and calls["accept"] >= N_RUNS
    # a planted error: the accept told the draft was uniform (it is peaked) is flagged
    monkeypatch.setattr(loop, "sample_accept", lambda p, q, *a: accept(p, torch.full_like(q, 0.25), *a))
    assert chi_square_pvalue(_sampled_counts(m, "keep"), exact, N_RUNS) < ALPHA
