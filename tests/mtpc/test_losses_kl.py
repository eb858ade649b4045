"""Tests for the distillation term of mtpc/losses.py: beta KL(p_j || q_j) + (1 - beta) CE against a
direct per-window computation in float64 (public circuit conditionals, one window at a time, with
its own autograd graph for the gradients), for every circuit kind and both leaf forms, naive and
chunked; the teacher's alignment (p_j from position t + j - 1), temperature, beta = 0 against the
plain loss, and argument errors."""

from __future__ import annotations

import math

import pytest
import torch

from mtpc.heads import HeadConfig, MtpcHead
from mtpc.losses import window_loss
from mtpc.names import CIRCUIT_KINDS

FORMS = [(kind, 0) for kind in CIRCUIT_KINDS] + [("cp", 2), ("hmm", 2), ("btree", 2)]


def make_head(kind, n=3, r=2, v=5, d=4, dtype=torch.float64, delta=0, known=False):
    head = MtpcHead(
        HeadConfig(kind, n, 1 if kind == "ff" else r, v, d, leaf_delta_rank=delta, known_byte=known)
    ).to(dtype)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0.0, 0.7)
    return head


def make_batch(v=5, d=4, dtype=torch.float64):
    """Two rows of 11: row 0 = docs 0 | 1 | padding, row 1 = one doc; mixed score mask; a teacher."""
    docs = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1, -1, -1], [0] * 11])
    ids = torch.randint(0, v, docs.shape)
    score = torch.rand(docs.shape) < 0.6
    score[0, 6] = False
    e = torch.randn(*docs.shape, d, dtype=dtype)
    teacher = 2.0 * torch.randn(*docs.shape, v, dtype=dtype)
    return e, ids, score, docs, teacher


def direct(head, e, ids, score, docs, teacher, gamma, beta, temperature):
    """The loss from its definition, one window at a time: differentiable, plus (n,) KL and NLL terms
    (a known-byte head reads c = x_{t+1}; position 1 unscored: NaN)."""
    n, known = head.config.window, head.config.known_byte
    B, S = ids.shape
    loss = torch.zeros((), dtype=torch.float64)
    per_kl, per_nll = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    if known:
        per_kl[0] = per_nll[0] = math.nan
    for j in range(2 if known else 1, n + 1):
        total, total_kl, total_nll, examples = 0.0, 0.0, 0.0, 0
        for b in range(B):
            terms = []
            for t in range(S):
                m = 0  # present targets: same document, inside the row
                while m < n and t + m + 1 < S and docs[b, t] >= 0 and docs[b, t + m + 1] == docs[b, t]:
                    m += 1
                if j > m or not score[b, t + j]:
                    continue
                window = torch.zeros(n, dtype=torch.long)
                window[:m] = ids[b, t + 1 : t + m + 1]
                q = head(e[b, t], ids[b, t + 1] if known else None)
                q_row = head.circuit.conditionals(q, window)[j - 1]  # (v,) log q_j(. | x_<j)
                log_p = torch.log_softmax(teacher[b, t + j - 1] / temperature, dim=-1)  # (v,)
                kl = (log_p.exp() * (log_p - q_row)).sum()
                nll = -q_row[ids[b, t + j]]
                terms.append((beta * kl + (1 - beta) * nll, kl.detach(), nll.detach()))
            if terms:
                total = total + sum(x[0] for x in terms) / len(terms)
                total_kl += sum(x[1] for x in terms) / len(terms)
                total_nll += sum(x[2] for x in terms) / len(terms)
                examples += 1
        if examples:
            loss = loss + gamma ** (j - 1) * total / examples
            per_kl[j - 1], per_nll[j - 1] = total_kl / examples, total_nll / examples
    return loss, per_kl, per_nll


def grads_of(head, lin, e0, fn):
    head.zero_grad()
    lin.zero_grad()
    out = fn(lin(e0))  # e itself requires grad, as with a LoRA draft top
    (out if isinstance(out, torch.Tensor) else out.loss).backward()
    g = {k: p.grad.clone() for k, p in head.named_parameters()}
    g.update({f"lin.{k}": p.grad.clone() for k, p in lin.named_parameters()})
    return out, g


@pytest.mark.parametrize(
    "kind, delta, known", [(k, d, False) for k, d in FORMS] + [("cp", 0, True), ("btree", 2, True)]
)
def test_matches_direct_per_window_computation_loss_stats_and_gradients(kind, delta, known):
    head = make_head(kind, delta=delta, known=known)
    e, ids, score, docs, teacher = make_batch()
    lin = torch.nn.Linear(4, 4).double()
    beta, temp, gamma = 0.6, 0.7, 0.8
    ref, ref_g = grads_of(
        head, lin, e, lambda x: direct(head, x, ids, score, docs, teacher, gamma, beta, temp)[0]
    )
    with torch.no_grad():
        _, per_kl, per_nll = direct(head, lin(e), ids, score, docs, teacher, gamma, beta, temp)
    assert per_kl.nan_to_num(1.0).min() > 0 and per_nll.nan_to_num(1.0).min() > 0
    tol = dict(rtol=1e-10, atol=1e-10)
    for chunk in (None, 1, 4, 1000):
        out, g = grads_of(
            head,
            lin,
            e,
            lambda x, c=chunk: window_loss(
                head,
                x,
                ids,
                score,
                docs,
                gamma=gamma,
                chunk_size=c,
                teacher_logits=teacher,
                kl_beta=beta,
                kl_temperature=temp,
            ),
        )
        where = f"{kind} delta={delta} chunk={chunk}"
        torch.testing.assert_close(out.loss.detach(), ref.detach(), **tol, msg=lambda m, w=where: f"{w}: {m}")
        torch.testing.assert_close(
            out.per_position_kl, per_kl, **tol, equal_nan=True, msg=lambda m, w=where: f"{w}: {m}"
        )
        torch.testing.assert_close(
            out.per_position_nll, per_nll, **tol, equal_nan=True, msg=lambda m, w=where: f"{w}: {m}"
        )
        torch.testing.assert_close(out.window_kl, per_kl.nansum(), **tol)
        for name, ref_grad in ref_g.items():
            assert ref_grad.abs().sum() > 0 or name.startswith("sum") and kind == "ff"
            torch.testing.assert_close(
                g[name], ref_grad, **tol, msg=lambda m, nm=name, w=where: f"{w} {nm}: {m}"
            )


@pytest.mark.parametrize("kind, delta", [("cp", 0), ("btree", 0), ("hmm", 2)])
def test_float32_chunked_matches_naive(kind, delta):
    head = make_head(kind, n=4, r=3, v=7, d=6, dtype=torch.float32, delta=delta)
    e, ids, score, docs, teacher = make_batch(v=7, d=6, dtype=torch.float32)
    lin = torch.nn.Linear(6, 6)
    run = lambda chunk: grads_of(
        head,
        lin,
        e,
        lambda x: window_loss(
            head, x, ids, score, docs, chunk_size=chunk, teacher_logits=teacher, kl_beta=0.5
        ),
    )
    (ref, ref_g), (out, g) = run(None), run(5)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.per_position_kl, ref.per_position_kl, rtol=1e-5, atol=1e-6)
    for name, ref_grad in ref_g.items():
        torch.testing.assert_close(
            g[name], ref_grad, rtol=1e-4, atol=1e-6, msg=lambda m, nm=name: f"{nm}: {m}"
        )


def test_teacher_at_position_t_plus_j_minus_1():
    """An ff head whose leaf j reproduces the teacher's logits at t + j - 1 has zero KL at every j."""
    n, v, d = 3, 5, 4
    head = make_head("ff", n=n, v=v, d=d)
    e, ids, score, docs, _ = make_batch(v=v, d=d)
    # e is constant along each row, so leaf logits W[j] e_t do not depend on t; the teacher at
    # position s predicts with W[j] where s = t + j - 1 for every t: the same for all s only if all W[j]
    # agree, so give every position the same unembedding and check KL = 0, then break one position.
    e = e[:, :1].expand_as(e).contiguous()
    with torch.no_grad():
        head.leaf_weight.copy_(head.leaf_weight[:1].expand_as(head.leaf_weight))
    teacher = torch.einsum("bsd,vd->bsv", e, head.leaf_weight[0, 0])  # (B, S, v)
    out = window_loss(head, e, ids, score, docs, teacher_logits=teacher, kl_beta=1.0)
    torch.testing.assert_close(out.per_position_kl, torch.zeros(n, dtype=torch.float64), atol=1e-12, rtol=0)
    # now the teacher differs only at the last position of each row: KL appears exactly where a
    # window reads it (j with t + j - 1 = S - 1 for a scored, present target)
    teacher2 = teacher.clone()
    teacher2[1, 8] += torch.randn(v, dtype=torch.float64)
    out2 = window_loss(head, e, ids, score, docs, teacher_logits=teacher2, kl_beta=1.0)
    changed = (out2.per_position_kl - out.per_position_kl).abs() > 1e-9
    # row 1 is one document: position 8 predicts x_9; windows t = 8, 7, 6 read it at j = 1, 2, 3
    assert changed.tolist() == [bool(score[1, 9])] * n


def test_beta_zero_is_the_plain_loss_and_temperature_scales_the_teacher():
    head = make_head("btree", n=4, r=3)
    e, ids, score, docs, teacher = make_batch()
    plain = window_loss(head, e, ids, score, docs, chunk_size=4)
    with_teacher = window_loss(head, e, ids, score, docs, chunk_size=4, teacher_logits=teacher, kl_beta=0.0)
    torch.testing.assert_close(with_teacher.loss, plain.loss, rtol=1e-12, atol=1e-12)
    assert plain.per_position_kl is None and with_teacher.per_position_kl.min() > 0
    hot = window_loss(
        head, e, ids, score, docs, chunk_size=4, teacher_logits=teacher, kl_beta=1.0, kl_temperature=0.5
    )
    scaled = window_loss(head, e, ids, score, docs, chunk_size=4, teacher_logits=teacher / 0.5, kl_beta=1.0)
    torch.testing.assert_close(hot.loss, scaled.loss, rtol=1e-12, atol=1e-12)


def test_no_grad_evaluation_and_frozen_teacher():
    head = make_head("hmm", n=4)
    e, ids, score, docs, teacher = make_batch()
    teacher.requires_grad_(True)
    out = window_loss(head, e, ids, score, docs, chunk_size=3, teacher_logits=teacher, kl_beta=0.3)
    out.loss.backward()
    assert teacher.grad is None
    with torch.no_grad():
        ev = window_loss(head, e, ids, score, docs, chunk_size=3, teacher_logits=teacher, kl_beta=0.3)
    assert not ev.loss.requires_grad
    torch.testing.assert_close(ev.loss, out.loss.detach())
    torch.testing.assert_close(ev.per_position_kl, out.per_position_kl)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(teacher=None, beta=0.5), r"^teacher_logits: kl_beta = 0.5 > 0 needs"),
        (
            dict(teacher=torch.zeros(2, 11, 4)),
            r"^teacher_logits: expected a floating tensor \(B, S, v\) = \(2, 11, 5\)",
        ),
        (dict(teacher=torch.zeros(2, 11, 5, dtype=torch.long)), r"^teacher_logits: expected a floating"),
        (dict(beta=1.5), r"^kl_beta: expected a number in \[0, 1\]"),
        (dict(temperature=0.0), r"^kl_temperature: expected a finite number > 0"),
        (dict(temperature=float("inf")), r"^kl_temperature: expected"),
    ],
)
def test_bad_distillation_arguments_name_the_argument(change, match):
    head = make_head("cp")
    e, ids, score, docs, teacher = make_batch()
    args = dict(teacher=teacher, beta=0.5, temperature=1.0) | change
    with pytest.raises(ValueError, match=match):
        window_loss(
            head,
            e,
            ids,
            score,
            docs,
            teacher_logits=args["teacher"],
            kl_beta=args["beta"],
            kl_temperature=args["temperature"],
        )
