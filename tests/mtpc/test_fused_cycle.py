"""The fused keep cycle (mtpc/speculative/fused_cycle.py), run eagerly on the CPU: the function a GPU
captures as one CUDA graph. Greedy: the same bytes as plain decoding and the same accepted counts as
the loop, at every byte budget and with stop ids allowed; sampling: the output distribution of plain
sampling (chi-square against the enumerated exact one, whose power tests/mtpc/test_speculative_sampling.py
shows on the drop cycle); one host read per cycle; refusals."""

from __future__ import annotations

import collections

import pytest
import torch

from mtpc import MtpcModel
from mtpc.backbones import make_engine
from mtpc.circuits import CIRCUIT_KINDS
from mtpc.speculative.acceptance import TorchChooser
from mtpc.speculative.fused_cycle import FusedKeepCycle
from mtpc.speculative.loop import DecodeConfig, fused_speculative_decode
from tests.mtpc.test_decoding_engines import _HostReads
from tests.mtpc.test_speculative import RANK, _heads, _peaked_backbone, _prompts
from tests.mtpc.test_speculative_sampling import ALPHA, N_RUNS, PROMPT, T, _exact_plain, chi_square_pvalue


def _fused(m: MtpcModel) -> MtpcModel:
    return MtpcModel(m.backbone, m.head, fused_cycle=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("lora_depth", [0, 1])
def test_fused_greedy_equals_plain_and_the_loop(lora_depth, dtype):
    bb = _peaked_backbone(lora_depth, scale=1.5, engine="compact", dtype=dtype)
    accepted = 0
    for name, m in _heads(bb, 4).items():
        f = _fused(m)
        for p in _prompts(bb.vocab_size, 3):
            for new, ban in ((20, True), (7, True), (2, True), (1, True), (20, False)):
                got = f.generate(p, max_new_tokens=new, ban_eos=ban)
                plain = f.generate_plain(p, max_new_tokens=new, ban_eos=ban)
                loop = m.generate(p, max_new_tokens=new, ban_eos=ban)
                assert got.ids.tolist() == plain.ids.tolist() == loop.ids.tolist(), (name, p, new, ban)
                if dtype == torch.float64:  # the same drafts and rule: the same acceptances
                    assert got.stats.accepted_length_histogram == loop.stats.accepted_length_histogram
                    assert got.stats.per_position_acceptance == loop.stats.per_position_acceptance
                assert got.stats.decode_generated == len(got.ids) - 1
                accepted += round(got.stats.mu_acc * got.stats.cycles)
    assert accepted > 0  # not vacuous: drafts were accepted


@pytest.fixture(scope="module")
def peaked():
    bb = _peaked_backbone(0, vocab=4, scale=2.0, engine="compact")
    return bb, _exact_plain(bb)


@pytest.mark.parametrize("kind", ["btree-known", "cp"])
def test_fused_sampling_matches_plain_distribution(peaked, kind):
    bb, exact = peaked
    base, _, known = kind.partition("-")
    spec = {"kind": base, "window": 3, "rank": RANK[base], "seed": 1, "known_byte": bool(known)}
    m = MtpcModel.from_components(bb, spec, fused_cycle=True)
    with torch.no_grad():
        m.head.leaf_weight.mul_(10.0)
    counts = collections.Counter(
        tuple(m.generate(PROMPT, max_new_tokens=T, mode="sample", seed=i, ban_eos=True).ids.tolist())
        for i in range(N_RUNS)
    )
    assert m._fused and all(c.graph is None for c in m._fused.values())  # the eager function ran
    assert chi_square_pvalue(counts, exact, N_RUNS) > ALPHA


def test_one_host_read_per_fused_cycle():
    bb = _peaked_backbone(0, scale=1.5, engine="compact")
    prompt, new = torch.tensor([2, 3]), 20
    for kind in CIRCUIT_KINDS:
        m = MtpcModel.from_components(bb, {"kind": kind, "window": 4, "rank": RANK[kind]})
        for mode in ("greedy", "sample"):
            cfg = DecodeConfig(max_new_tokens=new, mode=mode, eos_id=1, ban_eos=True)
            gen = torch.Generator().manual_seed(0)
            engine = make_engine(bb, len(prompt) + new + 4, static=True)
            cycle = FusedKeepCycle(engine, m._head_fn, m.circuit, 4, cfg, gen)
            reads = _HostReads()
            with torch.inference_mode(), reads:
                _, st = fused_speculative_decode(engine, cycle, 4, prompt, cfg, TorchChooser(gen), reads.mark)
            assert reads.per_cycle() == [1] * len(st.cycle_s), (kind, mode, reads.per_cycle())
            assert st.backbone_calls == 1 + len(st.cycle_s)


def test_fused_cycle_refusals_and_the_drop_cycle():
    bb = _peaked_backbone(0, scale=1.5, engine="compact")
    spec = {"kind": "btree", "window": 4, "rank": RANK["btree"]}
    m = MtpcModel.from_components(bb, spec, fused_cycle=True)
    cfg = DecodeConfig(max_new_tokens=8)
    with pytest.raises(ValueError, match="static shapes"):
        FusedKeepCycle(make_engine(bb, 16, static=False), m._head_fn, m.circuit, 4, cfg, None)
    with pytest.raises(ValueError, match="keep cycle only"):
        FusedKeepCycle(make_engine(bb, 16, static=True), m._head_fn, m.circuit, 4,
                       DecodeConfig(max_new_tokens=8, extra_token="drop"), None)  # fmt: skip
    with pytest.raises(ValueError, match="compact engine"):
        MtpcModel.from_components(_peaked_backbone(0, engine="hf"), spec, fused_cycle=True)
    p = torch.tensor([2, 0, 3])
    drop = m.generate(p, max_new_tokens=12, extra_token="drop", ban_eos=True)  # the drop cycle: the loop's
    assert drop.ids.tolist() == m.generate_plain(p, max_new_tokens=12, ban_eos=True).ids.tolist()
    assert not m._fused
