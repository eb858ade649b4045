"""The Triton kernels of the split-KV decode attention (flash-decoding); the API is in decode_attention.py.

Imported only by `mtpc.backbones.decode_attention` when the kernel is asked for (it imports triton
at module level; under `TRITON_INTERPRET=1`, set before the import, the kernels run on CPU tensors).

Stage 1 (`_split_kernel`, grid (batch x kv heads, splits, row tiles)): one program per key/value
head and split of the key range. Its query tile holds the n_rep query heads of that key/value head
times the m query rows (so the keys and values of a split are read once for the whole group; more
than MAX_BLOCK_R such rows take several tiles, which bounds a program's registers). It reads the
live length from the device, returns at once when its split starts at or past it, and otherwise
walks its keys in blocks of BLOCK_N with the online softmax (tiles loaded as float32: bf16 / fp16
inputs multiply in TF32, float32 ones in IEEE float32), writing the split's row maxima, sums and
unnormalised outputs (float32). Keys at or past the length are never loaded (masked loads give
0, so what the slots hold cannot reach the result); keys past a row's own position get -inf scores.

Stage 2 (`_combine_kernel`, grid (batch x heads x m,)): one program per query row reads the splits
that hold live keys (as many as the length covers, again read on the device) and combines them:
out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s, cast to the output's dtype.

UNVERIFIED on a GPU: tested here under the interpreter only (tests/mtpc/test_decode_attention.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

MAX_BLOCK_R = 64  # query rows (n_rep heads x m rows) per program of the first stage


@triton.jit
def _split_kernel(
    Q, K, V, LENGTH, MID_O, MID_M, MID_L,
    sqb, sqh, sqm, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    scale, H_KV, N_REP, M, D, CAPACITY, SPLIT_SIZE, NUM_SPLITS,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    pid_bh = tl.program_id(0)  # b * H_KV + kv head
    split = tl.program_id(1)
    tile = tl.program_id(2)
    b = pid_bh // H_KV
    kvh = pid_bh % H_KV
    length = tl.load(LENGTH).to(tl.int32)
    start = split * SPLIT_SIZE
    if start >= length:  # a split past the live length: no work, nothing written (stage 2 skips it)
        return
    end = tl.minimum(tl.minimum(start + SPLIT_SIZE, length), CAPACITY)

    r = tile * BLOCK_R + tl.arange(0, BLOCK_R)  # row r: query head kvh * N_REP + r // M, query row r % M
    d = tl.arange(0, BLOCK_D)
    row_ok = r < N_REP * M
    d_ok = d < D
    h = kvh * N_REP + r // M
    j = r % M
    q = tl.load(
        Q + b * sqb + h[:, None] * sqh + j[:, None] * sqm + d[None, :] * sqd,
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    limit = length - M + 1 + j  # row j attends to the keys < limit (its own position included)

    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    k_base = K + b * skb + kvh * skh
    v_base = V + b * svb + kvh * svh
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + n[:, None] * skn + d[None, :] * skd, mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # (BLOCK_R, BLOCK_N) float32
        s = tl.where((n[None, :] < limit[:, None]) & n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: exp(-inf) = 0
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + n[:, None] * svn + d[None, :] * svd, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new

    idx = ((b * H_KV * N_REP + h) * M + j) * NUM_SPLITS + split  # mid: (B, H, M, NUM_SPLITS[, D])
    tl.store(MID_M + idx, m_i, mask=row_ok)
    tl.store(MID_L + idx, l_i, mask=row_ok)
    tl.store(MID_O + idx[:, None] * D + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _combine_kernel(
    MID_O, MID_M, MID_L, LENGTH, OUT,
    sob, soh, som, sod,
    H, M, D, CAPACITY, SPLIT_SIZE, NUM_SPLITS,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)  # (b * H + h) * M + j
    j = row % M
    bh = row // M
    h = bh % H
    b = bh // H
    length = tl.minimum(tl.load(LENGTH).to(tl.int32), CAPACITY)
    live = (length + SPLIT_SIZE - 1) // SPLIT_SIZE  # splits stage 1 wrote in this launch
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < live
    d_ok = d < D
    base = row * NUM_SPLITS
    m_s = tl.load(MID_M + base + s, mask=s_ok, other=float("-inf"))
    l_s = tl.load(MID_L + base + s, mask=s_ok, other=0.0)
    o_s = tl.load(MID_O + (base + s)[:, None] * D + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    m_max = tl.max(m_s, 0)  # finite: every row attends to key 0
    w = tl.where(m_s == float("-inf"), 0.0, tl.exp(m_s - m_max))  # a split with no key for this row
    o = tl.sum(o_s * w[:, None], 0) / tl.sum(l_s * w, 0)
    tl.store(OUT + b * sob + h * soh + j * som + d * sod, o.to(OUT.dtype.element_ty), mask=d_ok)


def launch(q, k, v, length, out, mid_o, mid_m, mid_l, scale: float, plan) -> None:
    """Run both stages. q (B, H, m, D), k / v (B, H_kv, C, D), out (B, H, m, D) (any strides);
    mid_* float32 contiguous (B, H, m, S[, D]); plan: a `SplitPlan` (decode_attention.py)."""
    B, H, m, D = q.shape
    h_kv, capacity = k.shape[1], k.shape[2]
    n_rep = H // h_kv
    block_d = max(16, triton.next_power_of_2(D))
    block_r = min(MAX_BLOCK_R, max(16, triton.next_power_of_2(n_rep * m)))
    # the tiles are float32; a bf16 / fp16 value is exact in TF32 (8 / 10 mantissa bits <= 10), so
    # q k^T is exact products either way, and p v rounds p to TF32 (bf16 in flash kernels)
    precision = "ieee" if q.dtype.itemsize >= 4 else "tf32"
    _split_kernel[(B * h_kv, plan.num_splits, triton.cdiv(n_rep * m, block_r))](
        q, k, v, length, mid_o, mid_m, mid_l,
        *q.stride(), *k.stride(), *v.stride(),
        scale, h_kv, n_rep, m, D, capacity, plan.split_size, plan.num_splits,
        BLOCK_R=block_r, BLOCK_N=plan.block_n, BLOCK_D=block_d, DOT_PRECISION=precision,
    )  # fmt: skip
    _combine_kernel[(B * H * m,)](
        mid_o, mid_m, mid_l, length, out,
        *out.stride(),
        H, m, D, capacity, plan.split_size, plan.num_splits,
        BLOCK_S=max(2, triton.next_power_of_2(plan.num_splits)), BLOCK_D=block_d,
    )  # fmt: skip
