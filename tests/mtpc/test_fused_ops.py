"""The fused decoding ops' Triton kernels (mtpc/backbones/fused_ops.py), where triton imports: on CUDA,
else under Triton's interpreter on CPU tensors (`TRITON_INTERPRET=1`, `make test-triton`; the
`device` fixture of test_decode_attention skips or, with MTPC_REQUIRE_TRITON=1, fails without it).

add_rms_norm against the engine's eager add + RMSNorm (float32 and bf16, with and without the
residual, d off a power of 2); rope_cache_write against apply_rope + index_copy_ (positions out of
order, the draft top's two rows, q / k / v as column slices of one product, the caches' other slots
untouched); the compact engine with `fused_ops=True` against its eager ops over prefill, steps,
verifies and crops (every layer taking the kernels), with split-KV attention too; the refusals.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from mtpc.backbones import LlamaEngine
from mtpc.backbones.fused_ops import (
    add_rms_norm,
    add_rms_norm_reference,
    rope_cache_write,
    rope_cache_write_reference,
)
from tests.backbone_helpers import randomize_lora, tiny_backbone
from tests.mtpc.test_decode_attention import device  # noqa: F401  (the kernel tests' device fixture)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("residual", [False, True])
def test_add_rms_norm_equals_the_eager_ops(device, dtype, residual):  # noqa: F811
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(2, 3, 48, generator=g).to(device=device, dtype=dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(48, generator=g)).to(device=device, dtype=dtype)
    s, h = add_rms_norm(x, r if residual else None, w, 1e-6)
    s_ref, h_ref = add_rms_norm_reference(x, r if residual else None, w, 1e-6)
    # float32: the add rounds once either way; the norm's sum in another order, one rounding apart.
    # bf16: the interpreter's casts may truncate where torch rounds, a few bf16 ulps over three casts
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    if dtype == torch.float32:
        assert torch.equal(s, s_ref)
    assert_close(s, s_ref, rtol=tol, atol=tol)
    assert_close(h, h_ref, rtol=tol, atol=tol)
    assert h.dtype == dtype and h.shape == x.shape


def _rope_inputs(dev, dtype, B=2, T=3, H=4, H_KV=2, D=16, C=24):
    g = torch.Generator().manual_seed(1)
    y = torch.randn(B, T, (H + 2 * H_KV) * D, generator=g).to(device=dev, dtype=dtype)
    q, k, v = y.split([H * D, H_KV * D, H_KV * D], dim=-1)  # column slices of one product, as the engine's
    ang = torch.randn(C, D // 2, generator=g)
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(device=dev, dtype=dtype)
    ssin = torch.cat([-ang.sin(), ang.sin()], -1).to(device=dev, dtype=dtype)
    kc = torch.randn(B, H_KV, C, D, generator=g).to(device=dev, dtype=dtype)
    vc = torch.randn(B, H_KV, C, D, generator=g).to(device=dev, dtype=dtype)
    pos = torch.tensor([7, 2, 19], device=dev)[:T]
    return q, k, v, cos, ssin, pos, kc, vc, H, H_KV, D


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rope_cache_write_equals_the_eager_ops(device, dtype):  # noqa: F811
    q, k, v, cos, ssin, pos, kc, vc, H, H_KV, D = _rope_inputs(device, dtype)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    got = rope_cache_write(q, k, v, cos, ssin, pos, kc, vc, H, H_KV, D)
    want = rope_cache_write_reference(q, k, v, cos, ssin, pos, kc_ref, vc_ref, H, H_KV, D)
    tol = 1e-6 if dtype == torch.float32 else 2e-2  # a contracted multiply-add; bf16 casts (see above)
    assert got.shape == want.shape == (2, H, 3, D)
    assert_close(got, want, rtol=tol, atol=tol)
    assert_close(kc, kc_ref, rtol=tol, atol=tol)
    assert torch.equal(vc, vc_ref)  # the values are copied
    others = torch.ones(kc.shape[2], dtype=torch.bool)
    others[pos.cpu()] = False
    assert torch.equal(kc[:, :, others.to(kc.device)], kc_ref[:, :, others.to(kc.device)])


def test_engine_with_fused_ops_equals_its_eager_ops(device, monkeypatch):  # noqa: F811
    """The compact engine's static calls (prefill <= 64, steps, verifies, crops; the draft top's two
    rows after its LoRA layer) with the fused ops give the eager engine's logits and draft hidden, also
    with split-KV attention; every layer of every static call took the kernels."""
    from mtpc.backbones import fused_ops

    calls = []
    real = fused_ops.rope_cache_write
    monkeypatch.setattr(fused_ops, "rope_cache_write", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    bb = tiny_backbone(lora_depth=1, dtype=torch.float32).to(device)
    randomize_lora(bb)
    base = LlamaEngine(bb, capacity=40, static=True)
    fused = LlamaEngine(bb, capacity=40, static=True, fused_ops=True)
    both = LlamaEngine(bb, capacity=40, static=True, fused_ops=True, attention="split_kv")
    g = torch.Generator().manual_seed(3)
    script = [("feed", 10), ("feed", 1), ("feed", 4), ("crop", 12), ("feed", 1), ("feed", 4), ("feed", 1)]
    for op, n in script:
        engines = (base, fused, both)
        if op == "crop":
            for e in engines:
                e.crop(n)
            continue
        ids = torch.randint(0, 16, (n,), generator=g).to(device)
        a, *rest = (e.feed(ids) for e in engines)
        for b in rest:  # float32 through 4 layers, a few roundings apart (the repo's float32 bound, 1e-4)
            assert_close(b.p_logits, a.p_logits, rtol=1e-4, atol=1e-4)
            assert_close(b.draft_hidden, a.draft_hidden, rtol=1e-4, atol=1e-4)
    assert base.length == fused.length == both.length == 18
    assert len(calls) == 2 * 6 * bb.model.config.num_hidden_layers


def test_fused_ops_refusals(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # no CUDA here and no interpreter: refused
    bb = tiny_backbone(dtype=torch.float32)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="fused_ops=True"):
            LlamaEngine(bb, capacity=40, static=True, fused_ops=True)
        with pytest.raises(ValueError, match="add_rms_norm"):
            add_rms_norm(torch.zeros(2, 8), None, torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="static shapes"):
        LlamaEngine(bb, capacity=40, static=False, fused_ops=True)
    assert LlamaEngine(bb, capacity=40).fused_ops is False  # the default is unchanged
