"""The acceptance rule of speculative decoding as pure functions (greedy and sampling).

Holds: the target distribution p (temperature, top-p and an optional EOS ban applied to the
verifier's logits, never to the draft), the per-position acceptance probability
min(1, p(d) / q(d)), the distribution of the accepted length, the residual distribution
normalise(max(0, p - q)), and the two verification functions `greedy_verify` and
`sample_verify`, which test only the window positions `testable_drafts` allows (the remaining
byte budget and an allowed stop id end a window early). Randomness enters only through a `Chooser` (probs -> index), so tests can
replace it by an enumerator and obtain exact output distributions (tests/test_acceptance.py).
Everything stays on the tensors' device: with `TorchChooser` the verification reads nothing
back to the host (the decoding loop reads the accepted count once per cycle).

Leaves out: caches, backbone calls and the cycle bookkeeping (loop.py).

Indexing used everywhere: a window of m drafted tokens `draft (m,)` is verified with
`p (m+1, v)` target probabilities (row j is p for the position of draft[j]; row m is the bonus
row after full acceptance) and `q (m, v)` draft conditionals (row j is q(draft[j] = . | the
drafted prefix before it)).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor


class Chooser(Protocol):
    """Draws an index from a probability vector; the loop's only source of randomness.

    May return a Python int (test enumerators) or a 0-d int64 tensor on the probabilities'
    device (`TorchChooser`: nothing is read back to the host)."""

    def __call__(self, probs: Tensor) -> int | Tensor: ...  # probs (k,) non-negative, sums to 1


class TorchChooser:
    """The production chooser, with an optional generator; a 0-d device tensor.

    An exponential race: argmax(probs / E) with E ~ Exp(1) drawn from the generator, which is how
    `torch.multinomial(probs, 1)` draws one sample (the same draws from the same generator state;
    tested), minus multinomial's check that the probabilities are finite and non-negative, whose
    `.item()` reads the device back on every call. So a draw costs no host read and can be
    captured in a CUDA graph (with the generator registered), graph replay drawing as eager does.
    The probabilities must be valid (the loop's come from a softmax and its residuals)."""

    def __init__(self, generator: torch.Generator | None = None):
        self.generator = generator

    def __call__(self, probs: Tensor) -> Tensor:
        return (probs / torch.empty_like(probs).exponential_(1, generator=self.generator)).argmax()


def as_index(i: int | Tensor, device: torch.device) -> Tensor:
    """An index from a Chooser (int or 0-d tensor) as a (1,) int64 tensor on `device`, without a host read."""
    return torch.as_tensor(i, dtype=torch.long, device=device).view(1)


def target_probs(
    logits: Tensor,  # (..., v)
    temperature: float = 1.0,
    top_p: float = 1.0,
    banned: int | Tensor | None = None,
) -> Tensor:  # (..., v)
    """p = the plain sampler's distribution: ban one id (or the ids of a device index tensor: no host
    list inside a captured graph), divide by temperature, keep the top-p nucleus.

    The nucleus is the smallest set of most probable tokens whose mass reaches `top_p` (ties
    broken by index order); the result is renormalised over it.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling, got {temperature}; use mode='greedy'")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    logits = logits.double() if logits.dtype == torch.float64 else logits.float()
    if banned is not None:
        logits = logits.clone()
        logits[..., banned] = float("-inf")
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        keep_sorted = mass_before < top_p  # the first token is always kept
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def greedy_target(logits: Tensor, banned: int | Tensor | None = None) -> Tensor:  # (..., v) -> (...) int64
    """argmax of the verifier's logits (after the optional ban of one id or of a device index
    tensor's ids, as in target_probs): the plain greedy choice."""
    if banned is not None:
        logits = logits.clone()
        logits[..., banned] = float("-inf")
    return logits.argmax(-1)


def acceptance_probs(p: Tensor, q: Tensor, draft: Tensor) -> Tensor:
    """min(1, p(d_j) / q(d_j)) for each drafted token.  p, q (m, v) probs; draft (m,) -> (m,)."""
    idx = draft.unsqueeze(-1)
    pd = p.gather(-1, idx).squeeze(-1)
    qd = q.gather(-1, idx).squeeze(-1)
    # q(d) > 0 whenever d was drafted from q; the clamp only guards rows that are never reached
    return torch.clamp(pd / qd.clamp_min(torch.finfo(qd.dtype).tiny), max=1.0)


def acceptance_length_distribution(a: Tensor) -> Tensor:  # (m,) -> (m+1,)
    """P(s = k) = a_1 .. a_k (1 - a_{k+1}) for k < m, and a_1 .. a_m for k = m.

    Each drafted token is accepted independently with its probability a_j given the draft;
    the accepted length s is the index of the first rejection.
    """
    ones = torch.ones(1, dtype=a.dtype, device=a.device)
    survive = torch.cumprod(torch.cat([ones, a]), 0)  # (m+1,) P(first k all accepted)
    reject_next = torch.cat([1 - a, ones])  # (m+1,)
    return survive * reject_next


def residual_distribution(p: Tensor, q: Tensor) -> Tensor:  # (..., v) x2 -> (..., v)
    """normalise(max(0, p - q)): where to resample after rejecting a draft from q against p.

    If p == q the residual is empty; rejection then has probability 0, so any distribution is
    correct there — p is returned to keep the function total.
    """
    r = torch.clamp(p - q, min=0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp_min(torch.finfo(r.dtype).tiny), p)


def stop_hits(ids: Tensor, stop_ids: Sequence[int]) -> Tensor:  # (...) -> (...) bool
    """Which ids end a generation (an allowed EOS: any of `stop_ids`, e.g. eos and <|eot_id|>); all
    False when nothing stops it. The one place that knows the stop rule on the device (the host side
    is `loop._finish`)."""
    hit = torch.zeros_like(ids, dtype=torch.bool)
    for t in stop_ids:
        hit |= ids == t
    return hit


def testable_drafts(
    draft: Tensor, budget: int, stop_ids: Sequence[int]
) -> Tensor:  # (..., m) -> (..., m) bool
    """The drafted positions a cycle may test: the first `budget` (what the remaining byte budget
    lets the cycle emit), up to and including the first stop id (nothing after it is emitted).

    A prefix of the window (True then False); a cycle that tests only these never counts a byte it
    does not emit. On the device, no host read.
    """
    m = draft.shape[-1]
    ok = torch.arange(m, device=draft.device) < budget
    hit = stop_hits(draft, stop_ids).to(torch.int64)
    return ok & ((hit.cumsum(-1) - hit) == 0)  # no stop id strictly before


def greedy_verify(draft: Tensor, target_ids: Tensor, testable: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Greedy rule: accept while draft[j] == argmax p_j; the extra token is argmax p at the stop.

    draft (m,), target_ids (m+1,) = argmax of each verifier row -> (s, extra token), 0-d tensors
    on the device (nothing is read back). testable (m,) bool (`testable_drafts`): test no further
    than its last True; after accepting all of those, the extra token is argmax of the next row.
    """
    m = draft.shape[0]
    mismatch = draft != target_ids[:m]  # (m,)
    if testable is not None:
        mismatch = mismatch | ~testable
    mismatch = mismatch.to(torch.int64)
    # s = index of the first mismatch, or m if none (argmax of a cumsum > 0 needs a sentinel)
    s = torch.cat([mismatch, mismatch.new_ones(1)]).argmax()
    return s, target_ids.gather(0, s.view(1))[0]


def testable_count(draft: Sequence[int], budget: int, stop_ids: Sequence[int]) -> int:
    """`testable_drafts(draft, budget, stop_ids).sum()` for a draft on the host: the first `budget`
    drafts, up to and including the first stop id."""
    stops = set(stop_ids)
    count = 0
    for t in draft[: max(budget, 0)]:
        count += 1
        if t in stops:
            break
    return count


def greedy_accept(
    targets: Sequence[int], draft: Sequence[int], budget: int, stop_ids: Sequence[int]
) -> tuple[int, int]:
    """The greedy rule on the host, for a cycle that reads the verifier's choices back anyway:
    targets (m+1) = argmax of each verifier row, draft (m) -> (s accepted, testable count), the
    same as `greedy_verify(draft, targets, testable_drafts(draft, budget, stop_ids))` and
    `testable_drafts(...).sum()` (tests check both agree); the extra token is targets[s]. A handful
    of Python comparisons instead of ~10 small tensor ops per cycle (the CPU cycle's accept)."""
    count = testable_count(draft, budget, stop_ids)
    s = 0
    while s < count and draft[s] == targets[s]:
        s += 1
    return s, count


def sample_verify(
    draft: Tensor,  # (m,)
    p: Tensor,  # (m+1, v) target probabilities
    q: Tensor,  # (m, v) draft conditionals (probabilities) of the drafted tokens' positions
    choose: Chooser,
    testable: Tensor | None = None,  # (m,) bool, `testable_drafts`
) -> tuple[int | Tensor, int | Tensor]:
    """Speculative sampling: returns (s accepted drafts, extra token), as `choose` returns them.

    The extra token is sampled from normalise(max(0, p_s - q_s)) after a rejection at s, and
    from p_s after accepting every testable draft (q's row there is taken as zero, so the
    residual is p_s: a shorter window); every emitted token is then distributed as under p.
    Untested drafts get acceptance probability 0. No host read when `choose` returns tensors.
    """
    m = draft.shape[0]
    a = acceptance_probs(p[:m], q, draft)
    tested = torch.ones(m, dtype=torch.bool, device=p.device) if testable is None else testable
    a = torch.where(tested, a, torch.zeros_like(a))
    s = choose(acceptance_length_distribution(a))
    at = as_index(s, p.device)
    q_rows = torch.cat(
        [q * tested.unsqueeze(-1).to(q.dtype), q.new_zeros(1, q.shape[-1])]
    )  # zero past the window
    q_s = q_rows.index_select(0, at)  # (1, v)
    return s, choose(residual_distribution(p.index_select(0, at), q_s)[0])
