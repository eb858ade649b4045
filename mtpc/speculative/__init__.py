"""Exact self-speculative decoding with circuit drafts (batch 1).

`acceptance.py`: the acceptance rule as pure functions; `loop.py`: the keep / drop cycles and
the plain baseline against an `Engine` that owns the caches; `model.py`: `MtpcModel`, the
public API; `stats.py`: what a generation returns and its metrics; `drafters.py`: head + draft
captured as a CUDA graph or compiled; `offline.py`: the keep cycle's acceptance counts
from one teacher-forced pass over the plain model's text (no decoding).
"""

from mtpc.speculative.loop import DecodeConfig, plain_decode, speculative_decode
from mtpc.speculative.model import MtpcModel
from mtpc.speculative.stats import GenerationOutput, GenerationStats

__all__ = [
    "DecodeConfig",
    "GenerationOutput",
    "GenerationStats",
    "MtpcModel",
    "plain_decode",
    "speculative_decode",
]
