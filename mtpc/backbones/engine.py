"""The `Engine` protocol the decoding loop runs on, the HF-layer engine, and `make_engine`.

An engine owns every cache of one sequence (trunk, verifier top, draft top) and answers one
call: `feed(ids (T,))` appends T positions and returns the verifier's logits and the draft top's
hidden state for them (`StepOutput`, valid until the next feed); `crop(length)` forgets every
position >= length; `reset(capacity)` starts a new sequence of at most `capacity` positions.

Two implementations: `LlamaEngine` (llama.py: the compact forward with preallocated caches, for
transformers Llamas) and `AdapterEngine` (here: the backbone adapter's HF decoder layers with
their growing caches; any architecture the adapters wrap, EvaByte included). `make_engine`
picks by the adapter's `engine` attribute ("compact" or "hf", resolved when it was built).
Leaves out: the adapters themselves (hf_llama.py, evabyte.py) and the decoding cycle (speculative/).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor

from mtpc.backbones.common import Backbone, StepOutput
from mtpc.names import DECODE_ENGINES


class Engine(Protocol):
    """Owns every cache. `feed` = one backbone call that appends `ids` to all caches."""

    length: int
    calls: int

    def feed(self, ids: Tensor) -> StepOutput: ...  # ids (T,)

    def crop(self, length: int) -> None: ...


class AdapterEngine:
    """An `Engine` on a backbone adapter's HF layers (trunk + verifier top + draft top, one cache object)."""

    def __init__(self, backbone: Backbone, capacity: int = 0):
        self.backbone = backbone
        self.reset(capacity)

    def reset(self, capacity: int = 0) -> None:
        self.cache = self.backbone.new_cache()
        self.length = 0
        self.calls = 0

    def feed(self, ids: Tensor) -> StepOutput:
        out = self.backbone(ids.unsqueeze(0), self.cache)
        self.calls += 1
        self.length += ids.shape[0]
        return StepOutput(self.backbone.stp_logits(out.verify_hidden[0]), out.draft_hidden[0])

    def crop(self, length: int) -> None:
        self.cache.crop(length)
        self.length = length


def resolve_engine_kind(engine: str, model: Any) -> str:
    """ "auto" -> "compact" when the compact Llama forward implements `model`, else "hf";
    "compact" on a model it does not implement raises ValueError naming the field."""
    from mtpc.backbones.llama import llama_unsupported

    if engine not in DECODE_ENGINES:
        raise ValueError(f"engine={engine!r}: expected one of {DECODE_ENGINES}")
    if engine == "hf":
        return "hf"
    reason = llama_unsupported(model)
    if reason and engine == "compact":
        raise ValueError(f"engine='compact': {reason}; use engine='hf' (or 'auto')")
    return "hf" if reason else "compact"


def verifier_only(backbone: Backbone) -> Backbone:
    """The same weights without the draft top (an adapter with lora_depth = 0), so the plain
    baseline does not pay for it."""
    return backbone.without_draft() if backbone.lora_depth > 0 else backbone


def make_engine(
    backbone: Backbone, capacity: int = 0, draft: bool = True, cuda_graphs: bool | None = None, **kw: Any
):
    """The engine for `backbone` (its `engine` attribute picks compact or HF layers).

    draft: False gives the verifier alone (plain decoding pays for no draft top).
    cuda_graphs: capture the compact step / verify on CUDA (None: on when the device is CUDA).
    kw: `LlamaEngine` options (static, lora, compile, weights).
    """
    if getattr(backbone, "engine", "hf") == "compact":
        from mtpc.backbones.llama import LlamaEngine

        graphs = backbone.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        return LlamaEngine(backbone, capacity, draft=draft, cuda_graphs=graphs, **kw)
    return AdapterEngine(backbone if draft else verifier_only(backbone), capacity)


def cuda_sync(device: torch.device):
    """A synchronise function for timing on CUDA, None elsewhere."""
    return torch.cuda.synchronize if device.type == "cuda" else None
