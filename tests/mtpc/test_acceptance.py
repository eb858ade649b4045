"""Exactness of the acceptance rule and of the keep / drop cycles, by exact enumeration.

Every random choice goes through a Chooser, so `enumerate_outcomes` walks all random paths and
gives exact output distributions (float64). Each exactness check has a negative control that
shows the same check fails on a wrong rule (drop, or resampling from p instead of the residual).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from mtpc.speculative.acceptance import (
    TorchChooser,
    acceptance_length_distribution,
    acceptance_probs,
    greedy_accept,
    greedy_verify,
    residual_distribution,
    sample_verify,
    target_probs,
)
from mtpc.speculative.acceptance import testable_drafts as _testable  # not a test
from mtpc.speculative.loop import DecodeConfig, plain_decode, speculative_decode
from tests.speculative_helpers import (
    MarkovEngine,
    dense_conditionals,
    dense_drafter,
    enumerate_outcomes,
    markov_sequence_distribution,
    total_variation,
)


def _random_probs(shape, gen, peak=1.0, zeros=False):
    logits = peak * torch.randn(shape, generator=gen, dtype=torch.float64)
    if zeros:  # some exact zeros, as top-p or a banned id produce
        logits[torch.rand(shape, generator=gen, dtype=torch.float64) < 0.25] = float("-inf")
        logits[..., 0] = logits[..., 0].nan_to_num(neginf=0.0)
    return torch.softmax(logits, -1)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
@pytest.mark.parametrize("top_p", [0.3, 0.9, 1.0])
def test_target_probs_matches_transformers_warpers(temperature, top_p):
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    logits = torch.randn(5, 40, dtype=torch.float64) * 2
    ours = target_probs(logits, temperature, top_p)
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    torch.testing.assert_close(ours, torch.softmax(scores, -1), atol=1e-12, rtol=0)


def test_target_probs_bans_one_id_and_validates():
    p = target_probs(torch.zeros(4, dtype=torch.float64), banned=2)
    assert p[2] == 0 and torch.allclose(p.sum(), torch.tensor(1.0, dtype=torch.float64))
    with pytest.raises(ValueError, match="temperature"):
        target_probs(torch.zeros(3), temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        target_probs(torch.zeros(3), top_p=1.5)


def test_acceptance_length_distribution_by_brute_force():
    a = torch.tensor([0.3, 1.0, 0.6, 0.0, 0.9], dtype=torch.float64)
    brute = torch.zeros(6, dtype=torch.float64)
    for outcome in itertools.product([0, 1], repeat=5):
        p = torch.prod(torch.where(torch.tensor(outcome).bool(), a, 1 - a))
        s = outcome.index(0) if 0 in outcome else 5
        brute[s] += p
    torch.testing.assert_close(acceptance_length_distribution(a), brute, atol=1e-15, rtol=0)


@pytest.mark.parametrize("seed", range(4))
def test_one_position_marginal_is_p(seed):
    """sum_d q(d) [a(d) 1{y=d} + (1 - a(d)) r(y)] == p(y), including zeros in p and q."""
    gen = torch.Generator().manual_seed(seed)
    v = 6
    for p, q in [
        (_random_probs(v, gen, 2.0), _random_probs(v, gen, 2.0)),
        (_random_probs(v, gen, 2.0, zeros=True), _random_probs(v, gen, 2.0, zeros=True)),
        (_random_probs(v, gen), None),  # q == p: residual empty, never used
    ]:
        q = p.clone() if q is None else q
        out = torch.zeros(v, dtype=torch.float64)
        r = residual_distribution(p, q)
        for d in range(v):
            if q[d] == 0:
                continue
            a = acceptance_probs(p[None], q[None], torch.tensor([d]))[0]
            out[d] += q[d] * a
            out += q[d] * (1 - a) * r
        torch.testing.assert_close(out, p, atol=1e-14, rtol=0)


def _window_program(p_joint, q_joint, rule):
    """Draft m tokens from q_joint, verify against the prefix-dependent target p_joint ((v,)*(m+1)),
    then complete the emitted tokens to length m+1 by plain sampling from p: the result must be
    distributed exactly as p_joint."""
    m = q_joint.dim()

    def program(choose):
        draft = []
        for i in range(m):
            row = dense_conditionals(q_joint, draft + [0] * (m - i))[i].exp()
            draft.append(choose(row))
        q_rows = dense_conditionals(q_joint, draft).exp()  # (m, v)
        p_rows = dense_conditionals(p_joint, draft + [0]).exp()  # (m+1, v) rows valid along the draft
        s, extra = rule(torch.tensor(draft), p_rows, q_rows, choose)
        out = draft[:s] + [extra]
        while len(out) < m + 1:
            out.append(choose(dense_conditionals(p_joint, out + [0] * (m + 1 - len(out)))[len(out)].exp()))
        return tuple(out)

    return program


def _joint_dict(joint):
    return {idx: float(joint[idx]) for idx in itertools.product(*[range(s) for s in joint.shape])}


def _resample_from_p_rule(draft, p, q, choose):
    """A wrong rule (the negative control): after a rejection, draw from p instead of the residual."""
    m = draft.shape[0]
    s = choose(acceptance_length_distribution(acceptance_probs(p[:m], q, draft)))
    return s, choose(p[s])


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("zeros", [False, True])
def test_sample_verify_is_exact_by_enumeration(seed, zeros):
    gen = torch.Generator().manual_seed(seed)
    v, m = 3, 2
    p_joint = _random_probs(v ** (m + 1), gen, 2.5, zeros).reshape((v,) * (m + 1))
    q_joint = _random_probs(v**m, gen, 1.0).reshape((v,) * m)
    got = enumerate_outcomes(_window_program(p_joint, q_joint, sample_verify))
    assert total_variation(got, _joint_dict(p_joint)) < 1e-12
    wrong = enumerate_outcomes(_window_program(p_joint, q_joint, _resample_from_p_rule))
    assert total_variation(wrong, _joint_dict(p_joint)) > 1e-3  # the check can fail


def test_greedy_verify_all_drafts():
    v, m = 3, 3
    target = torch.tensor([2, 0, 1, 1])  # argmax of each verifier row along any draft prefix
    for draft in itertools.product(range(v), repeat=m):
        s, extra = greedy_verify(torch.tensor(draft), target)
        expect = next((j for j in range(m) if draft[j] != target[j]), m)
        assert (s, extra) == (expect, int(target[expect]))


def test_greedy_accept_on_the_host_equals_the_device_rule():
    """Every draft over 3 symbols, every budget and stop set: the loop's host rule gives the device
    rule's (greedy_verify over testable_drafts) accepted count and testable count."""
    v, m = 3, 3
    target = [2, 0, 1, 1]
    checked = 0
    for draft in itertools.product(range(v), repeat=m):
        for budget in range(-1, m + 2):
            for stops in ([], [0], [1, 2]):
                d = torch.tensor(draft)
                ok = _testable(d, budget, stops)
                s_dev, _ = greedy_verify(d, torch.tensor(target), ok)
                s, count = greedy_accept(target, list(draft), budget, stops)
                assert (s, count) == (int(s_dev), int(ok.sum())), (draft, budget, stops)
                checked += 1
    assert checked == v**m * (m + 3) * 3


# ------------------------------------------------------------- whole cycles on a Markov target

# a peaked 3-symbol chain and a mismatched draft: the setting where dropping the token biases
TRANSITION = torch.tensor([[0.80, 0.15, 0.05], [0.05, 0.15, 0.80], [0.60, 0.30, 0.10]], dtype=torch.float64)


def _markov_draft_head(n, seed=0, support=2):
    """theta = a window joint that depends on the last byte (mismatched with the chain).

    Sparse, to keep the enumeration small: for each first byte only `support` random
    continuations have mass (every first byte has some, so any prefix [c] is defined).
    """
    gen = torch.Generator().manual_seed(seed)
    tables = _random_probs((3, 3**n), gen, 1.0)  # (last byte, window)
    mask = torch.zeros(3, 3, 3 ** (n - 1), dtype=torch.bool)  # (last byte, x_1, rest)
    for b, x1 in itertools.product(range(3), range(3)):
        mask[b, x1, torch.randperm(3 ** (n - 1), generator=gen)[:support]] = True
    tables = tables * mask.reshape(3, -1)
    tables = (tables / tables.sum(-1, keepdim=True)).reshape((3,) + (3,) * n)

    def head_fn(hidden, c):  # hidden: one-hot of the last byte with state; c: the known byte (unused)
        return {"joint": tables[int(hidden.argmax())]}

    return head_fn


def _markov_program(n, extra_token, mode="sample", T=3, prompt=(0, 2), temperature=1.0, top_p=1.0):
    cfg = DecodeConfig(
        max_new_tokens=T, mode=mode, extra_token="keep" if extra_token == "plain" else extra_token,
        temperature=temperature, top_p=top_p,
    )  # fmt: skip
    head_fn = _markov_draft_head(n)

    def program(choose):
        engine = MarkovEngine(TRANSITION)
        if extra_token == "plain":
            out, _ = plain_decode(engine, torch.tensor(prompt), cfg, choose)
        else:
            out, _ = speculative_decode(
                engine, head_fn, dense_drafter(choose), n, torch.tensor(prompt), cfg, choose
            )
        assert engine.tokens[: len(prompt)] == list(prompt)
        return tuple(out)

    return program


def test_markov_keep_is_exact_and_drop_is_biased():
    """DESIGN section 3: keep reproduces the target exactly; drop does not (TV ~0.1).

    Measured here: TV(keep) ~ 4e-17 on 3 bytes; TV(drop) = 0.092 on 2 bytes (0.108 on 3 bytes,
    left out because its enumeration takes ~20 s).
    """
    target3 = markov_sequence_distribution(TRANSITION, first=2, length=3)
    plain = enumerate_outcomes(_markov_program(3, "plain"))
    assert total_variation(plain, target3) < 1e-12  # the enumerator itself
    keep = enumerate_outcomes(_markov_program(3, "keep"))
    assert total_variation(keep, target3) < 1e-12
    target2 = markov_sequence_distribution(TRANSITION, first=2, length=2)
    drop = enumerate_outcomes(_markov_program(3, "drop", T=2))
    assert total_variation(drop, target2) > 0.05


@pytest.mark.parametrize("extra_token", ["keep", "drop"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_markov_greedy_equals_plain_greedy(extra_token, n):
    plain = enumerate_outcomes(_markov_program(n, "plain", mode="greedy", T=7))
    spec = enumerate_outcomes(_markov_program(n, extra_token, mode="greedy", T=7))
    assert plain == spec and len(plain) == 1


def test_markov_keep_is_exact_for_several_windows():
    target = markov_sequence_distribution(TRANSITION, first=2, length=3)
    for n in (2, 4):
        keep = enumerate_outcomes(_markov_program(n, "keep"))
        assert total_variation(keep, target) < 1e-12


def test_markov_keep_is_exact_with_temperature_and_top_p():
    """Temperature and top-p act on p only; the output follows the tempered, truncated chain exactly."""
    kw = {"temperature": 0.6, "top_p": 0.8}
    plain = enumerate_outcomes(_markov_program(3, "plain", **kw))
    keep = enumerate_outcomes(_markov_program(3, "keep", **kw))
    assert total_variation(keep, plain) < 1e-12
    untempered = markov_sequence_distribution(TRANSITION, first=2, length=3)
    assert total_variation(plain, untempered) > 0.05  # the options did change the target


# ------------------------------------------------------------- the end of a generation

# a deterministic greedy path 1 -> 2 -> 0 -> 0 ...: with EOS = 0 allowed it stops inside a window
EOS_CHAIN = torch.tensor([[0.80, 0.10, 0.10], [0.05, 0.15, 0.80], [0.60, 0.30, 0.10]], dtype=torch.float64)


def _oracle_drafter(transition):
    """Drafts the chain's own greedy path from c (every draft matches greedy verification)."""

    def draft(theta, prefix, greedy):
        x = prefix.tolist()
        while len(x) < theta["n"]:
            x.append(int(transition[x[-1]].argmax()))
        return torch.tensor(x), transition[torch.tensor([0] + x[:-1])].log()  # rows: the chain's conditionals

    return draft


def _oracle_run(n, T, eos_id=None, prompt=(0, 2)):
    cfg = DecodeConfig(max_new_tokens=T, mode="greedy", eos_id=eos_id)
    return speculative_decode(
        MarkovEngine(EOS_CHAIN),
        lambda h, c: {"n": n},
        _oracle_drafter(EOS_CHAIN),
        n,
        torch.tensor(prompt),
        cfg,
        lambda p: int(p.argmax()),
    )


def test_windows_stop_at_the_byte_budget():
    """Every draft matches: with 5 bytes left after the prefill byte the cycles test only what
    they can emit (n = 4: 3 drafts, then a window capped at 0 drafts), so the counts add up to the
    bytes returned. Before the cap the last cycle counted 3 accepted drafts it then truncated."""
    out, st = _oracle_run(n=4, T=6, prompt=(0, 1))  # greedy path from 1: c = 2, then 0 0 0 ...
    assert out == [2, 0, 0, 0, 0, 0]
    assert st.accepted == [3, 0] and st.emitted == [4, 1]
    assert st.tested_at == [0, 1, 1, 1] and st.accepted_at == [0, 1, 1, 1]
    assert sum(st.accepted) + len(st.accepted) == st.decode_generated == sum(st.emitted) == 5


def test_windows_stop_at_an_allowed_eos():
    """EOS = 0 is the first draft after c = 2: it is accepted, the generation ends there and
    nothing after it is tested (greedy verification used to match on past the EOS: s = 3)."""
    out, st = _oracle_run(n=4, T=10, eos_id=0, prompt=(0, 1))
    assert out == [2, 0]
    assert st.accepted == [1] and st.emitted == [1] and st.tested_at == [0, 1, 0, 0]
    out, st = _oracle_run(n=4, T=10, eos_id=None, prompt=(0, 1))  # EOS not a stop: windows run to the budget
    assert len(out) == 10 and st.accepted == [3, 3, 0]


@pytest.mark.parametrize("eos_id", [None, 0])
def test_sampled_counts_are_of_emitted_bytes_on_every_path(eos_id):
    """Every random path of keep sampling with a window longer than the budget (n = 4, T = 3):
    accepted drafts + cycles (one extra token each, unless an accepted EOS ended the cycle) = the
    bytes the cycles returned; tests stop at the budget and at the first EOS."""
    cfg = DecodeConfig(max_new_tokens=3, mode="sample", eos_id=eos_id)
    head_fn = _markov_draft_head(4)
    paths = []

    def program(choose):
        out, st = speculative_decode(MarkovEngine(TRANSITION), head_fn, dense_drafter(choose), 4,
                                     torch.tensor((0, 2)), cfg, choose)  # fmt: skip
        paths.append((out, st))
        return tuple(out)

    enumerate_outcomes(program)
    assert len(paths) > 20 and any(sum(st.accepted) >= 1 for _, st in paths)
    for out, st in paths:
        # only the last cycle may end without its extra token: on an accepted EOS
        no_extra = int(bool(st.accepted) and eos_id is not None and st.emitted[-1] == st.accepted[-1] >= 1)
        assert no_extra == 0 or out[-1] == eos_id
        assert sum(st.emitted) == st.decode_generated == len(out) - 1
        assert sum(st.accepted) + len(st.accepted) - no_extra == st.decode_generated, (out, st.accepted)
        assert sum(st.tested_at) <= sum(st.accepted) + len(st.accepted)
        if eos_id is not None:
            assert eos_id not in out[:-1]  # stops at the first EOS


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_production_chooser_draws_what_multinomial_draws_without_calling_it(dtype, monkeypatch):
    """TorchChooser is the exponential race torch.multinomial(probs, 1) runs: the same draws from the
    same generator state (zeros in probs included), without multinomial itself, whose validity check
    reads the device back (and so cannot be captured in a CUDA graph)."""
    cases = []
    for seed in range(300):
        g = torch.Generator().manual_seed(seed)
        v = (2, 5, 320)[seed % 3]
        p = torch.softmax(3 * torch.randn(v, generator=g, dtype=dtype), 0)
        if seed % 4 == 0:
            p[: v // 2] = 0
            p = p / p.sum()
        cases.append(p)
    want = []
    g = torch.Generator().manual_seed(11)
    for p in cases:
        want += [int(torch.multinomial(p, 1, generator=g)[0]) for _ in range(4)]

    def refuse(*a, **k):
        raise AssertionError("TorchChooser called torch.multinomial")

    monkeypatch.setattr(torch, "multinomial", refuse)
    choose = TorchChooser(torch.Generator().manual_seed(11))
    got = []
    for p in cases:
        draws = [choose(p) for _ in range(4)]
        assert all(d.dim() == 0 and d.dtype == torch.long for d in draws)
        got += [int(d) for d in draws]
    assert got == want
    assert all(p[i] > 0 for p, i in zip([c for c in cases for _ in range(4)], got, strict=True))
