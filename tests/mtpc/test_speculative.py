"""Exactness of speculative decoding on tiny in-process Llama backbones (float64, eager attention).

Greedy output equals plain greedy for every circuit kind, k in {0, 1}, keep and drop; every
cache equals a fresh prefill of the accepted text after each cycle; one backbone call per cycle
(keep) is counted; the keep cycle on a real backbone and real circuits is exact by enumeration
(tests/mtpc/test_acceptance.py does the same on a Markov target). Each runs on both decoding
engines (the compact Llama forward and the HF layers). The Monte Carlo sampling test is in
tests/mtpc/test_speculative_sampling.py; the drafted-from state, the one host read per cycle and
the longer enumeration in tests/mtpc/test_decoding_engines.py.
"""

from __future__ import annotations

import pytest
import torch

from mtpc import MtpcModel
from mtpc.backbones import LlamaEngine, make_engine
from mtpc.circuits import CIRCUIT_KINDS
from mtpc.heads import HeadConfig, MtpcHead, save_head
from mtpc.kernels import rowdot_unsupported
from mtpc.speculative.acceptance import TorchChooser
from mtpc.speculative.loop import (
    CircuitDrafter,
    DecodeConfig,
    plain_decode,
    speculative_decode,
)
from tests.backbone_helpers import ENGINES, cache_snapshot, randomize_lora, tiny_backbone, tiny_llama
from tests.speculative_helpers import circuit_enum_drafter, enumerate_outcomes, total_variation

RANK = {"ff": 1, "cp": 3, "hmm": 3, "btree": 3}


def _peaked_backbone(lora_depth=0, vocab=6, scale=3.0, seed=0, layers=2, engine="auto", **cfg_kw):
    """A tiny Llama whose lm_head is scaled up: a peaked target, so drafts get accepted (and rejected)."""
    bb = tiny_backbone(
        lora_depth=lora_depth, seed=seed, vocab=vocab, hidden=16, layers=layers, heads=2, kv_heads=1, engine=engine,
        **cfg_kw,
    )  # fmt: skip
    with torch.no_grad():
        bb.model.lm_head.weight.mul_(scale)
    if lora_depth:
        randomize_lora(bb, seed=seed + 1, scale=0.2)
    return bb


def _prompts(vocab, count, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, vocab, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g)
        for _ in range(count)
    ]


def _heads(bb, window, seed=0):
    """Random heads of every kind, two known-byte heads (`*-known`: keep only) and a cp head copied
    from the lm_head (accepts more)."""
    out = {}
    for kind in CIRCUIT_KINDS:
        spec = {"kind": kind, "window": window, "rank": RANK[kind], "lora_depth": bb.lora_depth, "seed": seed}
        out[kind] = MtpcModel.from_components(bb, spec)
    for kind in ("cp", "btree"):
        spec = {"kind": kind, "window": window, "rank": RANK[kind], "lora_depth": bb.lora_depth, "seed": seed,
                "known_byte": True}  # fmt: skip
        out[f"{kind}-known"] = MtpcModel.from_components(bb, spec)
    cfg = HeadConfig("cp", window, 2, bb.vocab_size, bb.hidden_size, lora_depth=bb.lora_depth)
    copy = MtpcHead(cfg, dtype=bb.dtype)
    copy.init_from_unembeddings(bb.lm_head_weight.detach(), noise=0.5)
    out["cp-stp-copy"] = MtpcModel.from_components(bb, copy)
    return out


# every engine in float64, and the compact engine in float32, where its default layout is oneDNN's products
ENGINE_DTYPES = [(e, torch.float64) for e in ENGINES] + [("compact", torch.float32)]


@pytest.mark.parametrize("engine,dtype", ENGINE_DTYPES, ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("lora_depth", [0, 1])
def test_greedy_equals_plain_greedy(lora_depth, engine, dtype):
    bb = _peaked_backbone(lora_depth, engine=engine, dtype=dtype)
    if engine == "compact":
        f32 = "onednn" if rowdot_unsupported("cpu", torch.float32) else "rowdot"  # the CPU float32 default
        assert make_engine(bb, 8).layout == (f32 if dtype == torch.float32 else "views")
    hist = {2: torch.zeros(3, dtype=torch.long), 4: torch.zeros(5, dtype=torch.long)}
    for window in (2, 4):
        models = _heads(bb, window)
        for i, prompt in enumerate(_prompts(bb.vocab_size, 6, seed=window)):
            ban = i % 2 == 0  # EOS (id 1) both stops and is banned across the prompts
            plain = next(iter(models.values())).generate_plain(prompt, max_new_tokens=20, ban_eos=ban)
            for name, m in models.items():
                for extra in ("keep",) if m.head.config.known_byte else ("keep", "drop"):
                    out = m.generate(prompt, max_new_tokens=20, extra_token=extra, ban_eos=ban)
                    assert out.ids.tolist() == plain.ids.tolist(), (name, extra, prompt.tolist())
                    if extra == "keep":
                        hist[window] += torch.tensor(out.stats.accepted_length_histogram)
    # not vacuous: rejections, partial (n = 4) and full (n = 2: the bonus token) acceptances happened
    assert hist[4][0] > 0 and hist[4][1:3].sum() > 0 and hist[2][1] > 0, hist


class _CheckingEngine:
    """Wraps an engine; before every call after the prefill, compares every cache with a fresh prefill
    of the tokens it holds (a fresh engine of the same kind)."""

    def __init__(self, backbone, capacity):
        self.backbone, self.capacity = backbone, capacity
        self.inner = make_engine(backbone, capacity)
        self.tokens: list[int] = []
        self.checks = 0

    @property
    def length(self):
        return self.inner.length

    @property
    def calls(self):
        return self.inner.calls

    def feed(self, ids):
        if self.tokens:
            fresh = make_engine(self.backbone, self.capacity)
            fresh.feed(torch.tensor(self.tokens))
            ours, ref = cache_snapshot(self.inner), cache_snapshot(fresh)
            assert sorted(ours) == sorted(ref) and ref
            # HF layers: 1e-6, not 1e-15: transformers' eager attention takes its softmax in float32
            # even for float64 models; a wrong crop or position shows up as O(1)
            atol = 1e-10 if isinstance(self.inner, LlamaEngine) else 1e-6
            for name in ref:
                torch.testing.assert_close(ours[name], ref[name], atol=atol, rtol=0)
            assert self.inner.length == len(self.tokens)
            self.checks += 1
        self.tokens += ids.tolist()
        return self.inner.feed(ids)

    def crop(self, length):
        self.inner.crop(length)
        self.tokens = self.tokens[:length]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("lora_depth", [0, 1])
@pytest.mark.parametrize("extra_token", ["keep", "drop"])
@pytest.mark.parametrize("kind", CIRCUIT_KINDS)
def test_caches_equal_fresh_prefill_after_every_cycle(kind, extra_token, lora_depth, engine):
    bb = _peaked_backbone(lora_depth, scale=1.5, engine=engine)
    m = MtpcModel.from_components(
        bb, {"kind": kind, "window": 4, "rank": RANK[kind], "lora_depth": lora_depth}
    )
    cfg = DecodeConfig(max_new_tokens=16, mode="sample", extra_token=extra_token, eos_id=1, ban_eos=True)
    prompt = torch.tensor([2, 3, 0])
    gen = torch.Generator().manual_seed(3)
    engine = _CheckingEngine(bb, len(prompt) + 16 + 4)
    with torch.inference_mode():
        out, st = speculative_decode(
            engine, m._head_fn, CircuitDrafter(m.circuit, gen), 4, prompt, cfg, TorchChooser(gen)
        )
    assert len(out) == 16 and engine.checks >= len(st.cycle_s) > 1
    # the state holds the prompt and the emitted bytes: all but the last (keep: c has no state yet)
    held = engine.tokens[: len(prompt) + len(out) - (1 if extra_token == "keep" else 0)]
    assert held[: len(prompt)] == prompt.tolist()
    assert held[len(prompt) :] == out[: len(held) - len(prompt)]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("lora_depth", [0, 1])
def test_one_backbone_call_per_cycle(lora_depth, engine, monkeypatch):
    bb = _peaked_backbone(lora_depth, scale=1.5, engine=engine)
    calls = []
    if engine == "hf":
        bb.model.model.layers[0].register_forward_hook(
            lambda *a: calls.append(1)
        )  # the trunk runs once per call
    else:
        block = LlamaEngine._block

        def counting(self, x, layer, *args):
            calls.extend([1] if layer is self.layers[0] else [])
            return block(self, x, layer, *args)

        monkeypatch.setattr(LlamaEngine, "_block", counting)
    for kind in CIRCUIT_KINDS:
        m = MtpcModel.from_components(
            bb, {"kind": kind, "window": 4, "rank": RANK[kind], "lora_depth": lora_depth}
        )
        for extra in ("keep", "drop"):
            calls.clear()
            out = m.generate(
                torch.tensor([2, 3]),
                max_new_tokens=30,
                mode="sample",
                seed=0,
                extra_token=extra,
                ban_eos=True,
            )
            st = out.stats
            zero_cycles = st.accepted_length_histogram[0]
            expected = 1 + st.cycles + (zero_cycles if extra == "drop" else 0)  # drop pays for s = 0
            assert len(calls) == st.backbone_calls == expected, (kind, extra)
    calls.clear()
    out = m.generate_plain(torch.tensor([2, 3]), max_new_tokens=10, ban_eos=True)
    assert len(calls) == out.stats.backbone_calls == 10  # prefill + 9 steps


def _enum_program(m, prompt, T, extra_token="keep"):
    cfg = DecodeConfig(
        max_new_tokens=T, mode="sample", extra_token="keep" if extra_token == "plain" else extra_token
    )

    def program(choose):
        with torch.inference_mode():
            engine = make_engine(m.backbone, len(prompt) + T + m.window, draft=extra_token != "plain")
            if extra_token == "plain":
                out, _ = plain_decode(engine, prompt, cfg, choose)
            else:
                out, _ = speculative_decode(
                    engine, m._head_fn, circuit_enum_drafter(m.circuit, choose), m.window, prompt, cfg, choose
                )
        return tuple(out)

    return program


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    "kind,lora_depth,window,known",
    [("cp", 0, 3, False), ("btree", 1, 3, False), ("hmm", 0, 2, False), ("ff", 1, 2, False), ("btree", 0, 2, False),
     ("cp", 0, 3, True), ("hmm", 1, 3, True), ("ff", 0, 2, True)],
)  # fmt: skip
def test_keep_is_exact_by_enumeration_on_a_real_backbone(kind, lora_depth, window, known, engine):
    """Every random path of prefill + one keep cycle (T = 2 bytes, v = 4) against plain sampling
    (known: a known-byte head, whose parameters read the prefill's byte c)."""
    bb = _peaked_backbone(lora_depth, vocab=4, scale=3.0, engine=engine)
    prompt = torch.tensor([2, 0, 3])
    spec = {"kind": kind, "window": window, "rank": RANK[kind], "lora_depth": lora_depth, "seed": 1,
            "known_byte": known}  # fmt: skip
    m = MtpcModel.from_components(bb, spec)
    plain = enumerate_outcomes(_enum_program(m, prompt, 2, "plain"))
    keep = enumerate_outcomes(_enum_program(m, prompt, 2, "keep"))
    assert abs(sum(plain.values()) - 1) < 1e-12
    assert total_variation(keep, plain) < 1e-6  # float32 softmax inside eager attention


def test_api_validation():
    bb = _peaked_backbone()
    m = MtpcModel.from_components(bb, {"kind": "cp", "window": 3, "rank": 2})
    p = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="mode"):
        m.generate(p, mode="beam")
    with pytest.raises(ValueError, match="extra_token"):
        m.generate(p, extra_token="maybe")
    with pytest.raises(ValueError, match="tokenizer"):
        m.generate("hello")
    with pytest.raises(ValueError, match="max_context"):
        m.generate(p, max_new_tokens=1000)
    with pytest.raises(ValueError, match="prompt"):
        m.generate(torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match="window"):
        MtpcModel.from_components(bb, {"kind": "cp", "window": 1, "rank": 2})
    with pytest.raises(ValueError, match="dict keys"):
        MtpcModel.from_components(bb, {"kind": "cp", "window": 3, "ranks": 2})
    with pytest.raises(ValueError, match="lora_depth"):
        MtpcModel.from_components(bb, {"kind": "cp", "window": 3, "lora_depth": 1})
    with pytest.raises(ValueError, match="temperature"):
        m.generate(p, mode="sample", temperature=0)


def test_from_pretrained_and_byte_prompts(tmp_path):
    from mtpc.tokenizer import ByteTokenizer

    model = tiny_llama(vocab=320, hidden=16, layers=2, heads=2, kv_heads=1)
    model.save_pretrained(tmp_path / "bb")
    ByteTokenizer().save_pretrained(tmp_path / "bb")
    m = MtpcModel.from_components(
        model, {"kind": "btree", "window": 4, "rank": 2, "lora_depth": 1, "seed": 3}
    )
    randomize_lora(m.backbone)
    m.head.config.backbone = str(tmp_path / "bb")
    save_head(tmp_path / "head", m.head, lora_state=m.backbone.lora_state_dict())
    loaded = MtpcModel.from_pretrained(tmp_path / "head", dtype=torch.float64)
    assert loaded.tokenizer is not None and loaded.backbone.lora_depth == 1
    # same head and LoRA, same seed: the same sampled text, and greedy equals plain greedy
    for prompt in ("hi", b"raw bytes", torch.tensor([257, 104, 105])):
        a = loaded.generate(prompt, max_new_tokens=12, mode="sample", seed=5, ban_eos=True)
        m.backbone.tokenizer = loaded.tokenizer
        b = m.generate(prompt, max_new_tokens=12, mode="sample", seed=5, ban_eos=True)
        assert a.ids.tolist() == b.ids.tolist() and a.text == b.text
        g = loaded.generate(prompt, max_new_tokens=12)
        assert g.ids.tolist() == loaded.generate_plain(prompt, max_new_tokens=12).ids.tolist()
    # a str prompt is a one-turn chat ending in the assistant marker; bytes are raw
    assert loaded.encode_prompt("hi").tolist() == loaded.tokenizer.render_prompt("hi")
    assert loaded.encode_prompt(b"hi").tolist() == [104, 105]


def test_stats_names_and_ranges():
    bb = _peaked_backbone(vocab=4)
    m = MtpcModel.from_components(bb, {"kind": "hmm", "window": 4, "rank": 2})
    for extra, top in (("keep", 3), ("drop", 4)):
        st = m.generate(
            torch.tensor([0, 2]), max_new_tokens=40, mode="sample", seed=1, extra_token=extra, ban_eos=True
        ).stats
        assert 0 <= st.mu_acc <= top and st.mu_lat > 0 and st.throughput > 0
        assert st.max_throughput == pytest.approx(4 / st.mu_lat)
        assert sum(st.accepted_length_histogram) == st.cycles and len(st.per_position_acceptance) == 4
        if extra == "keep":
            assert st.tokens_per_cycle == pytest.approx(st.mu_acc + 1)
            assert st.per_position_acceptance[0] is None  # position 1 is c, never tested
        else:
            assert st.tokens_per_cycle == pytest.approx(
                sum(max(s, 1) * c for s, c in enumerate(st.accepted_length_histogram)) / st.cycles
            )
        assert st.generated == 40 and st["mu_acc"] == st.mu_acc
        assert st.decode_generated == (39 if extra == "keep" else 40)


def _trained_head_dirs(limit=4):
    from mtpc.paths import cache_dir

    root = cache_dir() / "heads"
    dirs = sorted(p for p in root.glob("default-*") if (p / "config.json").is_file()) if root.is_dir() else []
    return dirs[:limit]


def _heads_on_default(bb):
    """Trained head exports in the cache if any, else heads started from the shipped model's own
    unembedding (every kind; greedy identity does not depend on how good the head is)."""
    from mtpc.heads import HeadConfig, MtpcHead

    dirs = _trained_head_dirs()
    if dirs:
        return [MtpcModel.from_pretrained(d, backbone=bb) for d in dirs]
    models = []
    for kind in CIRCUIT_KINDS:
        cfg = HeadConfig(
            kind=kind,
            window=4,
            rank=1 if kind == "ff" else 2,
            vocab=bb.vocab_size,
            hidden=bb.hidden_size,
            lora_depth=0,
            backbone=bb.name,
        )
        head = MtpcHead(cfg)
        head.init_from_unembeddings(bb.lm_head_weight.detach(), generator=torch.Generator().manual_seed(0))
        models.append(MtpcModel.from_components(bb, head))
    return models


@pytest.mark.parametrize("engine", ENGINES)
def test_greedy_on_the_shipped_default_equals_plain_greedy_float32(engine):
    """The shipped default model (float32) with trained heads (or heads started from its
    unembedding): byte-identical greedy output, keep and drop, and some drafts accepted."""
    from mtpc.backbones import load_backbone

    bb = load_backbone("default", engine=engine)
    prompts = ["How do I sort a list in Python?", "Write a haiku about the sea."]
    accepted = 0
    for m in _heads_on_default(bb):
        for p in prompts:
            plain = m.generate_plain(p, max_new_tokens=24, ban_eos=True)
            for extra in ("keep", "drop"):
                out = m.generate(p, max_new_tokens=24, extra_token=extra, ban_eos=True)
                assert out.ids.tolist() == plain.ids.tolist(), (m.head.config.kind, extra, p)
                accepted += out.stats.mu_acc * out.stats.cycles
    assert accepted > 0
