"""What one generation reports: `GenerationOutput` (ids, text, stats) and `GenerationStats` (the
DESIGN section 3 metrics, from the loop's `DecodeStats`), and the peak-memory reading they carry
(`reset_peak_memory`, `peak_memory_bytes`; training reports the same figure).

Leaves out: decoding itself (loop.py, model.py).
"""

from __future__ import annotations

import resource
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

from mtpc.speculative.loop import DecodeStats


@dataclass
class GenerationStats:
    """Metrics of one generation, named as in DESIGN section 3 (plain decoding: one 'cycle' per byte)."""

    mu_lat: float  # mean seconds per cycle, prefill excluded
    mu_acc: float  # mean accepted drafted bytes per cycle (0 for plain decoding)
    tokens_per_cycle: float  # mean bytes emitted per cycle
    throughput: float  # bytes emitted by cycles / decode seconds (measured)
    max_throughput: float  # window / mu_lat
    cycles: int
    generated: int  # bytes returned (the prefill byte included)
    decode_generated: int  # bytes returned that came from cycles
    prefill_s: float
    decode_s: float
    backbone_calls: int
    peak_mem_bytes: int
    window: int
    extra_token: str  # keep | drop | plain
    mode: str
    per_position_acceptance: list[float | None] = field(default_factory=list)  # (n,) None = never tested
    tested_at: list[int] = field(default_factory=list)  # (n,)
    accepted_at: list[int] = field(default_factory=list)  # (n,)
    accepted_length_histogram: list[int] = field(default_factory=list)  # (n+1,) cycles with s = i
    cycle_s: list[float] = field(default_factory=list)

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_run(cls, st: DecodeStats, mode: str, peak_mem_bytes: int) -> GenerationStats:
        cycles = len(st.cycle_s)
        decode_s = float(sum(st.cycle_s))
        mu_lat = decode_s / cycles if cycles else 0.0
        hist = [0] * (st.window + 1)
        for s in st.accepted:
            hist[s] += 1
        if st.extra_token == "plain":
            mu_acc, tpc = 0.0, 1.0
        else:
            mu_acc = sum(st.accepted) / cycles if cycles else 0.0
            tpc = sum(st.emitted) / cycles if cycles else 0.0
        return cls(
            mu_lat=mu_lat,
            mu_acc=mu_acc,
            tokens_per_cycle=tpc,
            throughput=st.decode_generated / decode_s if decode_s > 0 else 0.0,
            max_throughput=st.window / mu_lat if mu_lat > 0 else 0.0,
            cycles=cycles,
            generated=st.generated,
            decode_generated=st.decode_generated,
            prefill_s=st.prefill_s,
            decode_s=decode_s,
            backbone_calls=st.backbone_calls,
            peak_mem_bytes=peak_mem_bytes,
            window=st.window,
            extra_token=st.extra_token,
            mode=mode,
            per_position_acceptance=[
                a / t if t else None for a, t in zip(st.accepted_at, st.tested_at, strict=True)
            ],
            tested_at=list(st.tested_at),
            accepted_at=list(st.accepted_at),
            accepted_length_histogram=hist if st.extra_token != "plain" else [],
            cycle_s=list(st.cycle_s),
        )


@dataclass
class GenerationOutput:
    ids: Tensor  # (T,) generated ids only (no prompt)
    text: str  # decoded with the backbone's tokenizer ("" without one); special ids dropped
    stats: GenerationStats


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak on CUDA (the CPU's peak resident set cannot be reset)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device | None = None) -> int:
    """Peak device memory allocated on CUDA; elsewhere the process's peak resident set (never reset).
    device None: CUDA's current device when CUDA is in use in this process, else the CPU."""
    cuda = (
        torch.cuda.is_available() and torch.cuda.is_initialized() if device is None else device.type == "cuda"
    )
    if cuda:
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
