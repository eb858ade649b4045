"""hmm: an inhomogeneous hidden Markov model over the window with r states.

q(x) = sum_z q(z_1) prod_{i>1} q(z_i | z_{i-1}) prod_i q(x_i | z_i).
Parameters: `initial` (r,), `transitions` (n-1, r, r) with [i, a, b] = log q(z_{i+2} = b | z_{i+1} = a)
(rows normalise), `leaves` (n, r, v). Every query steps through the chain once (forward messages in
log space by shifted matmuls; Viterbi with back-pointers for greedy). Sampling given a prefix is
exact: filter through the prefix, draw the last prefix state from the filter, then run the chain
forward (the Gumbel choices of every step at once, the chain itself and Viterbi's back-pointers
composed by pointer doubling). Leaves out: everything shared (base.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import (
    Circuit,
    Params,
    gather_leaf_scores,
    gather_rows,
    gumbel,
    leaf_probs,
    log_rowvec,
    mix_probs,
    sample_probs,
    sample_rows,
    with_prefix,
)


class HMMCircuit(Circuit):
    kind = "hmm"

    @property
    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        n, r, v = self.window, self.rank, self.vocab
        return {"initial": (r,), "transitions": (n - 1, r, r), "leaves": (n, r, v)}

    def _parts(self, q: Params, ids: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor]:
        """-> initial (..., r), log transitions (..., n-1, r, r), leaves (..., n, r, v), ids, scores (..., k, r)."""
        e, ids, scores = self._expand_with_scores(q, ids)
        return e["initial"], e["transitions"], e["leaves"], ids, scores

    def _filter(self, initial: Tensor, probs: Tensor, scores: Tensor, exact: bool = True) -> list[Tensor]:
        """pred[i] = log q(z_i, x_<i) for i = 0..k (0-based), k = scores.shape[-2] <= n - 1 steps;
        each a row (..., 1, r) (torch.cat(pred, -2) stacks them). exact=False: each pred[i] up to
        an additive constant (see log_rowvec)."""
        pred = [initial.unsqueeze(-2)]  # rows, so that each step is one row-vector product
        steps = min(scores.shape[-2], self.window - 1)
        # unbind once: indexing step by step would zero-fill a full-size gradient per step in backward
        for score, table in zip(
            scores.unsqueeze(-2).unbind(-3)[:steps], probs.unbind(-3)[:steps], strict=True
        ):
            pred.append(log_rowvec(pred[-1] + score, table, exact))
        return pred

    def _log_prob(self, q: Params, x: Tensor) -> Tensor:
        initial, trans, _, _, scores = self._parts(q, x)
        pred = self._filter(initial, trans.exp(), scores)
        return torch.logsumexp(pred[-1].squeeze(-2) + scores[..., -1, :], dim=-1)

    def _leaf_context(self, q: Params, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        initial, trans, leaves, x, scores = self._parts(q, x)
        return torch.cat(self._filter(initial, trans.exp(), scores), dim=-2), leaves, scores  # (..., n, r)

    def _states(
        self, initial: Tensor, trans: Tensor, scores: Tensor, generator: torch.Generator | None
    ) -> Tensor:
        """Sample the states z_start..z_n given the k prefix scores (start = max(k - 1, 0)) -> (..., n - start).

        The last prefix state is drawn from the filter q(z_k | x_1..x_k), then the chain runs forward.
        Each step's choice is formed for every previous state at once, choice[i, a] = argmax_b
        T_i[a, b] + g_{i+1}(b) (one batched op), and the chain z_{i+1} = choice[i, z_i] is composed
        by pointer doubling in log2(n) gathers instead of n sequential steps (the same states)."""
        n, r = self.window, self.rank
        k = scores.shape[-2]
        noise = gumbel(
            torch.rand(
                (*initial.shape[:-1], n, r), generator=generator, dtype=initial.dtype, device=initial.device
            )
        )  # (..., n, r)
        if k == 0:
            start, logits = 0, initial
        else:  # the last prefix state from the filter q(z_k | x_1..x_k)
            start = k - 1
            filt = self._filter(
                initial, trans[..., : k - 1, :, :].exp(), scores[..., : k - 1, :], exact=False
            )
            logits = filt[-1].squeeze(-2) + scores[..., k - 1, :]  # up to a constant: only its argmax is used
        z0 = (logits + noise[..., start, :]).argmax(-1, keepdim=True)  # (..., 1)
        if start == n - 1:
            return z0
        choice = (trans[..., start:, :, :] + noise[..., start + 1 :, :].unsqueeze(-2)).argmax(
            -1
        )  # (..., n-1-start, r)
        later = compose_prefix(choice).gather(-1, z0.unsqueeze(-1).expand(*choice.shape[:-1], 1)).squeeze(-1)
        return torch.cat([z0, later], dim=-1)

    def _sample(
        self, q: Params, generator: torch.Generator | None = None, prefix: Tensor | None = None
    ) -> Tensor:
        initial, trans, leaves, prefix, scores = self._parts(q, prefix)
        states = self._states(initial, trans, scores, generator)  # (..., n - start)
        start = self.window - states.shape[-1]
        x = sample_rows(
            gather_rows(leaves[..., start:, :, :], states), generator, normalised=True
        )  # (..., n - start)
        return with_prefix(prefix, _pad_front(x, start))

    def _greedy(self, q: Params, prefix: Tensor | None = None) -> Tensor:
        initial, trans, leaves, prefix, scores = self._parts(q, prefix)
        return with_prefix(prefix, self._viterbi(initial, trans, leaves, scores))

    def _viterbi(self, initial: Tensor, trans: Tensor, leaves: Tensor, scores: Tensor) -> Tensor:
        """Greedy window given the prefix scores (..., k, r): Viterbi forward, back-pointers composed
        by pointer doubling -> (..., n) (the prefix positions hold the best state's token)."""
        k = scores.shape[-2]
        emit = torch.cat([scores, leaves[..., k:, :, :].amax(-1)], dim=-2)  # (..., n, r) best score per state
        delta = (initial + emit[..., 0, :]).unsqueeze(-1)  # (..., r, 1)
        back = []
        for table, e in zip(trans.unbind(-3), emit[..., 1:, :].unsqueeze(-2).unbind(-3), strict=True):
            # delta_i(b) = max_a delta_{i-1}(a) + T[a, b] + emit_i(b)
            best, arg = (delta + table).max(-2, keepdim=True)  # (..., 1, r)
            back.append(arg)
            delta = (best + e).transpose(-1, -2)  # (..., r, 1)
        last = delta.squeeze(-1).argmax(-1, keepdim=True)  # (..., 1)  z_n
        if back:  # z_{i-1} = back_i[z_i]: compose the back-pointers from the end
            ptr = torch.cat(back[::-1], dim=-2)  # (..., n - 1, r)  row j: z_{n-2-j} given z_{n-1-j} (0-based)
            earlier = (
                compose_prefix(ptr).gather(-1, last.unsqueeze(-1).expand(*ptr.shape[:-1], 1)).squeeze(-1)
            )
            states = torch.cat([earlier.flip(-1), last], dim=-1)  # (..., n)
        else:
            states = last
        return gather_rows(leaves, states).argmax(-1)

    def _draft(self, q, prefix, generator=None, greedy=False, conditionals=True):
        # one exp of the leaves for the sampled rows and the mix; the filter of x (up to a constant
        # per position: it only enters softmax(w_i)) gives the conditionals
        initial, trans, leaves, prefix, scores = self._parts(q, prefix)
        p_leaves = leaf_probs(leaves) if conditionals else None  # (..., n, r, v)
        if greedy:
            x = self._viterbi(initial, trans, leaves, scores)
        else:
            states = self._states(initial, trans, scores, generator)
            start = self.window - states.shape[-1]
            table = leaves if p_leaves is None else p_leaves
            rows = gather_rows(table[..., start:, :, :], states)  # (..., n - start, v)
            x = _pad_front(sample_probs(rows.exp() if p_leaves is None else rows, generator), start)
        x = with_prefix(prefix, x)
        if not conditionals:
            return x, None
        pred = self._filter(initial, trans.exp(), gather_leaf_scores(leaves, x), exact=False)
        w = torch.cat(pred, dim=-2)  # (..., n, r)
        return x, mix_probs(w, p_leaves)


def compose_prefix(maps: Tensor) -> Tensor:
    """maps (..., L, r) int, row j a map f_j: [r] -> [r] -> (..., L, r), row j = f_j o ... o f_0,
    by pointer doubling (Hillis-Steele): log2(L) gathers instead of L sequential steps."""
    step = 1
    while step < maps.shape[-2]:
        maps = torch.cat([maps[..., :step, :], maps[..., step:, :].gather(-1, maps[..., :-step, :])], dim=-2)
        step *= 2
    return maps


def _pad_front(x: Tensor, start: int) -> Tensor:
    """x (..., n - start) -> (..., n) with zeros in front (positions the prefix overwrites)."""
    return torch.cat([x.new_zeros(*x.shape[:-1], start), x], dim=-1) if start > 0 else x
