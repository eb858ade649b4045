"""The draft length: a cycle that drafts the head's window n and feeds its first m < n bytes
(mtpc/speculative/loop.py, "The draft length"; `MtpcModel.generate(draft_len=)`,
`offline_acceptance(draft_len=)`).

- Greedy: identical to plain decoding at every m, and the offline counts equal the loop's cycle
  for cycle at every m (every circuit kind, known-byte heads too); at m < n no cycle accepts more
  than m - 1 drafts and positions past m are never tested.
- Sampling, exact: every random path of the loop with a window-3 head fed 2 bytes against plain
  sampling (total variation), and the offline expectations against the enumerated loop's.
- Validation: m outside [2, n] refused in one line, for the model and the offline counts.
"""

from __future__ import annotations

import pytest
import torch

from mtpc import MtpcModel
from mtpc.backbones import make_engine
from mtpc.speculative.acceptance import TorchChooser
from mtpc.speculative.loop import CircuitDrafter, DecodeConfig, plain_decode, speculative_decode
from mtpc.speculative.offline import offline_acceptance, teacher_force
from tests.mtpc.test_decoding_engines import _sparse_head
from tests.mtpc.test_offline_acceptance import _SparseHead
from tests.mtpc.test_speculative import RANK, _heads, _peaked_backbone, _prompts
from tests.speculative_helpers import circuit_enum_drafter, enumerate_outcomes, total_variation


def _online(m, prompt, cfg, draft_len, gen=None):
    with torch.inference_mode():
        return speculative_decode(
            make_engine(m.backbone, len(prompt) + cfg.max_new_tokens + m.window), m._head_fn,
            CircuitDrafter(m.circuit, gen), draft_len, prompt, cfg, TorchChooser(gen),
        )  # fmt: skip


@pytest.mark.parametrize("lora_depth", [0, 1])
def test_greedy_draft_len_is_plain_and_offline_equals_the_loop(lora_depth):
    bb = _peaked_backbone(lora_depth, attn="sdpa")
    prompts = _prompts(bb.vocab_size, 6, seed=3)
    cfg = DecodeConfig(max_new_tokens=16, mode="greedy", eos_id=bb.eos_token_id, ban_eos=True)
    plain = []
    with torch.inference_mode():
        for p in prompts:
            eng = make_engine(bb, len(p) + cfg.max_new_tokens + 1, draft=False)
            plain.append(plain_decode(eng, p, cfg, TorchChooser(None))[0])
    tf = teacher_force(bb, prompts, plain, cfg, batch_size=3)
    full_tested = 0
    for name, m in _heads(bb, 5).items():
        for draft_len in (2, 3, 5):
            runs = [_online(m, p, cfg, draft_len) for p in prompts]
            off = offline_acceptance(tf, m.head, draft_len=draft_len)
            for (out, st), o, ref in zip(runs, off, plain, strict=True):
                assert out == ref, (name, draft_len)
                assert st.window == o.window == draft_len
                assert max(st.accepted) <= draft_len - 1
                assert o.accepted_per_cycle == st.accepted, (name, draft_len)
                assert o.tested_at == st.tested_at and o.accepted_at == st.accepted_at
                if draft_len == 3:
                    full_tested += st.tested_at[2]
    assert full_tested > 0  # not vacuous: cycles reached the last fed position


def test_model_generate_draft_len_feeds_fewer_bytes(monkeypatch):
    bb = _peaked_backbone()
    m = MtpcModel.from_components(bb, {"kind": "btree", "window": 4, "rank": 3, "seed": 0}, draft_len=3)
    fed = []
    real = type(m.engine(True, 64)).feed

    def feed(self, ids):
        fed.append(int(ids.shape[0]))
        return real(self, ids)

    monkeypatch.setattr(type(m.engine(True, 64)), "feed", feed)
    prompt = torch.tensor([2, 3, 1])
    plain = m.generate_plain(prompt, max_new_tokens=12, ban_eos=True).ids.tolist()
    fed.clear()
    out = m.generate(prompt, max_new_tokens=12, ban_eos=True)
    assert out.ids.tolist() == plain and out.stats.window == 3
    assert set(fed[1:]) == {3}  # every cycle after the prefill feeds 3 bytes
    fed.clear()
    assert m.generate(prompt, max_new_tokens=12, ban_eos=True, draft_len=4).ids.tolist() == plain
    assert set(fed[1:]) == {4}


N, M, T = 3, 2, 4
PROMPT = torch.tensor([2, 0, 2])


@pytest.mark.parametrize("kind,known", [("btree", False), ("cp", True), ("hmm", False)])
def test_sampled_draft_len_is_exact_by_enumeration(kind, known):
    """A window-3 head fed 2 bytes a cycle: every random path (T = 4, v = 3) against plain sampling,
    and the offline expectations (draft_len = 2) against the enumerated loop's."""
    bb = _peaked_backbone(0, vocab=3, scale=2.0, attn="sdpa")
    m = MtpcModel.from_components(
        bb, {"kind": kind, "window": N, "rank": min(RANK[kind], 2), "seed": 1, "known_byte": known}
    )
    head_fn = _sparse_head(m, allowed=(0, 2))
    cfg = DecodeConfig(max_new_tokens=T, mode="sample", top_p=0.95, eos_id=1, ban_eos=False)

    def online(choose):
        with torch.inference_mode():
            eng = make_engine(bb, len(PROMPT) + T + N)
            out, st = speculative_decode(
                eng, head_fn, circuit_enum_drafter(m.circuit, choose), M, PROMPT, cfg, choose
            )
        return tuple(out), (sum(st.accepted), len(st.accepted), *st.tested_at, *st.accepted_at)

    def plain(choose):
        with torch.inference_mode():
            return tuple(plain_decode(make_engine(bb, len(PROMPT) + T, draft=False), PROMPT, cfg, choose)[0])

    paths = enumerate_outcomes(online)
    texts = enumerate_outcomes(plain)
    spec_texts: dict = {}
    for (text, _), w in paths.items():
        spec_texts[text] = spec_texts.get(text, 0.0) + w
    assert total_variation(spec_texts, texts) < 1e-6
    keys = list(paths)
    loop = [sum(paths[k] * k[1][j] for k in keys) for j in range(len(keys[0][1]))]
    tf = teacher_force(bb, [PROMPT] * len(texts), [list(y) for y in texts], cfg)
    off = offline_acceptance(tf, _SparseHead(m.head, head_fn), draft_len=M)
    weights = list(texts.values())
    rows = [(o.accepted, o.cycles, *o.tested_at, *o.accepted_at) for o in off]
    expect = [sum(w * r[j] for w, r in zip(weights, rows, strict=True)) for j in range(len(rows[0]))]
    assert loop[0] > 0.2  # drafts accepted
    for a, b in zip(loop, expect, strict=True):
        assert abs(a - b) < 1e-10, (loop, expect)


def test_draft_len_refused_outside_two_to_n():
    bb = _peaked_backbone()
    spec = {"kind": "cp", "window": 4, "rank": 3}
    for bad in (1, 5, True, 2.0, "3"):
        with pytest.raises(ValueError, match=r"draft_len: expected an integer in \[2, 4\]"):
            MtpcModel.from_components(bb, spec, draft_len=bad)
    m = MtpcModel.from_components(bb, spec)
    with pytest.raises(ValueError, match=r"draft_len: expected an integer in \[2, 4\]"):
        m.generate(torch.tensor([1, 2]), max_new_tokens=4, draft_len=5)
    cfg = DecodeConfig(max_new_tokens=4, mode="greedy")
    tf = teacher_force(bb, [torch.tensor([1, 2])], [[3, 3, 3, 3]], cfg)
    with pytest.raises(ValueError, match=r"draft_len: expected an integer in \[2, 4\]"):
        offline_acceptance(tf, m.head, draft_len=1)
