"""Fused decoding ops for the compact engine on a GPU: one kernel where the eager layer runs several.

- `add_rms_norm(x, r, weight, eps)` -> (s, h): the residual sum s = x + r (or x when r is None) and
  transformers' LlamaRMSNorm of it, h = weight * (s in float32 * rsqrt(mean(s^2) + eps)) rounded to
  the dtype — one read of x and r, one write of s and h, instead of the add and the norm's ~6 ops.
- `rope_cache_write(q, k, v, cos, signed_sin, pos, k_cache, v_cache, n_heads, n_kv_heads, head_dim)`
  -> q rotated, (B, H, T, D): RoPE on the query and key heads (HF's rotate-half) at the positions in
  the device tensor `pos`, the rotated keys and the values written into the caches there — one
  kernel instead of two RoPEs (~4 ops each) and two index copies.
- `*_reference`: the same in plain torch (the engine's eager ops), the tests' oracle.

Why Triton and not torch.compile: the engine's static calls are captured as CUDA graphs with the
split-KV Triton attention inside, which `compile=True` does not combine with (and inductor would
recompile per input length, seconds each); two hand-written kernels keep the graphs and the launch
counts known. Triton, not CUDA C++: nothing to build on the device image, and the same source runs
under Triton's interpreter here. CUDA (or `TRITON_INTERPRET=1` on CPU tensors), float32 / bf16 /
fp16. Within rounding of the eager ops, not bit-equal (the norm's sum is reduced in another order;
products may contract into FMAs): the step and the verify both use them, so greedy speculative
decoding still equals plain decoding on the same engine (`LlamaEngine(fused_ops=True)`).
UNVERIFIED on a GPU: tested under the interpreter (tests/mtpc/test_fused_ops.py); bench/bench_gpu.py
times the step and the verify with and without them.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from mtpc.backbones.decode_attention import SPLIT_KV_DTYPES, triton_unsupported

FUSED_OPS_DTYPES = SPLIT_KV_DTYPES


def fused_ops_unsupported(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why the fused ops cannot run for tensors of this device and dtype (one line), or None."""
    return triton_unsupported(device, dtype, FUSED_OPS_DTYPES, "each fused-op kernel")


def _device(t: Tensor):
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def _check(name: str, t: Tensor) -> None:
    reason = fused_ops_unsupported(t.device, t.dtype)
    if reason:
        raise ValueError(f"{name}: {reason}")


def add_rms_norm(x: Tensor, r: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(s, h) for x, r (..., d) of one dtype, weight (d,) (module docstring); new tensors."""
    _check("add_rms_norm", x)
    if r is not None and (r.shape != x.shape or r.dtype != x.dtype):
        raise ValueError(
            f"add_rms_norm: r {r.dtype} {tuple(r.shape)} must match x {x.dtype} {tuple(x.shape)}"
        )
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"add_rms_norm: weight {tuple(weight.shape)} must be ({x.shape[-1]},)")
    from mtpc.backbones import fused_ops_triton as kernels

    d = x.shape[-1]
    x2 = x.reshape(-1, d).contiguous()
    r2 = None if r is None else r.reshape(-1, d).contiguous()
    s2 = x2 if r is None else torch.empty_like(x2)
    h2 = torch.empty_like(x2)
    with _device(x):
        kernels.add_rms_norm(x2, r2, weight.to(x.dtype).contiguous(), s2, h2, float(eps))
    return s2.view(x.shape), h2.view(x.shape)


def add_rms_norm_reference(x: Tensor, r: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    s = x if r is None else x + r
    h = s.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return s, weight * h.to(s.dtype)


def _rows(t: Tensor, width: int) -> Tensor:
    """(B, T, width) with a contiguous last dim (a column slice of the qkv product is one)."""
    if t.dim() != 3 or t.shape[-1] != width:
        raise ValueError(f"rope_cache_write: expected (B, T, {width}), got {tuple(t.shape)}")
    return t if t.stride(-1) == 1 else t.contiguous()


def rope_cache_write(
    q: Tensor, k: Tensor, v: Tensor, cos: Tensor, signed_sin: Tensor, pos: Tensor,
    k_cache: Tensor, v_cache: Tensor, n_heads: int, n_kv_heads: int, head_dim: int,
) -> Tensor:  # fmt: skip
    """q (B, T, H D), k / v (B, T, H_kv D), cos / signed_sin (C, D), pos (T,) on the device, caches
    (B, H_kv, C, D) -> q rotated (B, H, T, D); the caches receive the rotated keys and the values at pos."""
    _check("rope_cache_write", q)
    if head_dim % 2:
        raise ValueError(f"rope_cache_write: head_dim={head_dim} must be even")
    q, k, v = _rows(q, n_heads * head_dim), _rows(k, n_kv_heads * head_dim), _rows(v, n_kv_heads * head_dim)
    B, T = q.shape[:2]
    if k_cache.shape != (B, n_kv_heads, k_cache.shape[2], head_dim) or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"rope_cache_write: caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)}, expected "
            f"({B}, {n_kv_heads}, C, {head_dim})"
        )
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("rope_cache_write: the caches' last dim must be contiguous")
    from mtpc.backbones import fused_ops_triton as kernels

    qout = torch.empty(B, n_heads, T, head_dim, device=q.device, dtype=q.dtype)
    with _device(q):
        kernels.rope_cache(
            q, k, v, cos.contiguous(), signed_sin.contiguous(), pos.contiguous(), qout, k_cache, v_cache,
            n_heads, n_kv_heads, head_dim,
        )  # fmt: skip
    return qout


def rope_cache_write_reference(
    q: Tensor, k: Tensor, v: Tensor, cos: Tensor, signed_sin: Tensor, pos: Tensor,
    k_cache: Tensor, v_cache: Tensor, n_heads: int, n_kv_heads: int, head_dim: int,
) -> Tensor:  # fmt: skip
    """The engine's eager ops: `llama.apply_rope` (x cos + roll(x, D/2) signed_sin, spelled out here:
    llama imports this module) on (B, h, T, D) heads, index_copy_ into the caches."""

    def apply_rope(x: Tensor, c: Tensor, s: Tensor) -> Tensor:
        return x * c + x.roll(x.shape[-1] // 2, -1) * s

    B, T = q.shape[:2]
    c, s = cos.index_select(0, pos), signed_sin.index_select(0, pos)
    qh = apply_rope(q.reshape(B, T, n_heads, head_dim).transpose(1, 2), c, s)
    kh = apply_rope(k.reshape(B, T, n_kv_heads, head_dim).transpose(1, 2), c, s)
    k_cache.index_copy_(2, pos, kh)
    v_cache.index_copy_(2, pos, v.reshape(B, T, n_kv_heads, head_dim).transpose(1, 2))
    return qh
