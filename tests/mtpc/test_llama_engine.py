"""The compact Llama forward (mtpc/backbones/llama.py) against transformers, in float64.

Every segment (trunk / verifier top / draft top keys and values, p logits, the draft top's hidden
state) equals the HF forward (sdpa attention: float64 throughout) to 1e-10 over a sequence of
calls with prefill, 1-byte steps, n-byte verifies and crops, k in {0, 1, L}; llama3 RoPE scaling,
grouped and plain attention, an explicit head_dim, tied embeddings; static shapes == sliced
caches; merged LoRA == low-rank LoRA; the weight layouts (views of the HF parameters, copying
nothing, and the packed transposed copy, rebuilt when a source changes); unsupported configs are
refused. The oneDNN layout (the CPU float32 / bf16 default; oneDNN has no float64) is checked in
float32 against the HF forward to 1e-4, with the same script, rebuilds and merged LoRA.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from mtpc.backbones import AdapterEngine, BackboneAdapter, LlamaEngine, load_backbone, make_engine
from mtpc.backbones.llama import LlamaArgs, llama_unsupported, rope_inv_freq
from mtpc.kernels import rowdot_unsupported
from tests.backbone_helpers import randomize_lora, set_rope, tiny_llama

L = 4
ROPE_FIELD = (
    "rope_parameters" if int(__import__("transformers").__version__.split(".")[0]) >= 5 else "rope_scaling"
)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}  # fmt: skip


def _model(rope=None, **kw):
    m = tiny_llama(attn="sdpa", **kw)
    if rope is not None:  # rebuild with the rope parameters (the rotary buffers depend on them)
        cfg = m.config
        set_rope(cfg, rope)
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        m = LlamaForCausalLM(cfg)
        with torch.no_grad():
            for p in m.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.2)
        m = m.double().eval()
    return m


def _adapter(model, k, seed=1):
    bb = BackboneAdapter.from_hf(model, lora_depth=k, lora_rank=4)
    randomize_lora(bb, seed=seed)
    return bb


# (ids fed, crop length after the call or None): prefill, steps, verifies, rejections, a full crop-back
SCRIPT = [(7, None), (1, None), (4, 9), (4, None), (1, None), (5, 14), (1, None), (3, 0), (6, None)]


def _run_script(engine, ref_bb, vocab, seed=0, atol=1e-10):
    """Feeds SCRIPT to `engine`; after each call compares with the HF forward on the held tokens."""
    g = torch.Generator().manual_seed(seed)
    held: list[int] = []
    cache = ref_bb.new_cache()
    for T, crop in SCRIPT:
        ids = torch.randint(0, vocab, (T,), generator=g)
        held += ids.tolist()
        with torch.inference_mode():
            out = engine.feed(ids)
            full = torch.tensor([held])
            hf_logits = ref_bb.model(full).logits[0, -T:]  # the plain HF model (no adapter code)
            ref = ref_bb(full)  # HF layers + peft draft top on the whole sequence
            ref_bb(ids[None], cache)  # and incrementally, for the caches
        assert_close(out.p_logits, hf_logits, rtol=0, atol=atol)
        assert_close(out.draft_hidden, ref.draft_hidden[0, -T:], rtol=0, atol=atol)
        _compare_caches(engine, cache, ref_bb, atol)
        if crop is not None:
            engine.crop(crop)
            cache.crop(crop)
            held = held[:crop]


def _compare_caches(engine, cache, bb, atol=1e-10):
    split = bb.num_layers - engine.k
    assert cache.length == engine.length
    for i, (kc, vc) in enumerate(engine.kv):
        live_k, live_v = kc[:, :, : engine.length], vc[:, :, : engine.length]
        if i < split:
            assert_close(live_k, cache.trunk.keys[i], rtol=0, atol=atol)
            assert_close(live_v, cache.trunk.values[i], rtol=0, atol=atol)
        else:  # rows: verifier top, draft top
            assert_close(live_k[:1], cache.verify.keys[i], rtol=0, atol=atol)
            assert_close(live_v[:1], cache.verify.values[i], rtol=0, atol=atol)
            assert_close(live_k[1:], cache.draft.keys[i], rtol=0, atol=atol)
            assert_close(live_v[1:], cache.draft.values[i], rtol=0, atol=atol)


WEIGHTS = ["views", "packed"]


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("k", [0, 1, L])
def test_every_segment_equals_hf_over_prefill_steps_and_crops(k, static, weights):
    bb = _adapter(_model(), k)
    engine = LlamaEngine(bb, capacity=40, static=static, weights=weights)
    assert engine.layout == weights
    assert engine.k == k and len(engine.kv) == L
    _run_script(engine, bb, vocab=16)
    if k:  # not vacuous: the LoRA moves the draft row's keys away from the verifier row's
        kc = engine.kv[-1][0][:, :, : engine.length]
        assert (kc[0] - kc[1]).abs().max() > 1e-2


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("static", [False, True])
def test_strided_attention_output_as_cuda_kernels_return_it(static, weights, monkeypatch):
    """CUDA's memory-efficient / flash SDPA kernels return (B, H, M, hd) with the heads and rows
    swapped in memory (not contiguous); the CPU's kernels return it contiguous. The engine must not
    `.view` that output (a view of such a tensor raises on CUDA): emulate the layout here."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls = []

    def strided_sdpa(*args, **kwargs):
        y = sdpa(*args, **kwargs)
        calls.append(1)
        return y.transpose(1, 2).contiguous().transpose(1, 2)  # same values, CUDA's memory order

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", strided_sdpa)
    bb = _adapter(_model(), 1)
    _run_script(LlamaEngine(bb, capacity=40, static=static, weights=weights), bb, vocab=16)
    assert calls  # the engine's attention went through the strided outputs


@pytest.mark.parametrize(
    "kw",
    [
        {"rope": LLAMA3, "max_context": 128},  # Llama 3.2's scaled rotary frequencies
        {"heads": 4, "kv_heads": 4},  # no grouped queries
        {"heads": 4, "kv_heads": 1, "tie": True},  # 4 query heads per key head, tied embeddings
        {"hidden": 24, "heads": 2, "kv_heads": 1, "head_dim": 16},  # head_dim != hidden / heads
    ],
    ids=["llama3-rope", "mha", "gqa4-tied", "head-dim"],
)
@pytest.mark.parametrize("weights", WEIGHTS)
def test_variants_equal_hf(kw, weights):
    kw = dict(kw)
    head_dim = kw.pop("head_dim", None)
    model = _model(**kw) if head_dim is None else _head_dim_model(head_dim, **kw)
    bb = _adapter(model, 1)
    _run_script(LlamaEngine(bb, capacity=64, weights=weights), bb, vocab=16)


def _head_dim_model(head_dim, **kw):
    from transformers import LlamaForCausalLM

    cfg = tiny_llama(attn="sdpa", **kw).config
    cfg.head_dim = head_dim
    torch.manual_seed(0)
    m = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    assert m.model.layers[0].self_attn.q_proj.weight.shape == (2 * head_dim, 24)
    return m.double().eval()


def test_llama3_frequencies_equal_transformers_and_differ_from_default():
    m = _model(rope=LLAMA3, max_context=128)
    args = LlamaArgs.from_config(m.config)
    ours = rope_inv_freq(args)
    assert torch.equal(ours, m.model.rotary_emb.inv_freq.float())
    args.rope_type = "default"
    assert not torch.equal(ours, rope_inv_freq(args))  # the scaling changed some frequencies
    default = _model()
    assert torch.equal(
        rope_inv_freq(LlamaArgs.from_config(default.config)), default.model.rotary_emb.inv_freq.float()
    )


@pytest.mark.parametrize("weights", WEIGHTS)
def test_merged_lora_equals_low_rank(weights):
    bb = _adapter(_model(), 2)
    low, merged = LlamaEngine(bb, 32, weights=weights), LlamaEngine(bb, 32, lora="merged", weights=weights)
    ids = torch.randint(0, 16, (9,))
    a, b = low.feed(ids), merged.feed(ids)
    assert_close(b.draft_hidden, a.draft_hidden, rtol=0, atol=1e-10)
    assert_close(b.p_logits, a.p_logits, rtol=0, atol=1e-10)
    assert merged.layers[-1].merged and not low.layers[-1].merged


def test_views_not_copies_and_lora_updates_are_seen():
    model = _model()
    bb = _adapter(model, 1)
    engine = LlamaEngine(bb, 32, weights="views")
    assert engine.lm_head_packed is None and not engine.layers[0].packed and not engine._sources
    assert engine.layers[0].w["q_proj"].data_ptr() == model.model.layers[0].self_attn.q_proj.weight.data_ptr()
    assert engine.lm_head.data_ptr() == model.lm_head.weight.data_ptr()
    peft_a = bb.draft_top.layers[str(L - 1)].self_attn.q_proj.lora_A["default"].weight
    assert engine.layers[-1].lora["q_proj"].a.data_ptr() == peft_a.data_ptr()
    assert set(engine.layers[-1].lora) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    ids = torch.randint(0, 16, (6,))
    before = engine.feed(ids).draft_hidden.clone()
    other = _adapter(_model(), 1, seed=7)
    bb.load_lora_state_dict(other.lora_state_dict())  # in place: the engine's views see it
    engine.reset(32)
    after = engine.feed(ids).draft_hidden
    with torch.inference_mode():
        assert_close(after, bb(ids[None]).draft_hidden[0], rtol=0, atol=1e-10)
    assert (after - before).abs().max() > 1e-3


def test_packed_copy_layout_and_rebuild_after_in_place_changes():
    """The packed copy is [q|k|v]^T etc.; an in-place change of a base weight or (merged) of a LoRA
    matrix is picked up at the next reset, so a stale copy never answers."""
    model = _model()
    bb = _adapter(model, 1)
    eng, merged = LlamaEngine(bb, 32, weights="packed"), LlamaEngine(bb, 32, weights="packed", lora="merged")
    attn = model.model.layers[0].self_attn
    qkv = eng.layers[0].packed["qkv"]
    assert qkv.is_contiguous() and qkv.shape == (32, 32 + 16 + 16)
    assert torch.equal(qkv, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).t())
    assert qkv.data_ptr() != attn.q_proj.weight.data_ptr()  # a copy, not a view
    ids = torch.randint(0, 16, (6,))
    before = eng.feed(ids).p_logits.clone()
    with torch.no_grad():
        attn.o_proj.weight.mul_(1.5)  # in place, as load_state_dict or an optimiser would
        bb.draft_top.layers[str(L - 1)].mlp.down_proj.lora_B["default"].weight.add_(0.3)
    for e in (eng, merged):
        e.reset(32)
        out = e.feed(ids)
        with torch.inference_mode():
            ref = bb(ids[None])
            assert_close(out.p_logits, model(ids[None]).logits[0], rtol=0, atol=1e-10)
            assert_close(out.draft_hidden, ref.draft_hidden[0], rtol=0, atol=1e-10)
    assert (out.p_logits - before).abs().max() > 1e-3
    assert not eng._stale() and not merged._stale()


def test_default_weight_layout_and_bad_value():
    bb = _adapter(_model(), 0)
    assert LlamaEngine(bb, 16).layout == "views"  # the float64 default: no copy
    with pytest.raises(ValueError, match=r"weights='transposed'.*views.*packed.*onednn"):
        LlamaEngine(bb, 16, weights="transposed")


@pytest.mark.parametrize("weights", WEIGHTS)
def test_float32_close_to_hf_eager(weights):
    model = tiny_llama(dtype=torch.float32)  # eager attention, as the trained default loads
    bb = BackboneAdapter.from_hf(model)
    engine = LlamaEngine(bb, 32, weights=weights)
    ids = torch.randint(0, 16, (10,))
    out = torch.cat(
        [engine.feed(ids[:7]).p_logits, engine.feed(ids[7:8]).p_logits, engine.feed(ids[8:]).p_logits]
    )
    with torch.inference_mode():
        assert_close(out, model(ids[None]).logits[0], rtol=0, atol=2e-5)


def test_capacity_reset_and_crop_errors():
    bb = _adapter(_model(max_context=300), 1)
    engine = LlamaEngine(bb, 10)
    assert engine.capacity == 256  # rounded up to a multiple of 256, at most max_context
    engine.feed(torch.zeros(250, dtype=torch.long))
    with pytest.raises(ValueError, match=r"250 cached \+ 7 new.*capacity=256"):
        engine.feed(torch.zeros(7, dtype=torch.long))
    with pytest.raises(ValueError, match="crop"):
        engine.crop(251)
    engine.reset(290)
    assert (engine.capacity, engine.length, engine.calls) == (300, 0, 0)
    with pytest.raises(ValueError, match="max_context=300"):
        engine.reset(301)
    with pytest.raises(ValueError, match="lora="):
        LlamaEngine(bb, 10, lora="fused")


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("attention_bias", True, "attention_bias=True"),
        ("mlp_bias", True, "mlp_bias=True"),
        ("hidden_act", "gelu", "hidden_act='gelu'"),
        (ROPE_FIELD, {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}, "rope_type='linear'"),
        (
            ROPE_FIELD,
            {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
            "partial_rotary",
        ),
        ("sliding_window", 8, r"\['sliding_window'\]"),
    ],
)
def test_unsupported_config_fields_are_refused(field, value, match):
    model = tiny_llama()
    setattr(model.config, field, value)
    assert llama_unsupported(model) is not None and __import__("re").search(match, llama_unsupported(model))
    with pytest.raises(ValueError, match=f"engine='compact'.*{match}"):
        BackboneAdapter.from_hf(model, engine="compact")
    assert BackboneAdapter.from_hf(model).engine == "hf"  # auto: the HF-layer path
    assert isinstance(make_engine(BackboneAdapter.from_hf(model)), AdapterEngine)


def test_other_classes_take_the_hf_path():
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)  # fmt: skip
    mistral = MistralForCausalLM(cfg).eval()
    assert "MistralForCausalLM is not transformers' LlamaForCausalLM" in llama_unsupported(mistral)
    assert BackboneAdapter.from_hf(mistral).engine == "hf"
    with pytest.raises(ValueError, match="engine='compact'"):
        BackboneAdapter.from_hf(mistral, engine="compact")
    with pytest.raises(ValueError, match="engine='fast'"):
        BackboneAdapter.from_hf(tiny_llama(), engine="fast")


def test_load_backbone_picks_the_compact_path(tmp_path):
    tiny_llama(dtype=torch.float32).save_pretrained(tmp_path / "tiny")
    bb = load_backbone(str(tmp_path / "tiny"), lora_depth=1, dtype=torch.float64)
    assert bb.engine == "compact" and isinstance(make_engine(bb, 16), LlamaEngine)
    forced = load_backbone(str(tmp_path / "tiny"), engine="hf")
    assert forced.engine == "hf" and isinstance(make_engine(forced, 16), AdapterEngine)
    plain = make_engine(bb, 16, draft=False)
    assert plain.k == 0 and all(kc.shape[0] == 1 for kc, _ in plain.kv)  # verifier only: one row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_rms_norm_is_transformers_bit_for_bit(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from mtpc.backbones.llama import rms_norm

    ref = LlamaRMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        ref.weight.normal_()
    for scale in (1e-3, 1.0, 30.0):
        x = (torch.randn(2, 5, 64, dtype=torch.float64) * scale).to(dtype)
        assert torch.equal(rms_norm(x, ref.weight, 1e-6), ref(x))


def test_mtpc_model_passes_weights_and_compile_to_its_engines(monkeypatch):
    """MtpcModel(weights=..., compile=...) reach every engine it builds (compile was once dropped)."""
    from mtpc import MtpcModel

    bb = _adapter(_model(), 1)
    spec = {"kind": "cp", "window": 3, "rank": 2, "lora_depth": 1}
    m = MtpcModel.from_components(bb, spec)
    views = MtpcModel(bb, m.head, weights="views")
    assert views.engine(True, 16).layout == "views" and views.engine(False, 16).layout == "views"
    packed = MtpcModel(bb, m.head, weights="packed")
    assert m.engine(True, 16).layout == "views" and packed.engine(True, 16).layout == "packed"
    assert (
        packed.generate(torch.tensor([1, 2]), 6).ids.tolist()
        == views.generate(torch.tensor([1, 2]), 6).ids.tolist()
    )
    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw) or fn)
    MtpcModel(bb, m.head, compile=True).engine(True, 16)
    assert seen == [{"dynamic": False, "options": {"cpp_wrapper": True}}] * 2  # the greedy draft, the engine
    hf = BackboneAdapter.from_hf(bb.model, lora_depth=1, engine="hf")
    with pytest.raises(ValueError, match="weights='views'.*compact engine"):
        MtpcModel(hf, m.head, weights="views")


@pytest.mark.slow
def test_compiled_engine_equals_hf_over_steps_and_crops():
    """compile=True (static shapes, a graph per T, inductor's C++ wrapper on the CPU) keeps every
    segment equal to the HF forward over the script's steps, verifies and crops: to 1e-5 in
    float64, since RMSNorm normalises in float32 (as transformers) and the fused kernel rounds
    that float32 step differently (seen: 1.0e-6 on values ~3); a wrong cache or position is off by >1e-2."""
    bb = _adapter(_model(), 1)
    engine = LlamaEngine(bb, capacity=40, compile=True)
    assert engine.static and engine._compiled is not None
    _run_script(engine, bb, vocab=16, atol=1e-5)
    with pytest.raises(ValueError, match="compile=True needs static shapes"):
        LlamaEngine(bb, 40, compile=True, static=False)


@pytest.mark.slow
def test_compiled_model_decodes_as_the_eager_one():
    """MtpcModel(compile=True): compiled engine calls and compiled greedy head + draft give the
    eager model's greedy and seeded sampled outputs (float64), and the compiled draft is used."""
    from mtpc import MtpcModel

    bb = _adapter(_model(), 1)
    spec = {"kind": "btree", "window": 3, "rank": 2, "lora_depth": 1}
    eager = MtpcModel.from_components(bb, spec)
    comp = MtpcModel(bb, eager.head, compile=True)
    calls = []
    inner = comp._compiled_draft._fn
    comp._compiled_draft._fn = lambda *a: calls.append(1) or inner(*a)
    prompt = torch.tensor([1, 2, 3])
    for mode in ("greedy", "sample"):
        a = eager.generate(prompt, 12, mode=mode, seed=3).ids.tolist()
        b = comp.generate(prompt, 12, mode=mode, seed=3).ids.tolist()
        assert a == b, mode
    assert comp.generate(prompt, 12).ids.tolist() == eager.generate_plain(prompt, 12).ids.tolist()
    assert calls and comp.engine(True, 32)._compiled is not None


# ------------------------------------------------------------------ the oneDNN layout (float32, CPU)


def _f32_adapter(k, seed=1, **kw):
    bb = BackboneAdapter.from_hf(_model(**kw).float(), lora_depth=k, lora_rank=4)
    randomize_lora(bb, seed=seed)
    return bb


# the row-dot kernel's tests are skipped, saying why, where it does not build (not x86 with AVX2 +
# FMA, or no C++ compiler); there the CPU float32 default is oneDNN
ROWDOT_WHY = rowdot_unsupported("cpu", torch.float32)
ROWDOT = pytest.mark.skipif(ROWDOT_WHY is not None, reason=str(ROWDOT_WHY))
DEFAULT_F32 = "onednn" if ROWDOT_WHY else "rowdot"


def _float32_layouts():
    """The float32-only CPU layouts: oneDNN and the row-dot kernel."""
    return ["onednn", pytest.param("rowdot", marks=ROWDOT)]


@pytest.mark.parametrize("weights", _float32_layouts())
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("k", [0, 1, L])
def test_float32_layouts_close_to_hf(k, static, weights):
    """oneDNN has no float64 and the row-dot kernel is float32 only: in float32 every segment stays
    within 1e-4 of the HF forward over the script (prefill, steps, verifies, crops); a wrong group
    order or column split is off by O(1)."""
    bb = _f32_adapter(k)
    engine = LlamaEngine(bb, capacity=40, static=static, weights=weights)
    assert engine.layout == weights and engine.lm_head_packed is not None
    _run_script(engine, bb, vocab=16, atol=1e-4)


@pytest.mark.parametrize("weights", _float32_layouts())
@pytest.mark.parametrize("kw", [{"rope": LLAMA3, "max_context": 128}, {"heads": 4, "kv_heads": 1, "tie": True}],
                         ids=["llama3-rope", "gqa4-tied"])  # fmt: skip
def test_float32_layout_variants_close_to_hf(kw, weights):
    bb = _f32_adapter(1, **kw)
    _run_script(LlamaEngine(bb, capacity=64, weights=weights), bb, vocab=16, atol=1e-4)


@pytest.mark.parametrize("weights", _float32_layouts())
def test_float32_layout_merged_lora_and_rebuild_after_in_place_changes(weights):
    bb = _f32_adapter(2)
    model = bb.model
    low, merged = LlamaEngine(bb, 32, weights=weights), LlamaEngine(bb, 32, weights=weights, lora="merged")
    ids = torch.randint(0, 16, (9,))
    a, b = low.feed(ids), merged.feed(ids)
    assert_close(b.draft_hidden, a.draft_hidden, rtol=0, atol=1e-4)
    assert_close(b.p_logits, a.p_logits, rtol=0, atol=1e-4)
    assert isinstance(merged.layers[-1].merged["qkv"], tuple) and not low.layers[-1].merged
    with torch.no_grad():  # in place, as load_state_dict or an optimiser would
        model.model.layers[0].self_attn.o_proj.weight.mul_(1.5)
        bb.draft_top.layers[str(L - 1)].mlp.down_proj.lora_B["default"].weight.add_(0.3)
    for e in (low, merged):
        assert e._stale()
        e.reset(32)
        out = e.feed(ids)
        with torch.inference_mode():
            assert_close(out.p_logits, model(ids[None]).logits[0], rtol=0, atol=1e-4)
            assert_close(out.draft_hidden, bb(ids[None]).draft_hidden[0], rtol=0, atol=1e-4)
        assert (out.p_logits - a.p_logits).abs().max() > 1e-2 and not e._stale()


@ROWDOT
def test_rowdot_layout_reads_a_bf16_checkpoint_from_bf16_storage_with_the_float32_bits(monkeypatch):
    """Weights that are bf16 numbers (a bf16 checkpoint loaded to float32) are held in bf16 storage
    (half the bytes) and give exactly the float32 copies' outputs; other weights stay float32."""
    import mtpc.backbones.llama as llama

    bb = _f32_adapter(1)
    wide = LlamaEngine(bb, 32, weights="rowdot")
    assert all(t.dtype == torch.float32 for t in wide.layers[0].packed.values()) and not wide.bf16_storage
    with torch.no_grad():  # round the base weights to bf16 numbers, as a bf16 checkpoint loaded to float32
        for name, p in bb.model.named_parameters():
            if "lora_" not in name:
                p.copy_(p.bfloat16().float())
    narrow = LlamaEngine(bb, 32, weights="rowdot")
    assert all(t.dtype == torch.bfloat16 for L in narrow.layers for t in L.packed.values())
    assert narrow.lm_head_packed.dtype == torch.bfloat16 and narrow.bf16_storage
    monkeypatch.setattr(llama, "rowdot_weight", lambda w: w.detach().contiguous().clone())
    wide = LlamaEngine(bb, 32, weights="rowdot")
    assert all(t.dtype == torch.float32 for L in wide.layers for t in L.packed.values())
    g = torch.Generator().manual_seed(5)
    for T in (7, 1, 3, 1):
        ids = torch.randint(0, 16, (T,), generator=g)
        a, b = narrow.feed(ids), wide.feed(ids)
        assert torch.equal(a.p_logits, b.p_logits) and torch.equal(a.draft_hidden, b.draft_hidden)
    _run_script(LlamaEngine(bb, 40, weights="rowdot"), bb, vocab=16, atol=1e-4)


def test_default_layout_per_dtype_and_refusals():
    f64, f32 = _adapter(_model(), 0), _f32_adapter(0)
    assert LlamaEngine(f64, 16).layout == "views"  # oneDNN has no float64
    assert LlamaEngine(f32, 16).layout == DEFAULT_F32
    assert LlamaEngine(f32, 16, compile=True).layout == "views"  # inductor lowers neither kernel
    with pytest.raises(ValueError, match=r"weights='onednn' needs float32 or bfloat16.*float64"):
        LlamaEngine(f64, 16, weights="onednn")
    with pytest.raises(ValueError, match=r"weights='onednn' does not combine with compile=True"):
        LlamaEngine(f32, 16, weights="onednn", compile=True)
    with pytest.raises(ValueError, match=r"weights='rowdot' needs float32 weights \(got torch.float64\)"):
        LlamaEngine(f64, 16, weights="rowdot")
    with pytest.raises(ValueError, match=r"weights='rowdot' does not combine with compile=True"):
        LlamaEngine(f32, 16, weights="rowdot", compile=True)


@pytest.mark.parametrize(
    "weights,dtype",
    [("onednn", torch.float32), ("packed", torch.float64), ("packed", torch.float32)]
    + [pytest.param("rowdot", torch.float32, marks=ROWDOT)],
)
@pytest.mark.parametrize("k", [0, 1])
def test_fast_paths_give_the_generic_blocks_bits(weights, dtype, k):
    """The trunk layers' fast paths in fused layouts (`_block_one`: one byte, the plain step;
    `_block_rows`: several bytes after cached ones, the verify) compute the same bits as the
    generic block, for the logits, the draft state and every cache."""
    bb = _adapter(_model(), k) if dtype == torch.float64 else _f32_adapter(k)
    fast, slow = LlamaEngine(bb, 40, weights=weights), LlamaEngine(bb, 40, weights=weights)
    slow._one_row = False
    calls = {"one": 0, "rows": 0}

    def counting(name, original):
        def run(*args):
            calls[name] += 1
            return original(*args)

        return run

    fast._block_one = counting("one", fast._block_one)
    fast._block_rows = counting("rows", fast._block_rows)
    g = torch.Generator().manual_seed(3)
    for T in (6, 1, 1, 3, 1, 1, 4, 1):  # a prefill (the generic causal path), steps and verifies
        ids = torch.randint(0, 16, (T,), generator=g)
        a, b = fast.feed(ids), slow.feed(ids)
        assert torch.equal(a.p_logits, b.p_logits) and torch.equal(a.draft_hidden, b.draft_hidden)
        if T == 4:  # a crop then a verify again, as the loop's rejected drafts do
            fast.crop(fast.length - 2), slow.crop(slow.length - 2)
            ids = torch.randint(0, 16, (2,), generator=g)
            a, b = fast.feed(ids), slow.feed(ids)
            assert torch.equal(a.p_logits, b.p_logits) and torch.equal(a.draft_hidden, b.draft_hidden)
    for (k1, v1), (k2, v2) in zip(fast.kv, slow.kv, strict=True):
        assert torch.equal(k1[:, :, : fast.length], k2[:, :, : slow.length])
        assert torch.equal(v1[:, :, : fast.length], v2[:, :, : slow.length])
    assert calls == {"one": 5 * (L - k), "rows": 3 * (L - k)}  # every trunk layer took its fast path


def test_automatic_onednn_choice_falls_back_to_views_when_oneDNN_cannot_reorder(monkeypatch):
    import mtpc.backbones.llama as llama

    def broken(weight):
        raise RuntimeError("could not create a primitive")

    monkeypatch.setattr(llama, "onednn_pack", broken)
    monkeypatch.setattr(llama, "rowdot_unsupported", lambda device, dtype: "no row-dot kernel here")
    bb = _f32_adapter(1)
    with pytest.warns(RuntimeWarning, match="oneDNN could not reorder the weights"):
        engine = LlamaEngine(bb, 32)  # the automatic choice falls back, and says why
    assert engine.layout == "views" and "could not create a primitive" in engine.layout_fallback
    _run_script(engine, bb, vocab=16, atol=1e-4)
    with pytest.raises(RuntimeError, match="could not create a primitive"):
        LlamaEngine(bb, 32, weights="onednn")  # asked for: the error stands


def test_engine_label_names_the_engine_and_layout():
    from mtpc import MtpcModel

    spec = {"kind": "cp", "window": 3, "rank": 2}
    assert MtpcModel.from_components(_f32_adapter(0), spec).engine_label() == f"compact/{DEFAULT_F32}"
    assert MtpcModel.from_components(_adapter(_model(), 0), spec).engine_label() == "compact/views"
    assert (
        MtpcModel.from_components(_f32_adapter(0), spec, weights="packed").engine_label() == "compact/packed"
    )
    hf = BackboneAdapter.from_hf(_model().float(), engine="hf")
    assert MtpcModel.from_components(hf, spec).engine_label() == "hf"
