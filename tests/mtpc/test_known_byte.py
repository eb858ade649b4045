"""Known-byte heads (`HeadConfig.known_byte`): the head reads e + E[c], c the window's first byte.

Here: the config field; forward and the decoder read c (and a plain head ignores it); the
decoder equals the normalised forward and its draft equals the unfused one; export format 2
round trip, version-1 exports load as known_byte False; drop refused in one line; the loop hands
each cycle's c (the byte emitted last) to the head; the compiled greedy draft on the CPU (slow).
Elsewhere, parametrized over known-byte heads: the window loss against its definition and chunked
against naive (test_losses*.py), greedy = plain and the keep cycle's exactness by enumeration
(test_speculative.py, test_decoding_engines.py), the chi-square check (test_speculative_sampling.py),
offline = online acceptance (test_offline_acceptance.py), training (tests/experiments).
"""

from __future__ import annotations

import json

import pytest
import torch

from mtpc import MtpcModel
from mtpc.circuits import CIRCUIT_KINDS
from mtpc.heads import FORMAT_VERSION, HeadConfig, load_head, random_head, save_head
from mtpc.speculative.acceptance import TorchChooser
from mtpc.speculative.loop import CircuitDrafter, DecodeConfig, speculative_decode
from tests.mtpc.test_speculative import RANK, _peaked_backbone


def _head(kind="cp", n=3, v=6, d=5, delta=0, known=True, dtype=torch.float64, seed=0):
    cfg = HeadConfig(kind, n, RANK[kind], v, d, leaf_delta_rank=delta, known_byte=known)
    return random_head(cfg, seed, init="unembedding", sum_std=1.0).to(dtype)


def test_config_field_is_checked_and_sets_the_first_scored_position():
    assert HeadConfig("cp", 3, 2, 6, 5).first_scored == 1
    assert HeadConfig("cp", 3, 2, 6, 5, known_byte=True).first_scored == 2
    with pytest.raises(ValueError, match="known_byte: expected true or false"):
        HeadConfig("cp", 3, 2, 6, 5, known_byte=1)


@pytest.mark.parametrize("kind", CIRCUIT_KINDS)
def test_forward_reads_c_and_a_plain_head_ignores_it(kind):
    head = _head(kind)
    e, c = torch.randn(4, 5, dtype=torch.float64), torch.tensor([0, 1, 2, 5])
    with pytest.raises(ValueError, match="c: a known-byte head needs the known byte"):
        head(e)
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        head(e, c[:2])
    out = head(e, c)
    want = head.logits(e + head.known_embedding[c])
    for name in want:
        torch.testing.assert_close(out[name], want[name], rtol=0, atol=0)
    other = head(e, (c + 1) % 6)
    assert (other["leaves"] - out["leaves"]).abs().max() > 1e-3  # c moves the leaves (and every sum unit)
    plain = _head(kind, known=False)
    assert not hasattr(plain, "known_embedding")
    for name, t in plain(e).items():
        assert torch.equal(plain(e, c)[name], t)


@pytest.mark.parametrize("kind", CIRCUIT_KINDS)
@pytest.mark.parametrize("delta", [0, 2])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_decoder_params_and_draft_equal_the_normalised_forward(kind, delta, dtype):
    head = _head(kind, delta=delta, dtype=dtype)
    dec = head.decoder()  # float32: oneDNN's product where it runs
    tol = dict(rtol=0, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    e = torch.randn(5, dtype=dtype)
    for c in (torch.tensor([3]), torch.tensor(4)):
        want = head.circuit.normalize(head(e.unsqueeze(0), c.reshape(1)))
        got = dec.params(e, c)
        for name in want:
            torch.testing.assert_close(got[name], want[name][0], **tol)
    with pytest.raises(ValueError, match="c: a known-byte head needs the known byte"):
        dec.params(e)
    with pytest.raises(ValueError, match="c: a known-byte head needs the known byte"):
        dec.params(e, torch.tensor([1, 2]))
    prefix = torch.tensor([2])
    for greedy in (False, True):
        x1, q1 = dec.draft(e, prefix, torch.Generator().manual_seed(7), greedy)
        x2, q2 = head.circuit._draft(dec.params(e, prefix), prefix, generator=torch.Generator().manual_seed(7),
                                     greedy=greedy)  # fmt: skip
        assert torch.equal(x1, x2) and torch.equal(q1, q2) and int(x1[0]) == 2


def test_export_version_2_round_trip_and_version_1_loads_as_known_byte_false(tmp_path):
    head = _head("btree", delta=2, dtype=torch.float32)
    save_head(tmp_path / "known", head)
    config = json.loads((tmp_path / "known" / "config.json").read_text())
    assert config["format_version"] == FORMAT_VERSION == 2 and config["known_byte"] is True
    loaded, _ = load_head(tmp_path / "known")
    assert loaded.config == head.config
    e, c = torch.randn(3, 5), torch.tensor([1, 0, 5])
    for name, t in head(e, c).items():
        assert torch.equal(loaded(e, c)[name], t), name
    # a version-1 export (written before the option: no known_byte key) loads as a plain head
    save_head(tmp_path / "v1", _head("cp", known=False, dtype=torch.float32))
    path = tmp_path / "v1" / "config.json"
    old = {k: v for k, v in json.loads(path.read_text()).items() if k != "known_byte"} | {"format_version": 1}
    path.write_text(json.dumps(old))
    assert load_head(tmp_path / "v1")[0].config.known_byte is False
    path.write_text(json.dumps(old | {"known_byte": True}))
    with pytest.raises(ValueError, match="format_version 1 has no known_byte key"):
        load_head(tmp_path / "v1")


def test_drop_is_refused_in_one_line():
    bb = _peaked_backbone()
    m = MtpcModel.from_components(bb, {"kind": "cp", "window": 3, "rank": 2, "known_byte": True})
    with pytest.raises(ValueError, match=r'^extra_token="drop": this head has known_byte=True') as err:
        m.generate(torch.tensor([1, 2]), max_new_tokens=4, extra_token="drop")
    assert "\n" not in str(err.value)
    cfg = DecodeConfig(max_new_tokens=4, extra_token="drop")  # the loop alone: the head refuses c = None
    with torch.inference_mode(), pytest.raises(ValueError, match="needs the known byte"):
        speculative_decode(m.engine(True, 16), m._head_fn, CircuitDrafter(m.circuit), 3, torch.tensor([1, 2]), cfg,
                           TorchChooser(torch.Generator()))  # fmt: skip


@pytest.mark.parametrize("mode", ["greedy", "sample"])
def test_the_loop_gives_each_cycle_the_byte_emitted_last(mode):
    bb = _peaked_backbone(1, scale=1.5)
    m = MtpcModel.from_components(
        bb, {"kind": "hmm", "window": 4, "rank": 3, "lora_depth": 1, "known_byte": True}
    )
    seen = []

    def head_fn(hidden, c):
        seen.append(int(c))
        return m._head_fn(hidden, c)

    gen = torch.Generator().manual_seed(1)
    cfg = DecodeConfig(max_new_tokens=24, mode=mode, eos_id=1, ban_eos=True)
    prompt = torch.tensor([2, 3, 0])
    with torch.inference_mode():
        out, st = speculative_decode(m.engine(True, 40), head_fn, CircuitDrafter(m.circuit, gen), 4, prompt, cfg,
                                     TorchChooser(gen))  # fmt: skip
    starts = [sum(st.emitted[:k]) for k in range(len(st.emitted))]  # out[0] is the prefill's byte
    assert len(seen) == len(st.emitted) > 3 and seen == [out[i] for i in starts]
    assert out == m.generate(prompt, 24, mode=mode, seed=1, ban_eos=True).ids.tolist()  # the API: same path


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sample"])
def test_graphed_draft_hands_c_to_the_head(greedy):
    """`GraphedDraft` captures head_fn(h, prefix) + draft with c the prefix, a graph input. Without
    CUDA the capture fails and it runs that same function eagerly: this checks the plumbing of c
    only; the captured graph is checked on CUDA by bench/bench_gpu.py (known_byte_head_draft_*)."""
    from mtpc.speculative.drafters import GraphedDraft

    bb = _peaked_backbone(0, scale=1.5)
    m = MtpcModel.from_components(bb, {"kind": "cp", "window": 4, "rank": 3, "known_byte": True})
    graphed = GraphedDraft(m._head_fn, m.circuit, torch.Generator().manual_seed(3))
    h = torch.randn(bb.hidden_size, dtype=bb.dtype)
    ref = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        for c in range(bb.vocab_size):
            prefix = torch.tensor([c])
            x, q = graphed(graphed.head(h, prefix), prefix, greedy)
            want, q_want = m.circuit._draft(m._head_fn(h, prefix), prefix, generator=ref, greedy=greedy)
            assert torch.equal(x, want) and torch.equal(q, q_want), c
    assert list(graphed.errors) == [(greedy, False)] and not graphed.graphs  # no CUDA: ran eagerly


@pytest.mark.slow
def test_compiled_greedy_draft_reads_c_on_the_cpu():
    """`CompiledDraft` (torch.compile, static shapes, inductor's C++ wrapper) of a known-byte head:
    the same drafts as the eager head + draft for every c, and generate equals plain greedy."""
    bb = _peaked_backbone(0, scale=1.5, dtype=torch.float32)
    m = MtpcModel.from_components(bb, {"kind": "btree", "window": 4, "rank": 3, "known_byte": True})
    fast = MtpcModel(bb, m.head, compile=True)
    comp, calls = fast._compiled_draft, []
    inner = comp._fn
    comp._fn = lambda *a: calls.append(1) or inner(*a)
    h = torch.randn(bb.hidden_size)
    with torch.inference_mode():
        drafts = set()
        for c in range(bb.vocab_size):
            prefix = torch.tensor([c])
            x, _ = comp(comp.head(h, prefix), prefix, True)
            want, _ = m.circuit._draft(m._head_fn(h, prefix), prefix, greedy=True)
            assert torch.equal(x, want), c
            drafts.add(tuple(x[1:].tolist()))
    assert len(drafts) > 1  # c changes the draft beyond its own position
    prompt = torch.tensor([2, 3, 0])
    assert fast.generate(prompt, 12).ids.tolist() == m.generate_plain(prompt, 12).ids.tolist()
    assert len(calls) > bb.vocab_size  # the compiled draft ran inside generate too
