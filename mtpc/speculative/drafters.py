"""Head + draft as one captured or compiled call, plugged into the decoding loop as its head_fn
and drafter: `GraphedDraft` (a CUDA graph per case) and `CompiledDraft` (torch.compile, greedy).

Both take the loop's hidden state as the "parameters" (`head` passes it through as
{"hidden": h}) and run head + normalise + draft inside one call, so that the whole step is one
graph. The known byte c is the draft's prefix [c], a static-address input of the graph (copied
into its buffer per replay, like h): the head function reads it there as `head_fn(h, prefix)`, so
a known-byte head's E[c] is inside the graph too (drop cycles: prefix None, c None). Leaves out:
the capture and compile machinery (mtpc/backbones/graphs.py), the eager drafter (loop.py
`CircuitDrafter`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class GraphedDraft:
    """head + draft captured as one CUDA graph per (greedy, prefix) case (CUDA only).

    Plugs into the loop as its head_fn (`head`: passes the hidden state through) and drafter
    (`__call__`: replays head_fn + circuit._draft on it). A capture that fails (an op that reads
    the host, say) falls back to running eagerly; `errors` records why.
    """

    def __init__(self, head_fn: Any, circuit: Any, generator: torch.Generator | None):
        self.head_fn, self.circuit, self.generator = head_fn, circuit, generator
        self.graphs: dict[tuple[bool, bool], Any] = {}
        self.errors: dict[tuple[bool, bool], str] = {}

    def head(self, hidden: Tensor, c: Tensor | None = None) -> dict[str, Tensor]:
        return {"hidden": hidden}  # c comes back as the drafter's prefix

    def _eager(self, hidden: Tensor, prefix: Tensor | None, greedy: bool):
        theta = self.head_fn(hidden, prefix)  # prefix = [c]: the known byte
        return self.circuit._draft(theta, prefix, generator=self.generator, greedy=greedy)

    def __call__(
        self, theta: dict[str, Tensor], prefix: Tensor | None, greedy: bool
    ) -> tuple[Tensor, Tensor]:
        from mtpc.backbones.graphs import CapturedFn

        key, hidden = (greedy, prefix is None), theta["hidden"]
        args = (hidden,) if prefix is None else (hidden, prefix)
        if key not in self.graphs and key not in self.errors:
            try:
                self.graphs[key] = CapturedFn(
                    lambda h, *pre: self._eager(h, pre[0] if pre else None, greedy),
                    args,
                    generator=None if greedy else self.generator,
                )
            except Exception as e:  # noqa: BLE001 - any capture failure: run eagerly, say why
                self.errors[key] = f"{type(e).__name__}: {e}"
        if key in self.graphs:
            return self.graphs[key](*args)
        return self._eager(hidden, prefix, greedy)


class CompiledDraft:
    """head + greedy draft through torch.compile (static shapes, inductor's C++ wrapper on the
    CPU; `compile_static`): a graph per (prefix or not) case, compiled on first use.

    Plugs into the loop as head_fn (`head`: passes the hidden state through) and drafter. Only
    greedy drafts are compiled: a sampled draft draws from the model's generator, which stays
    eager. Any draft is valid for exactness (the verifier decides), so the ~1e-6 rounding of the
    fused kernels cannot change the output; the conditionals a greedy cycle returns are unused.
    """

    def __init__(self, head_fn: Any, circuit: Any, generator: torch.Generator | None, device: torch.device):
        self.head_fn, self.circuit, self.generator = head_fn, circuit, generator
        from mtpc.backbones.graphs import compile_static

        self._fn = compile_static(self._greedy, device)

    def head(self, hidden: Tensor, c: Tensor | None = None) -> dict[str, Tensor]:
        return {"hidden": hidden}  # c comes back as the drafter's prefix

    def _greedy(self, hidden: Tensor, prefix: Tensor | None):
        return self.circuit._draft(self.head_fn(hidden, prefix), prefix, generator=None, greedy=True)

    def __call__(
        self, theta: dict[str, Tensor], prefix: Tensor | None, greedy: bool
    ) -> tuple[Tensor, Tensor]:
        if greedy:
            return self._fn(theta["hidden"], prefix)
        theta = self.head_fn(theta["hidden"], prefix)
        return self.circuit._draft(theta, prefix, generator=self.generator, greedy=False)
