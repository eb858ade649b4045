"""The Triton kernels of the fused decoding ops; the API is in fused_ops.py.

Imported only by `mtpc.backbones.fused_ops` when a fused op is asked for (it imports triton at module
level; under `TRITON_INTERPRET=1`, set before the import, the kernels run on CPU tensors).

- `_add_rms_norm_kernel` (grid: rows): one program per row of d values: s = x + r (rounded to the
  input dtype, as torch adds), written back as the new residual when r is given, then transformers'
  LlamaRMSNorm of s: h = s (float32) * rsqrt(mean(s^2) + eps), rounded to the dtype, times the weight.
- `_rope_cache_kernel` (grid: rows x (query heads + key/value heads)): one program per (row, head):
  a query head is rotated (HF's rotate-half: x cos + roll(x, D/2) signed_sin at the row's position,
  each product rounded to the dtype, as torch computes it) into the (B, H, T, D) query buffer; a
  key/value head's key is rotated and written with its value into the caches at the row's position
  (read from the device), so a captured graph replays at any position.

UNVERIFIED on a GPU: tested here under the interpreter only (tests/mtpc/test_fused_ops.py).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(
    X, R, W, S, H, sx, sr, ss, sh, D, eps, HAS_R: tl.constexpr, BLOCK_D: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    x = tl.load(X + row * sx + d, mask=ok, other=0.0)
    if HAS_R:
        x = (x.to(tl.float32) + tl.load(R + row * sr + d, mask=ok, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(S + row * ss + d, x, mask=ok)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
    h = (xf * inv).to(x.dtype)
    w = tl.load(W + d, mask=ok, other=0.0)
    tl.store(H + row * sh + d, (w.to(tl.float32) * h.to(tl.float32)).to(x.dtype), mask=ok)


@triton.jit
def _rotate(src, d, rolled, ok, cos, sin):
    """HF's rotate-half of one head at src: x cos + roll(x, D/2) signed_sin, each product and the
    sum rounded to the dtype as torch rounds them (float32 math in between)."""
    x = tl.load(src + d, mask=ok, other=0.0)
    xr = tl.load(src + rolled, mask=ok, other=0.0)
    a = (x.to(tl.float32) * cos).to(x.dtype)
    c = (xr.to(tl.float32) * sin).to(x.dtype)
    return (a.to(tl.float32) + c.to(tl.float32)).to(x.dtype)


@triton.jit
def _rope_cache_kernel(
    Q, K, V, COS, SIN, POS, QOUT, KC, VC,
    sqb, sqt, skb, skt, svb, svt,
    sob, soh, sot,
    skcb, skch, skcn, svcb, svch, svcn,
    T, N_HEADS, HALF, D, BLOCK_D: tl.constexpr,
):  # fmt: skip
    bt = tl.program_id(0)  # b * T + t
    head = tl.program_id(1)  # query heads first, then key/value heads
    b = bt // T
    t = bt % T
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    rolled = (d + HALF) % D  # roll(x, D/2)[d] = x[(d - D/2) mod D] = x[(d + D/2) mod D]
    p = tl.load(POS + t).to(tl.int64)
    cos = tl.load(COS + p * D + d, mask=ok, other=0.0).to(tl.float32)
    sin = tl.load(SIN + p * D + d, mask=ok, other=0.0).to(tl.float32)
    if head < N_HEADS:
        out = _rotate(Q + b * sqb + t * sqt + head * D, d, rolled, ok, cos, sin)
        tl.store(QOUT + b * sob + head * soh + t * sot + d, out, mask=ok)
    else:
        j = head - N_HEADS
        out = _rotate(K + b * skb + t * skt + j * D, d, rolled, ok, cos, sin)
        tl.store(KC + b * skcb + j * skch + p * skcn + d, out, mask=ok)
        v = tl.load(V + b * svb + t * svt + j * D + d, mask=ok, other=0.0)
        tl.store(VC + b * svcb + j * svch + p * svcn + d, v, mask=ok)


def add_rms_norm(x2, r2, w, s2, h2, eps: float) -> None:
    """x2, r2 (rows, D) (r2 may be None), s2, h2 (rows, D) outputs; last dims contiguous."""
    rows, D = x2.shape
    _add_rms_norm_kernel[(rows,)](
        x2, r2 if r2 is not None else x2, w, s2, h2,
        x2.stride(0), (r2 if r2 is not None else x2).stride(0), s2.stride(0), h2.stride(0),
        D, eps, HAS_R=r2 is not None, BLOCK_D=triton.next_power_of_2(D),
    )  # fmt: skip


def rope_cache(q, k, v, cos, sin, pos, qout, kc, vc, n_heads: int, n_kv: int, head_dim: int) -> None:
    """q (B, T, H D), k / v (B, T, H_kv D) (last dims contiguous), cos / sin (C, D) contiguous, pos (T,),
    qout (B, H, T, D), caches (B, H_kv, C, D) with contiguous last dims."""
    B, T = q.shape[0], q.shape[1]
    _rope_cache_kernel[(B * T, n_heads + n_kv)](
        q, k, v, cos, sin, pos, qout, kc, vc,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        qout.stride(0), qout.stride(1), qout.stride(2),
        kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
        T, n_heads, head_dim // 2, head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip
