"""Tests for mtpc/losses.py: the window loss against a direct per-position computation from
enumerated window distributions, masking / marginalisation, and the chunked autograd Function
against the naive version (loss, statistics and gradients for head parameters and e). Both also
on known-byte heads (c = x_{t+1} read by the head, position 1 not scored)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from mtpc.heads import HeadConfig, MtpcHead
from mtpc.losses import default_gamma, window_loss, window_targets
from mtpc.names import CIRCUIT_KINDS

KINDS = CIRCUIT_KINDS


def make_head(kind, n=3, r=2, v=3, d=4, dtype=torch.float64, **kw):
    head = MtpcHead(HeadConfig(kind, n, 1 if kind == "ff" else r, v, d, **kw)).to(dtype)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0.0, 0.7)
    return head


def make_batch(v=3, d=4, dtype=torch.float64):
    """Two rows of 11: row 0 = docs 0 | 1 | padding, row 1 = one doc; mixed score mask."""
    docs = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1, -1, -1], [0] * 11])
    ids = torch.randint(0, v, docs.shape)
    score = torch.rand(docs.shape) < 0.6
    score[0, 6] = False
    e = torch.randn(*docs.shape, d, dtype=dtype)
    return e, ids, score, docs


def reference(head, e, ids, score, docs, gamma):
    """Loss terms straight from the definition, one window at a time, by enumeration (a known-byte
    head reads c = x_{t+1} and is not scored at position 1: NaN there)."""
    n, v, known = head.config.window, head.config.vocab, head.config.known_byte
    B, S = ids.shape
    windows = torch.tensor(list(itertools.product(range(v), repeat=n)))
    per, joints = [], {}
    for j in range(1, n + 1):
        if known and j == 1:
            per.append(math.nan)
            continue
        total, examples = 0.0, 0
        for b in range(B):
            terms = []
            for t in range(S):
                m = 0  # number of present targets, walking the window
                while m < n and t + m + 1 < S and docs[b, t] >= 0 and docs[b, t + m + 1] == docs[b, t]:
                    m += 1
                if j > m or not score[b, t + j]:
                    continue
                if (b, t) not in joints:
                    c = ids[b, t + 1] if known else None  # present: j <= m
                    params = {k: p.expand(len(windows), *p.shape) for k, p in head(e[b, t], c).items()}
                    joints[b, t] = head.circuit.log_prob(params, windows).view((v,) * n).detach()  # (v,)*n
                joint = joints[b, t]
                prefix = ids[b, t + 1 : t + j + 1].tolist()
                upto_j, upto_before = (
                    torch.logsumexp(joint[tuple(prefix[:k])].reshape(-1), 0)
                    if k
                    else torch.zeros((), dtype=joint.dtype)
                    for k in (j, j - 1)
                )
                terms.append(-(upto_j - upto_before).item())
            if terms:
                total += sum(terms) / len(terms)
                examples += 1
        per.append(total / max(examples, 1))
    per = torch.tensor([float(p) for p in per], dtype=torch.float64)
    return (per.nan_to_num(0.0) * gamma ** torch.arange(n, dtype=torch.float64)).sum(), per


@pytest.mark.parametrize("known", [False, True], ids=["e", "known-byte"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("chunk_size", [None, 4])
def test_matches_direct_per_position_computation(kind, chunk_size, known):
    head = make_head(kind, known_byte=known)
    e, ids, score, docs = make_batch()
    out = window_loss(head, e, ids, score, docs, gamma=0.7, chunk_size=chunk_size)
    loss, per = reference(head, e, ids, score, docs, 0.7)
    torch.testing.assert_close(out.per_position_nll, per, rtol=1e-10, atol=1e-10, equal_nan=True)
    torch.testing.assert_close(out.loss.detach(), loss, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out.window_nll, per.nansum())
    torch.testing.assert_close(out.bits_per_byte, per.nansum() / (2 if known else 3) / math.log(2))
    if known:  # position 1 is the head's input: never scored, said so
        assert out.valid_targets[0] == 0 and out.examples[0] == 0 and out.valid_targets[1:].sum() > 0


def test_window_targets_presence_is_a_prefix_cut_at_boundaries():
    docs = torch.tensor([[0, 0, 0, 1, 1, -1]])
    ids = torch.arange(6).unsqueeze(0)
    score = torch.tensor([[True, True, False, True, True, False]])
    x, present, scored = window_targets(ids, score, docs, 3)
    assert x[0, 0].tolist() == [1, 2, 3] and x[0, 4].tolist() == [5, 0, 0]
    assert present[0].int().tolist() == [[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert scored[0].int().tolist() == [[1, 0, 0], [0, 0, 0], [0, 0, 0], [1, 0, 0], [0, 0, 0], [0, 0, 0]]


def test_absent_targets_are_marginalised_and_unscored_ones_conditioned_on():
    head = make_head("cp", n=4)
    with torch.no_grad():
        head.leaf_weight.mul_(4.0)  # peaked components: the mixture posterior depends strongly on evidence
    e, ids, score, docs = make_batch()
    score[0, 5:] = False  # doc 1 of row 0 is never scored: its bytes only appear as absent targets
    base = window_loss(head, e, ids, score, docs).loss
    changed = ids.clone()
    changed[0, 5:] = (changed[0, 5:] + 1) % 3
    assert torch.equal(window_loss(head, e, changed, score, docs).loss, base)
    # an unscored byte inside a document is evidence for later targets of earlier windows
    score[1] = False
    score[1, 5] = True  # x_5 scored, x_4 (changed below) is only evidence
    base = window_loss(head, e, ids, score, docs).loss
    changed = ids.clone()
    changed[1, 4] = (changed[1, 4] + 1) % 3
    assert (window_loss(head, e, changed, score, docs).loss - base).abs() > 1e-3


def test_discount_default_and_combination():
    assert default_gamma(8) == 0.8 and default_gamma(9) == 0.9
    head = make_head("cp", n=4)
    e, ids, score, docs = make_batch()
    out = window_loss(head, e, ids, score, docs)
    torch.testing.assert_close(
        out.loss.detach(), (out.per_position_nll * 0.8 ** torch.arange(4.0).double()).sum()
    )
    # one example has no scored target at offset 4 here; L_4 averages over the other only
    assert (
        out.valid_targets.tolist()
        == torch.stack([window_targets(ids, score, docs, 4)[2].sum((0, 1))]).squeeze(0).tolist()
    )


def _grads(head, e_source, ids, score, docs, chunk_size):
    head.zero_grad()
    lin = e_source["lin"]
    lin.zero_grad()
    e = lin(e_source["e0"])  # stands for a LoRA draft top: e itself requires grad
    out = window_loss(head, e, ids, score, docs, chunk_size=chunk_size)
    out.loss.backward()
    grads = {k: p.grad.clone() for k, p in head.named_parameters()}
    grads.update({f"lin.{k}": p.grad.clone() for k, p in lin.named_parameters()})
    return out, grads


@pytest.mark.parametrize("kind, delta, known", [("ff", 0, False), ("cp", 0, False), ("hmm", 0, False),
                                               ("btree", 0, False), ("cp", 2, False), ("btree", 2, False),
                                               ("ff", 0, True), ("hmm", 0, True), ("btree", 2, True)])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_chunked_equals_naive_loss_and_gradients(kind, delta, dtype, known):
    """... known-byte heads too, where E's gradient reaches it through the head input u = e + E[c]."""
    head = make_head(kind, n=4, r=3, v=5, d=6, dtype=dtype, leaf_delta_rank=delta, known_byte=known)
    e, ids, score, docs = make_batch(v=5, d=6, dtype=dtype)
    source = {"lin": torch.nn.Linear(6, 6).to(dtype), "e0": e}
    ref, ref_grads = _grads(head, source, ids, score, docs, None)
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-6)
    for chunk in (1, 5, 1000):
        out, grads = _grads(head, source, ids, score, docs, chunk)
        torch.testing.assert_close(out.loss, ref.loss, **tol)
        torch.testing.assert_close(out.per_position_nll, ref.per_position_nll, **tol, equal_nan=True)
        for name, g in ref_grads.items():
            torch.testing.assert_close(
                grads[name], g, **tol, msg=lambda m, where=f"{name} chunk={chunk}": f"{where}: {m}"
            )
        assert all(g.abs().sum() > 0 for g in grads.values())


def test_frozen_unembedding_with_trainable_sums_and_double_backward():
    head = make_head("cp", n=4)
    e, ids, score, docs = make_batch()
    head.leaf_weight.requires_grad_(False)
    window_loss(head, e, ids, score, docs, chunk_size=None).loss.backward()
    ref = {k: p.grad.clone() for k, p in head.named_parameters() if p.requires_grad}
    head.zero_grad()
    out = window_loss(head, e, ids, score, docs, chunk_size=3)
    (2.0 * out.loss).backward(retain_graph=True)
    for k, p in head.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, 2.0 * ref[k])
    assert head.leaf_weight.grad is None
    with pytest.raises(RuntimeError, match="backward ran twice"):
        out.loss.backward()


def test_frozen_head_only_e_gets_gradients_and_no_grad_evaluation():
    head = make_head("cp", n=4)
    e, ids, score, docs = make_batch()
    head.requires_grad_(False)
    e.requires_grad_(True)
    window_loss(head, e, ids, score, docs, chunk_size=3).loss.backward()
    g = e.grad.clone()
    e.grad = None
    window_loss(head, e, ids, score, docs, chunk_size=None).loss.backward()
    torch.testing.assert_close(g, e.grad)
    head.requires_grad_(True)
    with torch.no_grad():
        a = window_loss(head, e, ids, score, docs, chunk_size=3)
    b = window_loss(head, e, ids, score, docs, chunk_size=None)
    assert not a.loss.requires_grad
    torch.testing.assert_close(a.loss, b.loss.detach())


def test_nothing_to_score_gives_zero_loss_with_zero_gradients():
    head = make_head("cp")
    e, ids, score, docs = make_batch()
    out = window_loss(head, e, ids, torch.zeros_like(score), docs, chunk_size=4)
    out.loss.backward()
    assert out.loss.item() == 0.0 and out.valid_targets.sum() == 0
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in head.parameters())


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(e=torch.randn(2, 11, 3)), r"^e: expected shape"),
        (dict(ids=torch.full((2, 11), 3)), r"^input_ids: expected ids in \[0, 3\)"),
        (dict(score=torch.ones(2, 11)), r"^score_mask: expected a bool"),
        (dict(docs=torch.zeros(2, 10, dtype=torch.long)), r"^doc_ids: expected"),
        (dict(gamma=1.5), r"^gamma: expected"),
        (dict(chunk_size=0), r"^chunk_size: expected"),
    ],
)
def test_bad_arguments_name_the_argument(change, match):
    head = make_head("cp")
    e, ids, score, docs = make_batch()
    args = dict(e=e, ids=ids, score=score, docs=docs, gamma=None, chunk_size=4) | change
    with pytest.raises(ValueError, match=match):
        window_loss(
            head,
            args["e"],
            args["ids"],
            args["score"],
            args["docs"],
            gamma=args["gamma"],
            chunk_size=args["chunk_size"],
        )


def test_next_byte_nll_scores_present_targets_only():
    from mtpc.losses import next_byte_nll

    g = torch.Generator().manual_seed(0)
    logits, ids = torch.randn(2, 5, 7, generator=g), torch.randint(0, 7, (2, 5), generator=g)
    doc = torch.tensor([[0, 0, 1, 1, -1], [0, 0, 0, 0, 0]])
    nll, present = next_byte_nll(logits, ids, doc)
    assert present.tolist() == [[True, False, True, False], [True] * 4]
    want = -torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0][present]
    torch.testing.assert_close(nll, want)
