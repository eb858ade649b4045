"""The process-wide cache of fused decoding-and-teacher-forced passes (k = 0 heads), beside the on-disk
continuation cache (continuation_cache.py).

`fused_pass(bb, prompts, cfg, seeds, batch, cache)` is `offline.decode_and_force`, remembered in this
process under the continuation cache's key: the texts and the pass of a k = 0 head depend on the
verifier, the prompts, the decode config, the seeds and the batch, not on the head, so a sweep
worker evaluating trial after trial on the same prompt sets decodes each once. The least recently
used passes are dropped beyond `$MTPC_PASS_MEMO_MB` megabytes of hidden states (default 2048; 0: off).

Leaves out: anything on disk (continuation_cache.py), the pass itself (offline.py).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

import torch

from mtpc.backbones.common import Backbone

PASS_MEMO_ENV = "MTPC_PASS_MEMO_MB"
"""Megabytes of k = 0 passes kept in the process for later evaluations on the same texts (default 2048; 0: off)."""
PASSES: OrderedDict[str, Any] = OrderedDict()
"""The kept passes by continuation key, least recently used first."""


def memo_limit_bytes() -> int:
    """`$MTPC_PASS_MEMO_MB` in bytes; ValueError naming the variable when it is not a number."""
    try:
        return int(float(os.environ.get(PASS_MEMO_ENV, "2048")) * 2**20)
    except ValueError:
        raise ValueError(
            f"${PASS_MEMO_ENV}={os.environ[PASS_MEMO_ENV]!r}: expected megabytes, e.g. 2048 (0: off)"
        ) from None


def fused_pass(
    bb: Backbone, prompts: list[torch.Tensor], cfg: Any, seeds: list[int], batch: int, cache: bool
) -> Any:
    """`decode_and_force(bb, prompts, cfg, seeds, batch)`, kept in this process under the continuation
    cache's key; `cache` False (the continuation cache off: weights the key may not tell apart)
    computes afresh and keeps nothing."""
    from mtpc.speculative.continuation_cache import continuation_key
    from mtpc.speculative.offline import decode_and_force

    limit = memo_limit_bytes()
    if not cache or limit <= 0:
        return decode_and_force(bb, prompts, cfg, seeds=seeds, batch_size=batch)
    key = continuation_key(bb, prompts, cfg, seeds, batch)[0]
    if key in PASSES:
        PASSES.move_to_end(key)
        return PASSES[key]
    tf = decode_and_force(bb, prompts, cfg, seeds=seeds, batch_size=batch)
    PASSES[key] = tf

    def size(t: Any) -> int:
        return sum(h.numel() * h.element_size() for h in t.hidden)

    while PASSES and sum(size(t) for t in PASSES.values()) > limit:
        PASSES.popitem(last=False)
    return tf
