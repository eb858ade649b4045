"""Decode attention over the live length of a static KV cache, the length read from a device tensor.

The compact engine (llama.py) captures the 1-byte step and the n-byte verify as CUDA graphs with
static shapes, so its default attention runs over the cache's whole capacity with a mask. Here
the live length is a device tensor: a graph keeps its shapes and launch grid and replays at any
length, and the keys past the length are neither read nor computed on.

- `decode_attention_reference(q, k_cache, v_cache, length)`: plain torch, every op on the device
  (no host read of `length`), float32 (float64 for float64 inputs) throughout; the oracle.
- `split_kv_decode_attention(...)`: the same call on the Triton kernels of
  decode_attention_triton.py (flash-decoding): the key range is cut into `num_splits` splits of
  `split_size` keys (a multiple of `block_n`), one program per (batch row, key/value head, split;
  its n_rep query heads x m rows in tiles of at most 64) computes its split's partial softmax (row
  max, row sum, unnormalised output, float32) and a
  second kernel combines the splits that hold live keys. A split that starts at or past the
  length returns at once. CUDA (or `TRITON_INTERPRET=1` on CPU tensors), float32 / bf16 / fp16,
  tiles in float32 (bf16 / fp16 inputs multiply in TF32, which holds them exactly; float32 ones
  in IEEE float32, no TF32). UNVERIFIED on a GPU:
  its tests run under the Triton interpreter; bench/bench_gpu.py is where it is to be measured.

Layouts (the engine's): q (B, H, m, D), k_cache / v_cache (B, H_kv, C, D) with H a multiple of H_kv
(grouped-query attention: query head h reads key/value head h // (H / H_kv)); the output is
(B, H, m, D) (for the kernel a transposed view of a (B, m, H, D) buffer, so that the engine's
(B, m, H D) reshape is a view). Also accepted without the batch axis, in the token-major layout
q (m, H, D), k_cache / v_cache (C, H_kv, D) (views, nothing copied); the output is then (m, H, D).
Any strides.

Convention: `length` (an integer tensor with one element, on the device) is the live length with
the m new rows already written, so query row j (0-based) sits at position length - m + j and attends
to the keys at positions < length - m + 1 + j: the step (m = 1) to all `length` keys, the verify's
rows each to the cache up to its own position (the causal mask of the default attention). Needs
m <= length <= C; it is not checked (that would read the length on the host). The slots at or past
the length may hold anything (NaN included): they do not reach the result. Scale: `scale`, default
D ** -0.5 (the engine's).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from dataclasses import dataclass

import torch
from torch import Tensor

#: dtypes the Triton kernel takes (products accumulate in float32, so float64 is not offered)
SPLIT_KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DEFAULT_BLOCK_N = 32  # keys per tile of the first stage
MAX_SPLITS = 64  # the default plan cuts the capacity into at most this many splits


@dataclass(frozen=True)
class SplitPlan:
    """The launch shape of the split-KV kernel: a function of the capacity only, never of the length."""

    block_n: int  # keys per tile (a power of 2, >= 16)
    split_size: int  # keys per split (a multiple of block_n)
    num_splits: int  # ceil(capacity / split_size): the first stage's grid along the keys


def split_plan(capacity: int, block_n: int | None = None, num_splits: int | None = None) -> SplitPlan:
    """Tiles of `block_n` keys (default 32), as many splits as asked (default: one tile each, at most
    MAX_SPLITS), each a whole number of tiles."""
    block_n = DEFAULT_BLOCK_N if block_n is None else block_n
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n={block_n}: expected a power of 2, at least 16")
    tiles = -(-capacity // block_n)
    want = min(tiles, MAX_SPLITS) if num_splits is None else num_splits
    if want < 1:
        raise ValueError(f"num_splits={num_splits}: expected at least 1")
    split_size = block_n * -(-tiles // min(want, tiles))
    return SplitPlan(block_n, split_size, -(-capacity // split_size))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=1)
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_unsupported(
    device: torch.device | str, dtype: torch.dtype, dtypes: tuple, what: str = "the kernel"
) -> str | None:
    """Why Triton kernels (`what`) taking `dtypes` cannot run for tensors of this device and dtype (one
    line), or None: the split-KV kernel's and the fused ops' (mtpc/backbones/fused_ops.py) check."""
    if not _has_triton():
        return "triton is not importable"
    if torch.device(device).type != "cuda" and not _interpreting():
        return f"device {torch.device(device).type!r}: {what} runs on CUDA (or under TRITON_INTERPRET=1)"
    if dtype not in dtypes:
        return f"dtype {dtype}: {what} takes {', '.join(str(d) for d in dtypes)}"
    return None


def split_kv_unsupported(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why the split-KV kernel cannot run for tensors of this device and dtype (one line), or None."""
    return triton_unsupported(device, dtype, SPLIT_KV_DTYPES)


def _as_4d(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> tuple[Tensor, Tensor, Tensor, bool]:
    """The engine's layout (views); True when the inputs were token-major without a batch axis."""
    if q.dim() == 3 and k_cache.dim() == 3 and v_cache.dim() == 3:
        return q.permute(1, 0, 2)[None], k_cache.permute(1, 0, 2)[None], v_cache.permute(1, 0, 2)[None], True
    if q.dim() == 4 and k_cache.dim() == 4 and v_cache.dim() == 4:
        return q, k_cache, v_cache, False
    raise ValueError(
        f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}: expected "
        "(B, H, m, D) with (B, H_kv, C, D) caches, or (m, H, D) with (C, H_kv, D) caches"
    )


def _check(q: Tensor, k: Tensor, v: Tensor, length: Tensor) -> None:
    B, H, m, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D or H % k.shape[1]:
        raise ValueError(
            f"q {tuple(q.shape)} with k_cache {tuple(k.shape)}, v_cache {tuple(v.shape)}: expected caches "
            "(B, H_kv, C, D) alike, with H a multiple of H_kv"
        )
    if m > k.shape[2]:
        raise ValueError(f"{m} query rows exceed the capacity {k.shape[2]}")
    if length.numel() != 1 or length.dtype.is_floating_point or length.dtype.is_complex:
        raise ValueError(
            f"length: expected an integer tensor with one element, got {length.dtype} {tuple(length.shape)}"
        )
    if length.device != q.device:
        raise ValueError(f"length is on {length.device}, q on {q.device}")


def decode_attention_reference(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, length: Tensor, *, scale: float | None = None
) -> Tensor:
    """Attention of q's m rows over the cache's live keys (module docstring: layouts, convention), in
    plain torch: fixed shapes, no host read; float32 (float64 for float64 inputs), cast back to q's dtype."""
    q4, k4, v4, token_major = _as_4d(q, k_cache, v_cache)
    _check(q4, k4, v4, length)
    B, H, m, D = q4.shape
    C, n_rep = k4.shape[2], H // k4.shape[1]
    dt = torch.promote_types(q.dtype, torch.float32)
    L = length.reshape(()).long()
    pos = torch.arange(C, device=q.device)
    live = (pos < L)[:, None]  # (C, 1): slots past the length are replaced, never multiplied
    k = torch.where(live, k4.to(dt), 0.0).repeat_interleave(n_rep, dim=1)  # (B, H, C, D)
    v = torch.where(live, v4.to(dt), 0.0).repeat_interleave(n_rep, dim=1)
    limit = L - m + 1 + torch.arange(m, device=q.device)  # row j: keys < limit[j]
    allowed = pos[None, :] < limit[:, None]  # (m, C)
    s = (q4.to(dt) @ k.transpose(-1, -2)) * (D**-0.5 if scale is None else scale)
    out = (torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1) @ v).to(q.dtype)  # (B, H, m, D)
    return out[0].permute(1, 0, 2) if token_major else out


def split_kv_decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    length: Tensor,
    *,
    scale: float | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
) -> Tensor:
    """`decode_attention_reference` on the split-KV Triton kernels (module docstring). The launch
    grid and the buffers depend on the shapes and the plan (`split_plan(C, block_n, num_splits)`)
    only, so a CUDA graph captured at one length replays at any other (the length tensor is read
    by the kernels). UNVERIFIED on a GPU (tested under the Triton interpreter)."""
    reason = split_kv_unsupported(q.device, q.dtype)
    if reason:
        raise ValueError(f"split_kv_decode_attention: {reason}")
    q4, k4, v4, token_major = _as_4d(q, k_cache, v_cache)
    _check(q4, k4, v4, length)
    if k4.dtype != q.dtype or v4.dtype != q.dtype:
        raise ValueError(f"q is {q.dtype}, the caches {k4.dtype} / {v4.dtype}: expected one dtype")
    from mtpc.backbones import decode_attention_triton as kernels

    B, H, m, D = q4.shape
    plan = split_plan(k4.shape[2], block_n, num_splits)
    f32 = {"device": q.device, "dtype": torch.float32}
    mid_o = torch.empty(B, H, m, plan.num_splits, D, **f32)
    mid_m = torch.empty(B, H, m, plan.num_splits, **f32)
    mid_l = torch.empty(B, H, m, plan.num_splits, **f32)
    out = torch.empty(B, m, H, D, device=q.device, dtype=q.dtype).transpose(1, 2)  # (B, H, m, D) view
    scale = D**-0.5 if scale is None else scale
    with torch.cuda.device(q.device) if q.device.type == "cuda" else contextlib.nullcontext():
        kernels.launch(q4, k4, v4, length.reshape(1), out, mid_o, mid_m, mid_l, scale, plan)
    return out[0].permute(1, 0, 2) if token_major else out
