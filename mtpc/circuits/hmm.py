"""hmm: an inhomogeneous hidden Markov model over the window with r states.

q(x) = sum_z q(z_1) prod_{i>1} q(z_i | z_{i-1}) prod_i q(x_i | z_i).
Parameters: `initial` (r,), `transitions` (n-1, r, r) with [i, a, b] = log q(z_{i+2} = b | z_{i+1} = a)
(rows normalise), `leaves` (n, r, v). Every query steps through the chain once (forward messages in
log space by shifted matmuls; Viterbi with back-pointers for greedy). Sampling given a prefix is
exact: filter through the prefix, draw the last prefix state from the filter, then run the chain
forward. Leaves out: everything shared (base.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import Circuit, Params, gather_rows, log_vecmat, sample_rows, with_prefix


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

    def _filter(self, initial: Tensor, probs: Tensor, scores: Tensor) -> list[Tensor]:
        """pred[i] = log q(z_i, x_<i) for i = 0..k (0-based), k = scores.shape[-2] <= n - 1 steps."""
        pred = [initial]
        steps = min(scores.shape[-2], self.window - 1)
        # unbind once: indexing step by step would zero-fill a full-size gradient per step in backward
        for score, table in zip(scores.unbind(-2)[:steps], probs.unbind(-3)[:steps], strict=True):
            pred.append(log_vecmat(pred[-1] + score, table))
        return pred

    def _log_prob(self, q: Params, x: Tensor) -> Tensor:
        initial, trans, _, _, scores = self._parts(q, x)
        pred = self._filter(initial, trans.exp(), scores)
        return torch.logsumexp(pred[-1] + scores[..., -1, :], dim=-1)

    def _leaf_context(self, q: Params, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        initial, trans, leaves, x, scores = self._parts(q, x)
        return torch.stack(self._filter(initial, trans.exp(), scores), dim=-2), leaves, scores  # (..., n, r)

    def _sample(self, q: Params, generator: torch.Generator | None = None, prefix: Tensor | None = None) -> Tensor:
        initial, trans, leaves, prefix, scores = self._parts(q, prefix)
        k = scores.shape[-2]
        n, r = self.window, self.rank
        noise = -(-torch.rand((*initial.shape[:-1], n, r), generator=generator, dtype=initial.dtype,
                              device=initial.device).clamp_min(torch.finfo(initial.dtype).tiny).log()).log()
        if k == 0:
            start, logits = 0, initial
        else:  # the last prefix state from the filter q(z_k | x_1..x_k)
            start = k - 1
            logits = self._filter(initial, trans[..., : k - 1, :, :].exp(), scores[..., : k - 1, :])[-1] + scores[..., k - 1, :]
        z = [(logits + noise[..., start, :]).argmax(-1)]  # (...)
        for i in range(start + 1, n):  # run the chain forward: z_i ~ q(. | z_{i-1})
            row = trans[..., i - 1, :, :].gather(-2, z[-1][..., None, None].expand(*z[-1].shape, 1, r)).squeeze(-2)
            z.append((row + noise[..., i, :]).argmax(-1))
        states = torch.stack(z, dim=-1)  # (..., n - start)
        x = sample_rows(gather_rows(leaves[..., start:, :, :], states), generator, normalised=True)  # (..., n - start)
        if start > 0:
            x = torch.cat([x.new_zeros(*x.shape[:-1], start), x], dim=-1)
        return with_prefix(prefix, x)

    def _greedy(self, q: Params, prefix: Tensor | None = None) -> Tensor:
        initial, trans, leaves, prefix, scores = self._parts(q, prefix)
        k = scores.shape[-2]
        emit = torch.cat([scores, leaves[..., k:, :, :].amax(-1)], dim=-2)  # (..., n, r) best score per state
        delta = initial + emit[..., 0, :]
        back = []
        for i in range(1, self.window):  # Viterbi: delta_i(b) = max_a delta_{i-1}(a) + T[a, b] + emit_i(b)
            best, arg = (delta.unsqueeze(-1) + trans[..., i - 1, :, :]).max(-2)
            back.append(arg)
            delta = best + emit[..., i, :]
        z = [delta.argmax(-1)]
        for arg in reversed(back):
            z.append(arg.gather(-1, z[-1].unsqueeze(-1)).squeeze(-1))
        states = torch.stack(z[::-1], dim=-1)  # (..., n)
        return with_prefix(prefix, gather_rows(leaves, states).argmax(-1))
