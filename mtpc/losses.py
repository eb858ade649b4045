"""The discounted window loss of an MtPC head (DESIGN section 4), in bounded memory.

For every position t of every row the head reads e_t and scores the next n bytes:
L = sum_j gamma^(j-1) L_j with
L_j = mean over examples b (that have a scored target at offset j) of
      (1 / V_bj) sum_t -log q(x_{t+j} | x_{t+1..t+j-1}, e_t),
where the conditional is prefix_marginal_j - prefix_marginal_{j-1}, the sum runs over targets
that are present (same packed document, inside the row) and scored (assistant bytes), and V_bj
counts them. Present-but-unscored targets are conditioned on; absent targets are marginalised.

Presence is a prefix of the window: with `doc_ids` as `mtpc.data.pack` makes them (each document
one contiguous run of ids, padding = -1), once x_{t+j} leaves t's document (or the row) every
later target does too, so the first m present targets are scored from prefix marginals and the
rest never enter (exact marginalisation by the circuit). The code enforces the prefix with a
running product, so a non-contiguous doc_ids would only drop targets, never score a wrong one.

Known-byte heads (`HeadConfig.known_byte`): teacher-forced with c = x_{t+1}, the window's first
target, so the head reads e_t + E[x_{t+1}]; x_{t+1} stays in the window as evidence (conditioned on,
as the draft's prefix [c]) but is never scored (it is the head's input), so the loss and every
reported NLL run over positions 2..n: per_position_nll (and _kl) hold NaN at position 1, window_nll
sums positions 2..n and bits_per_byte divides by n - 1.

Distillation (optional, `teacher_logits` + `kl_beta`): for every window position j the full forward
KL(p_j || q_j) over all v bytes, where p_j = softmax(teacher_logits[t + j - 1] / kl_temperature) is
the frozen backbone's teacher-forced next-byte distribution (its STP logits from the same forward)
and q_j = q(x_{t+j} = . | x_{t+1..t+j-1}, e_t) is the circuit's exact conditional row given the
data prefix. Each target's term becomes beta KL + (1 - beta) (-log q(x_{t+j} | ...)), with the same
discount, per-example normalisation, scoring mask and marginalisation as the cross-entropy (a KL
term exists exactly where a scored target does). The teacher is not differentiated.

Memory: `chunk_size` positions at a time through `_ChunkedWindowLoss`, an autograd Function that
computes each chunk's gradients (head parameters and e) inside forward and stores only their
sums, so nothing of size (positions x n x r x v) outlives a chunk. `chunk_size=None` is the naive
version (everything materialised, plain autograd), kept as the reference. With a teacher the
chunked path for full leaves still keeps one (c, n, r, v) buffer per chunk (plus a (c, r, v)
scratch row): the mixture rows q_j are formed in probability space from the leaf softmax the
cross-entropy already holds, and the KL gradient for the leaf logits is written by hand into the
same buffer; App. G leaves take the same path, their logits' gradient then passed back through the
low-rank form by autograd. In probability space a mixture probability below the dtype's
smallest normal (~1e-38 in float32) is clamped there; float64 is exact (the tests' 1e-10).

Left out: the head itself (mtpc/heads.py), the backbone forward that produces e.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from mtpc.circuits import build_circuit
from mtpc.heads import MtpcHead


def default_gamma(window: int) -> float:
    """Discount of the window loss: 0.8 for n <= 8, 0.9 above (DESIGN section 4)."""
    return 0.8 if window <= 8 else 0.9


@dataclass
class WindowLossOutput:
    loss: Tensor
    """scalar sum_j gamma^(j-1) L_j; the only differentiable field"""
    per_position_nll: Tensor
    """(n,) L_j in nats (detached); NaN at positions the head does not score (position 1 of a
    known-byte head)"""
    window_nll: Tensor
    """scalar sum_j L_j over the scored positions, undiscounted (detached)"""
    bits_per_byte: Tensor
    """window_nll / (scored positions: n, or n - 1 for a known-byte head) / ln 2 (detached)"""
    valid_targets: Tensor
    """(n,) number of scored targets at each window offset, summed over the batch"""
    examples: Tensor | None = None
    """(n,) number of examples (rows) of this batch with a scored target at each window offset"""
    per_position_kl: Tensor | None = None
    """(n,) KL(p_j || q_j) in nats, normalised like per_position_nll (detached); None without a teacher"""
    window_kl: Tensor | None = None
    """scalar sum_j of per_position_kl (detached); None without a teacher"""


def window_targets(
    input_ids: Tensor, score_mask: Tensor, doc_ids: Tensor, window: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Targets of every window and which of them are present / scored.

    Returns x (B, S, n) long (absent targets filled with 0, never read), present (B, S, n) bool
    (a prefix along n), scored (B, S, n) bool = present and score_mask at the target.
    """
    B, S = input_ids.shape
    n = window
    pad = (0, n)
    ids = torch.nn.functional.pad(input_ids, pad, value=0)  # (B, S + n)
    docs = torch.nn.functional.pad(doc_ids, pad, value=-1)  # (B, S + n)
    mask = torch.nn.functional.pad(score_mask, pad, value=False)  # (B, S + n)
    x = ids.unfold(1, n, 1)[:, 1 : S + 1]  # (B, S, n): x[b, t, j-1] = ids[b, t+j]
    target_docs = docs.unfold(1, n, 1)[:, 1 : S + 1]  # (B, S, n)
    same = (target_docs == doc_ids.unsqueeze(-1)) & (doc_ids.unsqueeze(-1) >= 0)  # (B, S, n)
    present = same.cumprod(dim=-1).bool()  # (B, S, n): absent targets form a suffix
    scored = present & mask.unfold(1, n, 1)[:, 1 : S + 1]  # (B, S, n)
    return x.contiguous(), present, scored


def present_targets(doc_ids: Tensor) -> Tensor:
    """(B, S) -> (B, S-1) bool: the next byte of position t is present (same document, not padding)."""
    return (doc_ids[:, 1:] == doc_ids[:, :-1]) & (doc_ids[:, :-1] >= 0)


def next_byte_nll(logits: Tensor, input_ids: Tensor, doc_ids: Tensor) -> tuple[Tensor, Tensor]:
    """The backbone's own next-byte NLL (nats, float32) of every present target, in row-major order,
    and where they are: logits (B, S, v) -> nll (P,), present (B, S-1) bool with P True entries.
    What pre-training trains and scores and what head training reports as the STP floor."""
    present = present_targets(doc_ids)
    nll = torch.nn.functional.cross_entropy(
        logits[:, :-1].float()[present], input_ids[:, 1:][present], reduction="none"
    )
    return nll, present


def loss_weights(
    scored: Tensor, gamma: float, dtype: torch.dtype = torch.float32, examples: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-target weights such that L_j = sum_{b,t} stat[b,t,j] nll[b,t,j] and
    loss = sum_{b,t,j} loss_w[b,t,j] nll[b,t,j]; computed on the whole batch before chunking.

    examples (n,): the number of examples with a scored target at offset j that L_j averages over
    (None: this batch's own). A batch that is one part of a larger one (a rank's share of a DDP
    step, one micro-batch of an accumulated step) passes the whole step's count, so that the parts'
    losses add up to the whole batch's.
    Returns stat (B, S, n), loss_w (B, S, n), counts V summed over the batch (n,).
    """
    n = scored.shape[-1]
    scored_f = scored.to(dtype)
    V = scored_f.sum(dim=1)  # (B, n)  V_bj
    if examples is None:
        examples = (V > 0).sum(dim=0)  # (n,) examples with a target at offset j
    examples = examples.to(device=scored.device, dtype=dtype).clamp(min=1)
    stat = scored_f / (V.clamp(min=1).unsqueeze(1) * examples)  # (B, S, n)
    discount = gamma ** torch.arange(n, dtype=dtype, device=scored.device)  # (n,)
    return stat, stat * discount, V.sum(dim=0)


def _conditional_nll(prefix: Tensor) -> Tensor:
    """prefix marginals log q(x_1..x_j) (N, n) -> -log q(x_j | x_<j) (N, n)."""
    previous = torch.nn.functional.pad(prefix[..., :-1], (1, 0), value=0.0)  # (N, n)
    return previous - prefix


# --- distillation ---------------------------------------------------------------------------


@dataclass
class _Teacher:
    """The teacher as the chunked loss reads it: p_j of every active row, gathered per chunk."""

    logits: Tensor
    """(B S, v) the backbone's STP logits, flattened, detached"""
    index: Tensor
    """(N, n) long: flat position of t + j - 1 for each active row's window offset j (clamped to its row)"""
    beta: float
    temperature: float

    def log_probs(self, rows: slice, dtype: torch.dtype) -> Tensor:
        """log p_j for the rows -> (c, n, v) in `dtype`."""
        return torch.log_softmax(self.logits[self.index[rows]].to(dtype) / self.temperature, dim=-1)


def teacher_index(active: Tensor, seq_len: int, window: int) -> Tensor:
    """Flat position b S + min(t + j - 1, S - 1) of p_j for each flat position b S + t -> (N, n).

    Past the row end the target is absent (weight 0); the clamp only keeps the gather in the row.
    """
    t = active % seq_len  # (N,)
    offsets = torch.arange(window, device=active.device)  # (n,)  j - 1
    return (active - t).unsqueeze(-1) + (t.unsqueeze(-1) + offsets).clamp(max=seq_len - 1)


def _kl_rows(log_p: Tensor, log_q: Tensor) -> Tensor:
    """KL(p || q) = sum_u p(u) (log p(u) - log q(u)) over the last dim (..., v) -> (...)."""
    return (log_p.exp() * (log_p - log_q)).sum(-1)


@torch.no_grad()
def _mixture_rows(log_pi: Tensor, phi: Tensor, log_p: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A circuit's conditional rows q_j as a mixture, and what the KL's gradient needs (no autograd).

    log_pi (c, n, r) = log q(s_j = a | x_<j) (the state of leaf j given the prefix), phi (c, n, r, v) the
    leaf probabilities, log_p (c, n, v) the teacher -> pi (c, n, r), log_q (c, n, v) with
    q_j = sum_a pi_a phi_a, ratio (c, n, v) = p / q, S (c, n, r) = sum_u p(u) pi_a phi_a(u) / q(u)
    (the state posterior averaged over x_j ~ p; sums to 1 over a). In probability space: a mixture
    entry below the dtype's smallest normal (~1e-38 in float32) is clamped there.
    -d/d log pi_a of sum_u p log q is S_a; of log phi_a(u) it is pi_a phi_a(u) ratio(u).
    """
    pi = log_pi.exp()  # (c, n, r)
    q = torch.matmul(pi.unsqueeze(-2), phi).squeeze(-2).clamp_min(torch.finfo(phi.dtype).tiny)  # (c, n, v)
    ratio = log_p.exp() / q  # (c, n, v)
    S = pi * torch.matmul(phi, ratio.unsqueeze(-1)).squeeze(-1)  # (c, n, r)
    return pi, q.log(), ratio, S


# --- the chunked loss -----------------------------------------------------------------------


@torch.no_grad()
def _observed_leaf_scores(
    head: MtpcHead, e: Tensor, x: Tensor, dtype: torch.dtype, L: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Leaf log-probabilities of the observed tokens, keeping one (c, n, r, v) buffer.

    e (c, d), x (c, n) -> scores (c, n, r) = log_softmax(W e)[x], E (c, n, r, v) = exp(W e - max)
    (written over the logits' storage), Z (c, n, r, 1) = E.sum(-1), idx (c, n, r, 1) the gather index;
    softmax(W e) = E / Z. L: the leaf logits when already computed (the App. G option computes them
    with a graph, whose backward needs none of its output's values: its storage is reused here).
    """
    cfg = head.config
    c, n, r, v = e.shape[0], cfg.window, cfg.rank, cfg.vocab
    if L is None:
        W_flat = head.leaf_weight.detach().view(-1, cfg.hidden)  # (n r v, d)
        L = torch.nn.functional.linear(e, W_flat)
    L = L.detach().to(dtype).view(c, n, r, v)  # (c, n, r, v)
    idx = x.view(c, n, 1, 1).expand(c, n, r, 1)  # (c, n, r, 1)
    picked = L.gather(-1, idx).squeeze(-1)  # (c, n, r)
    m = L.amax(-1, keepdim=True)  # (c, n, r, 1)
    E = L.sub_(m).exp_()  # in place: exp(L - max)
    Z = E.sum(-1, keepdim=True)  # (c, n, r, 1)
    return picked - (m + Z.log()).squeeze(-1), E, Z, idx


@functools.lru_cache(maxsize=32)
def _observed_circuit(kind: str, window: int, rank: int):
    """The same structure over a vocabulary of one: its leaves are the observed-token scores."""
    return build_circuit(kind, window=window, rank=rank, vocab=1)


class _ChunkedWindowLoss(torch.autograd.Function):
    """loss = sum(loss_w * ((1 - beta) nll + beta kl)) and stats = sum_rows(stat_w * nll) (and of kl),
    in chunks of rows; without a teacher beta = 0 and kl is not computed. e is the head's input u
    (`MtpcHead.head_input`): for a known-byte head e_t + E[c] is formed outside, and E's gradient
    reaches it through autograd from the gradient this function returns for u.

    forward recomputes each chunk with grad enabled on a detached slice of e, takes the
    chunk's gradients for e and every trainable head parameter at once, and accumulates them;
    backward only scales the stored sums by grad_output (in place: one backward per forward).
    The stats are not differentiable.

    Every head takes one path, which keeps a single
    (c, n, r, v) buffer per chunk: prefix marginals need the leaves only at the observed tokens,
    so the same circuit structure built over a vocabulary of one gets the (c, n, r) scores
    log softmax(W e)[x] as its (already normalised over v) leaves and is queried at x = 0 (exact
    for every kind: prefix marginals never sum over the leaves of later positions, they use their
    normalisation; checked against the naive path by the tests). The leaf-logit gradient is then formed by hand in the softmax buffer,
    g_L = g_s (onehot(x) - softmax(W e)), and W's gradient accumulated in place (grad_W += g_L^T e);
    for App. G leaves (leaf_delta_rank > 0) the logits are computed with their graph and g_L is passed
    back through it (U, A, B and e) by autograd: no log-softmax, gather or mixture tensor of size
    (c, n, r, v) is differentiated (the autograd form cost ~25 % more of the n = 8, r = 16 step).
    Sum units go through autograd.

    With a teacher the same vocabulary-one pass gives the leaf-state posteriors pi_j = q(s_j | x_<j);
    the rows q_j = sum_a pi_ja phi_ja mix the softmax buffer phi, and the KL adds, per leaf logit,
    phi_a(u) beta w (S_a - pi_a p(u) / q(u)) to the buffer's gradient (S from `_mixture_rows`), while
    its dependence on pi reaches the scores and sum units through autograd as a surrogate term
    -sum(beta w S log pi).
    """

    @staticmethod
    def forward(ctx, head, chunk_size, teacher, e, x, loss_w, stat_w, *params):  # e (N, d), x/w (N, n)
        need_e = ctx.needs_input_grad[3]
        need_p = ctx.needs_input_grad[7:]
        grad_e = torch.zeros_like(e) if need_e else None
        grads = [torch.zeros_like(p) if need else None for p, need in zip(params, need_p, strict=True)]
        cfg, circuit = head.config, head.circuit
        W = getattr(head, "leaf_weight", None)
        delta = cfg.leaf_delta_rank > 0  # App. G leaves: their logits' backward through autograd, from g_L
        score_circuit = _observed_circuit(cfg.kind, cfg.window, cfg.rank)
        W_index = (
            next((i for i, p in enumerate(params) if p is W), None) if W is not None else None
        )  # None: W frozen
        leaf_ids = {id(head.leaf_base), id(head.leaf_delta_in), id(head.leaf_delta_out)} if delta else set()
        leaf_index = [
            i for i, (p, need) in enumerate(zip(params, need_p, strict=True)) if need and id(p) in leaf_ids
        ]
        auto = [i for i, need in enumerate(need_p) if need and i != W_index and i not in leaf_index]
        beta = 0.0 if teacher is None else teacher.beta
        loss = torch.zeros((), dtype=loss_w.dtype, device=e.device)
        stats = torch.zeros(x.shape[-1], dtype=loss_w.dtype, device=e.device)
        kl_stats = torch.zeros(x.shape[-1], dtype=loss_w.dtype, device=e.device)
        compute = torch.float64 if head._param_dtype == torch.float64 else torch.float32
        track = need_e or any(need_p)  # False: evaluation, no graph at all
        for start in range(0, e.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            x_chunk, lw = x[rows], loss_w[rows]  # (c, n)
            e_chunk = e[rows].detach().to(head._param_dtype)  # (c, d)
            log_p = None if teacher is None else teacher.log_probs(rows, compute)  # (c, n, v)
            leaf_graph = None  # App. G: the leaf logits with their graph (to the delta parameters and e)
            e_chunk.requires_grad_(need_e)
            if delta:
                with torch.set_grad_enabled(need_e or bool(leaf_index)):
                    leaf_graph = head.leaf_logits(e_chunk)  # (c, n, r, v)
            scores, E, Z, idx = _observed_leaf_scores(
                head, e_chunk, x_chunk, compute, leaf_graph
            )  # (c,n,r), (c,n,r,v)
            phi = None if teacher is None else E.div_(Z)  # in place: the leaf probabilities
            kl = None
            with torch.set_grad_enabled(track):
                scores.requires_grad_(W_index is not None or bool(leaf_index) or need_e)
                q = {"leaves": scores.unsqueeze(-1), **circuit.normalize(head.sum_logits(e_chunk))}
                zeros = torch.zeros_like(x_chunk)
                if teacher is None:
                    nll = _conditional_nll(score_circuit._prefix_log_marginals(q, zeros))
                else:
                    w, _, s = score_circuit._leaf_context(
                        q, zeros
                    )  # (c, n, r) log q(s_j, x_<j) up to a constant
                    log_pi = w.log_softmax(-1)  # (c, n, r)  log q(s_j | x_<j)
                    nll = -torch.logsumexp(log_pi + s, dim=-1)  # -log sum_a pi_a phi_a(x_j)
                chunk_loss = (nll * lw).sum() if teacher is None else (nll * lw).sum() * (1.0 - beta)
                objective = chunk_loss
                if teacher is not None:  # the KL by hand, its pi-dependence by surrogate
                    pi, log_q, ratio, S = _mixture_rows(log_pi.detach(), phi, log_p)
                    kl = _kl_rows(log_p, log_q)  # (c, n)
                    w_kl = beta * lw  # (c, n)
                    chunk_loss = chunk_loss + (kl * w_kl).sum()
                    if log_pi.requires_grad:
                        objective = objective - (log_pi * (w_kl.unsqueeze(-1) * S)).sum()
            leaf_grad = scores.requires_grad
            inputs = (
                ([scores] if leaf_grad else []) + ([e_chunk] if need_e else []) + [params[i] for i in auto]
            )
            if inputs:
                got = list(torch.autograd.grad(objective, inputs, allow_unused=True))
                g_scores = got.pop(0) if leaf_grad else None  # (c, n, r)
                g_e = got.pop(0) if need_e else None  # (c, d)
                for i, g in zip(auto, got, strict=True):
                    if g is not None:
                        grads[i] += g
                if leaf_grad:
                    if g_scores is None:
                        g_scores = torch.zeros_like(scores)
                    if teacher is None:
                        g_s = g_scores.unsqueeze(-1)  # (c, n, r, 1)
                        g_L = E.mul_(-g_s / Z).scatter_add_(-1, idx, g_s)  # in place: g_s (onehot - E / Z)
                    else:  # in place: phi (beta w S - g_s - beta w pi ratio) + onehot g_s
                        C = w_kl.unsqueeze(-1) * pi  # (c, n, r)
                        A = w_kl.unsqueeze(-1) * S - g_scores  # (c, n, r)
                        for j in range(cfg.window):  # one (c, r, v) scratch row at a time
                            phi[:, j].mul_(
                                torch.addcmul(
                                    A[:, j, :, None], C[:, j, :, None], ratio[:, j, None, :], value=-1.0
                                )
                            )
                        g_L = phi.scatter_add_(-1, idx, g_scores.unsqueeze(-1))
                    g_L = g_L.view(g_L.shape[0], -1).to(head._param_dtype)  # (c, n r v)
                    if W_index is not None:
                        grads[W_index].view(-1, cfg.hidden).addmm_(g_L.t(), e_chunk.detach())  # (n r v, d)
                    if need_e and W is not None:
                        W_flat = W.detach().view(-1, cfg.hidden)
                        g_e = g_L @ W_flat if g_e is None else g_e.addmm_(g_L, W_flat)  # (c, d)
                    if (
                        leaf_graph is not None and leaf_graph.requires_grad
                    ):  # App. G: g_L through U, A, B (and e)
                        targets = [params[i] for i in leaf_index] + ([e_chunk] if need_e else [])
                        back = list(
                            torch.autograd.grad(leaf_graph, targets, grad_outputs=g_L.view_as(leaf_graph))
                        )
                        for i in leaf_index:
                            grads[i] += back.pop(0)
                        if need_e:
                            g_e = back[0] if g_e is None else g_e.add_(back[0])
                    del g_L
                if need_e and g_e is not None:
                    grad_e[rows] = g_e.to(grad_e.dtype)
            del E, Z, scores, phi
            loss += chunk_loss.detach()
            stats += (nll.detach() * stat_w[rows]).sum(dim=0)
            if kl is not None:
                kl_stats += (kl.detach() * stat_w[rows]).sum(dim=0)
        ctx.grads = (grad_e, *grads)
        ctx.mark_non_differentiable(stats, kl_stats)
        return loss, stats, kl_stats

    @staticmethod
    def backward(ctx, grad_loss, grad_stats, grad_kl_stats):
        if ctx.grads is None:
            raise RuntimeError(
                "window_loss: backward ran twice through one chunked loss; its gradients are computed "
                "in forward and handed over once (call window_loss again, or use chunk_size=None)"
            )
        grad_e, *grads = ctx.grads
        ctx.grads = None  # hand the buffers over: autograd may adopt them as .grad without a copy
        scale = lambda g: None if g is None else g.mul_(grad_loss.to(g.dtype))
        return (None, None, None, scale(grad_e), None, None, None, *[scale(g) for g in grads])


def _validate(
    head: MtpcHead,
    e: Tensor,
    input_ids: Tensor,
    score_mask: Tensor,
    doc_ids: Tensor,
    gamma,
    chunk_size,
    teacher_logits,
    kl_beta,
    kl_temperature,
):
    if not isinstance(head, MtpcHead):
        raise ValueError(f"head: expected an MtpcHead, got {type(head).__name__}")
    cfg = head.config
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"input_ids: expected an integer tensor (B, S), got {input_ids.dtype} {tuple(input_ids.shape)}"
        )
    B, S = input_ids.shape
    if tuple(e.shape) != (B, S, cfg.hidden):
        raise ValueError(f"e: expected shape (B, S, d) = {(B, S, cfg.hidden)}, got {tuple(e.shape)}")
    if tuple(score_mask.shape) != (B, S) or score_mask.dtype != torch.bool:
        raise ValueError(
            f"score_mask: expected a bool tensor {(B, S)}, got {score_mask.dtype} {tuple(score_mask.shape)}"
        )
    if tuple(doc_ids.shape) != (B, S) or doc_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"doc_ids: expected an integer tensor {(B, S)}, got {doc_ids.dtype} {tuple(doc_ids.shape)}"
        )
    if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= cfg.vocab):
        raise ValueError(
            f"input_ids: expected ids in [0, {cfg.vocab}), got [{int(input_ids.min())}, {int(input_ids.max())}]"
        )
    if not (0.0 < gamma <= 1.0):
        raise ValueError(f"gamma: expected a value in (0, 1], got {gamma}")
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise ValueError(f"chunk_size: expected a positive int or None (naive), got {chunk_size!r}")
    if isinstance(kl_beta, bool) or not isinstance(kl_beta, (int, float)) or not 0.0 <= kl_beta <= 1.0:
        raise ValueError(f"kl_beta: expected a number in [0, 1] (weight of the KL term), got {kl_beta!r}")
    if (
        isinstance(kl_temperature, bool)
        or not isinstance(kl_temperature, (int, float))
        or not math.isfinite(kl_temperature)
        or kl_temperature <= 0
    ):
        raise ValueError(f"kl_temperature: expected a finite number > 0, got {kl_temperature!r}")
    if teacher_logits is None:
        if kl_beta > 0:
            raise ValueError(
                f"teacher_logits: kl_beta = {kl_beta} > 0 needs the backbone's STP logits (B, S, v)"
            )
    elif (
        not isinstance(teacher_logits, Tensor)
        or not teacher_logits.is_floating_point()
        or tuple(teacher_logits.shape) != (B, S, cfg.vocab)
    ):
        got = (
            f"{teacher_logits.dtype} {tuple(teacher_logits.shape)}"
            if isinstance(teacher_logits, Tensor)
            else type(teacher_logits).__name__
        )
        raise ValueError(
            f"teacher_logits: expected a floating tensor (B, S, v) = {(B, S, cfg.vocab)}, got {got}"
        )


def window_loss(
    head: MtpcHead,
    e: Tensor,
    input_ids: Tensor,
    score_mask: Tensor,
    doc_ids: Tensor,
    gamma: float | None = None,
    chunk_size: int | None = 256,
    teacher_logits: Tensor | None = None,
    kl_beta: float = 0.0,
    kl_temperature: float = 1.0,
    examples: Tensor | None = None,
) -> WindowLossOutput:
    """The discounted window loss of `head` on e (B, S, d) for the rows input_ids (B, S).

    score_mask (B, S) bool: the byte at that position is an assistant byte (scored as a target);
    doc_ids (B, S): packed-document index, -1 on padding (see mtpc.data.pack). Positions whose
    window has no scored target are skipped. chunk_size=None materialises all logits at once.
    teacher_logits (B, S, v): the frozen backbone's STP logits at every position (not
    differentiated); given, the KL statistics are computed and each target's term is
    kl_beta KL(p_j || q_j) + (1 - kl_beta) NLL, p_j = softmax(teacher_logits[t + j - 1] / kl_temperature).
    examples (n,): the example counts L_j is normalised by (`loss_weights`; None: this batch's own).
    """
    n, first = head.config.window, head.config.first_scored
    gamma = default_gamma(n) if gamma is None else float(gamma)
    _validate(
        head, e, input_ids, score_mask, doc_ids, gamma, chunk_size, teacher_logits, kl_beta, kl_temperature
    )
    x, _, scored = window_targets(input_ids.long(), score_mask, doc_ids.long(), n)
    if first > 1:  # a known-byte head: x_{t+1} is its input c, conditioned on but never scored
        scored = scored.clone()
        scored[..., : first - 1] = False
    dtype = torch.float64 if next(head.parameters()).dtype == torch.float64 else torch.float32
    stat_w, loss_w, counts = loss_weights(scored, gamma, dtype, examples)  # (B, S, n), (B, S, n), (n,)
    B, S, d = e.shape
    active = scored.any(dim=-1).flatten().nonzero().squeeze(-1)  # (N,) rows with something to score
    x_rows, loss_rows, stat_rows = (t.reshape(-1, n)[active] for t in (x, loss_w, stat_w))  # (N, n)
    u_rows = e.reshape(-1, d)[
        active
    ]  # (N, d) the head's input: e_t, or for a known-byte head e_t + E[x_{t+1}]
    if head.config.known_byte:
        u_rows = head.head_input(u_rows, x_rows[:, 0])
    teacher = None
    if teacher_logits is not None:
        teacher = _Teacher(
            teacher_logits.detach().reshape(B * S, -1),
            teacher_index(active, S, n),
            float(kl_beta),
            float(kl_temperature),
        )
    per_kl = None
    if chunk_size is None:
        q = head.circuit.normalize(head.logits(u_rows))
        nll = _conditional_nll(head.circuit._prefix_log_marginals(q, x_rows))  # (N, n)
        term = nll
        if teacher is not None:
            kl = _kl_rows(
                teacher.log_probs(slice(None), dtype), head.circuit._conditionals(q, x_rows)
            )  # (N, n)
            term = (1.0 - teacher.beta) * nll + teacher.beta * kl
            per_kl = (kl.detach() * stat_rows).sum(dim=0)
        loss = (term * loss_rows).sum()
        per_position = (nll.detach() * stat_rows).sum(dim=0)
    else:
        known = getattr(head, "known_embedding", None)  # E reaches the chunks through u_rows only
        params = (
            [p for p in head.parameters() if p.requires_grad and p is not known]
            if torch.is_grad_enabled()
            else []
        )
        if torch.is_grad_enabled() and (u_rows.requires_grad or params):
            loss, per_position, per_kl = _ChunkedWindowLoss.apply(
                head, chunk_size, teacher, u_rows, x_rows, loss_rows, stat_rows, *params
            )
        else:
            with torch.no_grad():
                loss, per_position, per_kl = _ChunkedWindowLoss.forward(
                    _NoGradCtx(0), head, chunk_size, teacher, u_rows, x_rows, loss_rows, stat_rows
                )
        per_kl = None if teacher is None else per_kl
    total = per_position[first - 1 :].sum()
    if first > 1:  # say so: these positions are not scored (a 0 would read as a perfect prediction)
        per_position = per_position.clone()
        per_position[: first - 1] = float("nan")
        if per_kl is not None:
            per_kl = per_kl.clone()
            per_kl[: first - 1] = float("nan")
    return WindowLossOutput(
        loss=loss,
        per_position_nll=per_position,
        window_nll=total,
        bits_per_byte=total / (n - first + 1) / math.log(2),
        valid_targets=counts,
        examples=scored.any(dim=1).sum(dim=0),
        per_position_kl=per_kl,
        window_kl=None if per_kl is None else per_kl[first - 1 :].sum(),
    )


class _NoGradCtx:
    """Stand-in ctx to run the chunked forward for evaluation (no gradients, nothing saved)."""

    def __init__(self, num_params: int) -> None:
        self.needs_input_grad = (False,) * (7 + num_params)

    def mark_non_differentiable(self, *tensors) -> None:
        pass
