"""ff: a fully factorised window, q(x) = prod_i q(x_i), the closed-form baseline (rank 1).

Parameters: `leaves` (n, 1, v). Every query is closed form: the conditionals do not depend on x,
sampling and greedy decoding are independent per position. Leaves out: everything shared (base.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import Circuit, Params, gather_leaf_scores, sample_rows, with_prefix


class FFCircuit(Circuit):
    kind = "ff"
    fixed_rank = 1  # no latent states: one product of n leaves

    @property
    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"leaves": (self.window, 1, self.vocab)}

    def _leaves(self, q: Params, *others: torch.Size) -> Tensor:
        batch = self._batch_shape(q, *others)
        return q["leaves"].squeeze(-2).expand(*batch, self.window, self.vocab)  # (..., n, v)

    def _leaf_context(self, q: Params, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        batch = self._batch_shape(q, x.shape[:-1])
        leaves = q["leaves"].expand(*batch, self.window, 1, self.vocab)
        w = leaves.new_zeros(()).expand(*batch, self.window, 1)
        return w, leaves, gather_leaf_scores(leaves, x.expand(*batch, self.window))

    def _log_prob(self, q: Params, x: Tensor) -> Tensor:
        return self._token_scores(q, x).sum(-1)

    def _token_scores(self, q: Params, x: Tensor) -> Tensor:  # (..., n)
        leaves = self._leaves(q, x.shape[:-1])
        return leaves.gather(-1, x.expand(*leaves.shape[:-1]).unsqueeze(-1)).squeeze(-1)

    def _prefix_log_marginals(self, q: Params, x: Tensor) -> Tensor:
        return self._token_scores(q, x).cumsum(-1)

    def _conditionals(self, q: Params, x: Tensor) -> Tensor:
        return self._leaves(q, x.shape[:-1])  # independent of x (an expanded view)

    def _sample(
        self, q: Params, generator: torch.Generator | None = None, prefix: Tensor | None = None
    ) -> Tensor:
        leaves = self._leaves(q, *(() if prefix is None else (prefix.shape[:-1],)))
        return with_prefix(prefix, sample_rows(leaves, generator, normalised=True))

    def _greedy(self, q: Params, prefix: Tensor | None = None) -> Tensor:
        leaves = self._leaves(q, *(() if prefix is None else (prefix.shape[:-1],)))
        return with_prefix(prefix, leaves.argmax(-1))

    def _draft(self, q, prefix, generator=None, greedy=False, conditionals=True):
        leaves = self._leaves(q, *(() if prefix is None else (prefix.shape[:-1],)))
        x = leaves.argmax(-1) if greedy else sample_rows(leaves, generator, normalised=True)
        return with_prefix(prefix, x), leaves if conditionals else None
