"""`CapturedFn`: a function of fixed-shape tensors captured once as a CUDA graph and replayed;
`compile_static`: the same kind of function through torch.compile with static shapes.

Used for the compact engine's 1-byte step and n-byte verify (llama.py) and for head + draft
(speculative/drafters.py). The inputs are copied into static buffers, the graph is replayed, and
the static outputs are returned: they are overwritten by the next replay, so callers keep what
they need across calls by cloning. Each graph has its own memory pool (they are replayed in
any order). A random generator the function draws from must be passed so the graph advances it.

UNVERIFIED: this machine has no GPU; bench/bench_gpu.py checks replay == eager on CUDA.
`compile_static(fn, device)` is what `compile=True` uses (the compact engine's decoding calls,
the greedy head + draft): dynamic=False, one graph per input shape, and on the CPU inductor's
C++ wrapper (most of the per-kernel Python overhead gone; needs a C++ compiler).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor


class CapturedFn:
    def __init__(
        self,
        fn: Callable[..., Tensor | tuple[Tensor, ...]],
        example: Sequence[Tensor],
        warmup: int = 2,
        generator: torch.Generator | None = None,
    ):
        self.static_in = [t.clone() for t in example]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture stream (lazy inits, workspaces)
            for _ in range(warmup):
                fn(*self.static_in)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        if generator is not None:
            self.graph.register_generator_state(generator)
        with torch.cuda.graph(self.graph):
            self.static_out = fn(*self.static_in)

    def __call__(self, *inputs: Tensor):
        for buf, t in zip(self.static_in, inputs, strict=True):
            buf.copy_(t)
        self.graph.replay()
        return self.static_out


def compile_static(fn: Callable, device: torch.device) -> Callable:
    """fn through torch.compile with static shapes (a graph per input shape, compiled on first use)."""
    opts = {"cpp_wrapper": True} if torch.device(device).type == "cpu" else {}
    return torch.compile(fn, dynamic=False, options=opts)
