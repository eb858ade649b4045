"""The keep cycle as one function of device tensors, captured as one CUDA graph per decoding setting.

`FusedKeepCycle(engine, head_fn, circuit, window, cfg, generator, graphs)` runs a whole keep cycle —
head + draft, the engine's static `window`-byte verify at positions given as a device tensor, the
accept — from four device inputs: the head's input state h (d,), the known byte c (1,), the
positions (window,) and the byte budget (1,). It returns device tensors only: [s, extra, testable
count, drafts] (the cycle's one host read), the next cycle's h (the draft top's state at the last
accepted byte, picked on the device by s) and its c (the extra token). With `graphs` (CUDA and the
compact engine's static shapes) the function is captured once per setting with the generator
registered, so replays draw from it as eager calls do; a failed capture runs eagerly and says why
(`error`). Elsewhere it runs eagerly: the same function, which the CPU tests check against plain
decoding (greedy: identical; sampling: exact distributions).

Why: separately graphed draft and verify with an eager accept leave the accept's small kernels,
their launches and the Python between them in every cycle (0.5-0.9 ms a cycle on the H200, against a
~4.9 ms step). The sampled accept draws with `TorchChooser`'s exponential race (no host read, so it
can be captured). The greedy and sampled rules are `greedy_verify` and `sample_verify`, the tested
device rules, with `testable_drafts` reading the budget from a device tensor.

Used by `fused_speculative_decode` (mtpc/speculative/loop.py) and `MtpcModel(fused_cycle=True)`.
Only the keep cycle: the drop cycle's extra call depends on s and stays eager. Unverified on a GPU
(no GPU here): `bench/bench_gpu.py` checks capture, replay against eager and greedy identity there.
Leaves out: the host side of the cycle (crop, stop rule, statistics: loop.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mtpc.speculative.acceptance import (
    TorchChooser,
    as_index,
    greedy_target,
    greedy_verify,
    sample_verify,
    target_probs,
    testable_drafts,
)


class FusedKeepCycle:
    """One keep cycle as one function of device tensors (module docstring); `__call__` advances the
    engine's length by the window (the caller crops to a + 1 + s after reading s)."""

    def __init__(
        self,
        engine: Any,
        head_fn: Any,
        circuit: Any,
        window: int,
        cfg: Any,
        generator: torch.Generator | None,
        graphs: bool = False,
    ):
        if not getattr(engine, "static", False) or not hasattr(engine, "forward_at"):
            raise ValueError(
                "fused cycle: needs the compact engine with static shapes (LlamaEngine(static=True))"
            )
        if getattr(engine, "expand", None) is not None:
            raise ValueError("fused cycle: an engine with expanded input ids keeps host state per byte")
        if cfg.extra_token != "keep":
            raise ValueError(f"fused cycle: the keep cycle only (got extra_token={cfg.extra_token!r})")
        self.engine, self.head_fn, self.circuit, self.window = engine, head_fn, circuit, window
        self.greedy = cfg.mode == "greedy"
        self.temperature, self.top_p = cfg.temperature, cfg.top_p
        self.stop_ids = list(cfg.stop_ids)
        banned = cfg.banned
        banned = [] if banned is None else [banned] if isinstance(banned, int) else list(banned)
        self.banned = torch.tensor(banned, dtype=torch.long, device=engine.device) if banned else None
        self.generator = generator
        self.graphs = graphs and engine.device.type == "cuda"
        self.graph: Any = None
        self.error: str | None = None
        self.epoch = -1  # the engine's graph_epoch at capture

    def cycle(self, h: Tensor, c: Tensor, pos: Tensor, budget: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """h (d,), c (1,), pos (window,), budget (1,) -> ([s, extra, testable count, *drafts], next h
        (d,), next c (1,)), all on the device."""
        theta = self.head_fn(h, c)
        x, log_q = self.circuit._draft(
            theta, c, generator=self.generator, greedy=self.greedy, conditionals=not self.greedy
        )
        x = x[: self.window]  # the first `window` bytes of the head's n
        out = self.engine.forward_at(x, pos)  # (window, v), (window, d): caches written at pos
        draft = x[1:]
        ok = testable_drafts(draft, budget, self.stop_ids)
        if self.greedy:  # the ban as a device index: no host list inside a captured graph
            s, extra = greedy_verify(draft, greedy_target(out.p_logits, self.banned), ok)
        else:
            p = target_probs(out.p_logits, self.temperature, self.top_p, self.banned)
            q = log_q[1 : self.window].exp().to(p.dtype)
            s, extra = sample_verify(draft, p, q, TorchChooser(self.generator), ok)
        s, extra = as_index(s, x.device), as_index(extra, x.device)
        info = torch.cat([s, extra, ok.sum().view(1), draft])
        return info, out.draft_hidden.index_select(0, s)[0], extra

    def __call__(self, h: Tensor, c: Tensor, start: int, budget: int) -> tuple[Tensor, Tensor, Tensor]:
        """One cycle at `start` cached positions with `budget` bytes left to test (the drafts a cycle
        may emit before the last byte); the engine's length moves to start + window."""
        from mtpc.backbones.graphs import CapturedFn

        eng = self.engine
        eng.check_room(start, self.window)
        pos = eng.positions[start : start + self.window]
        budget_t = torch.tensor([budget], dtype=torch.long).to(eng.device, non_blocking=True)
        args = (h, c, pos, budget_t)
        if self.graph is not None and self.epoch != eng.graph_epoch:
            self.graph = None  # the engine replaced its caches or weights: capture again
        if self.graphs and self.graph is None and self.error is None:
            self.epoch = eng.graph_epoch
            try:  # the warm-up and capture write this cycle's own keys / values at pos: idempotent
                self.graph = CapturedFn(self.cycle, args, generator=None if self.greedy else self.generator)
            except Exception as e:  # noqa: BLE001 - any capture failure: run eagerly, say why
                self.error = f"{type(e).__name__}: {e}"
        with torch.inference_mode():
            got = self.graph(*args) if self.graph is not None else self.cycle(*args)
        eng.length = start + self.window
        eng.calls += 1
        return got
