"""cp: a mixture of r fully factorised windows, q(x) = sum_z q(z) prod_i q(x_i | z).

Parameters: `mixture` (r,), `leaves` (n, r, v). The posterior over z given a prefix is a cumulative
sum of leaf scores, so every query is a handful of batched ops; the fused draft is about twenty.
Leaves out: everything shared (base.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import (
    Circuit,
    Params,
    expand_to,
    gather_leaf_scores,
    gather_rows,
    gumbel_argmax,
    leaf_probs,
    mix_probs,
    sample_probs,
    sample_rows,
    with_prefix,
)


class CPCircuit(Circuit):
    kind = "cp"

    @property
    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"mixture": (self.rank,), "leaves": (self.window, self.rank, self.vocab)}

    def _scores(self, q: Params, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """-> mixture (..., r), leaves (..., n, r, v), x (..., n), E (..., k, r) leaf scores of x."""
        batch = self._batch_shape(q, x.shape[:-1])
        n, r, v = self.window, self.rank, self.vocab
        leaves = expand_to(q["leaves"], (*batch, n, r, v))
        k = x.shape[-1]
        x = expand_to(x, (*batch, k))
        scores = gather_leaf_scores(leaves, x)  # (..., k, r)
        return expand_to(q["mixture"], (*batch, r)), leaves, x, scores

    def _log_prob(self, q: Params, x: Tensor) -> Tensor:
        mixture, _, _, scores = self._scores(q, x)
        return torch.logsumexp(mixture + scores.sum(-2), dim=-1)

    def _leaf_context(self, q: Params, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        mixture, leaves, x, scores = self._scores(q, x)  # scores (..., n, r)
        before = scores.cumsum(-2) - scores  # (..., n, r)  sum over positions < i
        return mixture.unsqueeze(-2) + before, leaves, scores

    def _prefix_log_marginals(self, q: Params, x: Tensor) -> Tensor:
        mixture, _, _, scores = self._scores(q, x)
        return torch.logsumexp(mixture.unsqueeze(-2) + scores.cumsum(-2), dim=-1)

    def _posterior(self, q: Params, prefix: Tensor | None) -> tuple[Tensor, Tensor]:
        """-> log q(z, prefix) (..., r) and leaves (..., n, r, v), batch = params x prefix."""
        if prefix is None:
            prefix = torch.zeros((0,), dtype=torch.long, device=q["leaves"].device)
        mixture, leaves, _, scores = self._scores(q, prefix)
        return mixture + scores.sum(-2), leaves

    def _sample(
        self, q: Params, generator: torch.Generator | None = None, prefix: Tensor | None = None
    ) -> Tensor:
        post, leaves = self._posterior(q, prefix)
        z = gumbel_argmax(post, generator)  # (...)
        rows = gather_rows(leaves, z.unsqueeze(-1).expand(*z.shape, self.window))  # (..., n, v)
        return with_prefix(prefix, sample_rows(rows, generator, normalised=True))

    def _greedy(self, q: Params, prefix: Tensor | None = None) -> Tensor:
        post, leaves = self._posterior(q, prefix)
        k = 0 if prefix is None else prefix.shape[-1]
        best = leaves[..., k:, :, :].amax(-1)  # (..., n-k, r)  best free token per component
        z = (post + best.sum(-2)).argmax(-1)  # (...)
        x = gather_rows(leaves, z.unsqueeze(-1).expand(*z.shape, self.window)).argmax(-1)
        return with_prefix(prefix, x)

    def _draft(self, q, prefix, generator=None, greedy=False, conditionals=True):
        # one posterior over z for the window, one exp of the leaves for the sampled rows and the mix
        if prefix is None:
            prefix = torch.zeros((0,), dtype=torch.long, device=q["leaves"].device)
        mixture, leaves, prefix, scores = self._scores(q, prefix)  # scores (..., k, r)
        k, n = prefix.shape[-1], self.window
        post = mixture + scores.sum(-2) if k else mixture  # (..., r)  log q(z, prefix)
        probs = leaf_probs(leaves) if conditionals else None  # (..., n, r, v)
        if greedy:
            z = (post + leaves[..., k:, :, :].amax(-1).sum(-2)).argmax(-1)  # (...)
            x = gather_rows(leaves, z[..., None].expand(*z.shape, n)).argmax(-1)
        else:
            z = gumbel_argmax(post, generator)[..., None].expand(*post.shape[:-1], n)
            rows = gather_rows(leaves, z).exp() if probs is None else gather_rows(probs, z)  # (..., n, v)
            x = sample_probs(rows, generator)
        x = with_prefix(prefix, x)
        if not conditionals:
            return x, None
        s = gather_leaf_scores(leaves, x)  # (..., n, r)
        w = mixture.unsqueeze(-2) + (s.cumsum(-2) - s)  # (..., n, r)  log q(z, x_<i)
        return x, mix_probs(w, probs)
