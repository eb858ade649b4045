"""Batched plain decoding on the compact Llama forward (mtpc/backbones/llama_batch.py) equals batch 1.

Prompts of different lengths (left padding, per-row RoPE positions, padding masked), float64 tiny
Llamas with grouped-query attention, k in {0, 1} (the verifier alone either way), the rows in one
group or in groups with caches of their own: greedy and sampled continuations (per-row seeds) at
batch B equal batch-1 `plain_decode` byte for byte, EOS banned (every row runs to max_new_tokens)
and allowed (rows stop on their own). tokenkit's byte Llama (each row's expanded ids):
tests/mtpc/test_tpu_llama.py.
"""

from __future__ import annotations

import pytest
import torch

from mtpc.backbones import make_engine
from mtpc.backbones.llama_batch import LlamaBatchEngine
from mtpc.speculative.acceptance import TorchChooser
from mtpc.speculative.loop import DecodeConfig, plain_decode, plain_decode_batch
from tests.mtpc.test_speculative import _peaked_backbone


def _prompts(vocab, count, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, vocab, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g)
        for _ in range(count)
    ]


def _batch1(bb, prompts, cfg, seeds):
    out = []
    with torch.inference_mode():
        for p, seed in zip(prompts, seeds, strict=True):
            gen = torch.Generator().manual_seed(seed)
            out.append(plain_decode(make_engine(bb, len(p) + cfg.max_new_tokens + 1, draft=False), p, cfg,
                                    TorchChooser(gen))[0])  # fmt: skip
    return out


@pytest.mark.parametrize("groups", [None, [2, 4, 1]])
@pytest.mark.parametrize("lora_depth", [0, 1])
@pytest.mark.parametrize("mode", ["greedy", "sample"])
def test_batch_equals_batch_one(mode, lora_depth, groups):
    bb = _peaked_backbone(lora_depth, vocab=8, scale=1.5)  # 2 query heads per key head
    prompts = _prompts(8, 7, seed=3)
    seeds = list(range(10, 17))
    engine = LlamaBatchEngine(bb)
    for ban in (True, False):
        cfg = DecodeConfig(max_new_tokens=24, mode=mode, eos_id=1, ban_eos=ban)
        ref = _batch1(bb, prompts, cfg, seeds)
        got = plain_decode_batch(
            engine,
            prompts,
            cfg,
            [TorchChooser(torch.Generator().manual_seed(s)) for s in seeds],
            groups=groups,
        )
        assert got == ref
        if ban:
            assert all(len(y) == 24 for y in got)
        else:  # not vacuous: some rows stopped early while others ran on
            assert min(len(y) for y in got) < 24 and len({len(y) for y in got}) > 1, [len(y) for y in got]


def test_groups_must_partition_the_rows():
    engine = LlamaBatchEngine(_peaked_backbone(0, vocab=8))
    prompts = _prompts(8, 3)
    for bad in ([1, 1], [0, 3], [2, 2]):
        with pytest.raises(ValueError, match="groups: sizes >= 1 summing to the 3 prompts"):
            engine.prefill(prompts, 4, bad)
