"""The row-dot kernel (mtpc/csrc/rowdot.cpp via mtpc.kernels): x W^T in W's own (out, in) layout,
each row's bits independent of how many rows the call holds (what lets a verify row equal the
step's row exactly), within float32 rounding of a float64 product, and its refusals."""

from __future__ import annotations

import pytest
import torch

from mtpc.kernels import rowdot_linear, rowdot_unsupported, rowdot_weight

WHY = rowdot_unsupported("cpu", torch.float32)
pytestmark = pytest.mark.skipif(WHY is not None, reason=str(WHY))


@pytest.mark.parametrize("K", [512, 37, 8, 3])
@pytest.mark.parametrize("N", [1, 7, 50, 97, 130])
def test_each_row_has_the_bits_of_its_one_row_product(N, K):
    g = torch.Generator().manual_seed(N * 1000 + K)
    w = torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g)
    for M in (1, 2, 3, 4, 5, 7, 8, 9):  # every row tile (4, 3, 2, 1) and their mixes
        x = torch.randn(M, K, generator=g)
        for bias in (None, b):
            y = rowdot_linear(x, w, bias)
            assert y.shape == (M, N) and y.dtype == torch.float32
            for m in range(M):
                assert torch.equal(rowdot_linear(x[m : m + 1], w, bias)[0], y[m]), (M, m)
            ref = x.double() @ w.double().t() + (0 if bias is None else bias.double())
            scale = (x.double().abs() @ w.double().abs().t()).max().item() + 1.0
            assert (y.double() - ref).abs().max().item() <= 1e-6 * scale


def test_shapes_strides_and_lead_dims():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 32, generator=g)
    x = torch.randn(2, 3, 32, generator=g)
    y = rowdot_linear(x, w)
    assert y.shape == (2, 3, 64)
    assert torch.equal(y.reshape(6, 64), rowdot_linear(x.reshape(6, 32), w))
    xt = torch.randn(32, 5, generator=g).t()  # not contiguous: the same values give the same bits
    assert torch.equal(rowdot_linear(xt, w), rowdot_linear(xt.contiguous(), w))
    assert rowdot_linear(torch.empty(0, 32), w).shape == (0, 64)


def test_refusals_name_what_was_wrong():
    w = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="x must be float32"):
        rowdot_linear(torch.randn(2, 8, dtype=torch.float64), w)
    with pytest.raises(RuntimeError, match="w must be float32 or bfloat16 storage"):
        rowdot_linear(torch.randn(2, 8), w.double())
    with pytest.raises(RuntimeError, match="contiguous"):
        rowdot_linear(torch.randn(2, 4), w.t())
    with pytest.raises(RuntimeError, match="last dim"):
        rowdot_linear(torch.randn(2, 7), w)
    with pytest.raises(RuntimeError, match="bias"):
        rowdot_linear(torch.randn(2, 8), w, torch.randn(5))
    assert "float32" in rowdot_unsupported("cpu", torch.bfloat16)
    assert "CPU only" in rowdot_unsupported("meta", torch.float32)


@pytest.mark.parametrize("K", [512, 37])
def test_bf16_storage_gives_the_float32_bits_for_bf16_numbers(K):
    """W read from bf16 storage is widened exactly: for a W of bf16 numbers (a bf16 checkpoint
    loaded to float32) the product has the float32 W's bits; `rowdot_weight` narrows only then."""
    g = torch.Generator().manual_seed(K)
    w = torch.randn(97, K, generator=g).bfloat16().float()  # bf16 numbers in float32
    b = torch.randn(97, generator=g)
    stored = rowdot_weight(w)
    assert stored.dtype == torch.bfloat16 and stored.is_contiguous()
    for M in (1, 4, 5):
        x = torch.randn(M, K, generator=g)
        assert torch.equal(rowdot_linear(x, stored, b), rowdot_linear(x, w, b))
        assert torch.equal(rowdot_linear(x[:1], stored, b)[0], rowdot_linear(x, stored, b)[0])
    off = w.clone()
    off[3, 5] += 1e-3  # one value that is not a bf16 number: the copy stays float32
    kept = rowdot_weight(off)
    assert kept.dtype == torch.float32 and torch.equal(kept, off) and kept.data_ptr() != off.data_ptr()


@pytest.mark.parametrize("N", [320, 40, 13])
def test_batched_short_rows_match_float64_and_bf16_storage_keeps_the_bits(N):
    """rowdot_batched (the head decoder's App. G leaves): x (J, K) @ WT (J, K, N) + a bias row per group,
    within float32 rounding of float64; a WT of bf16 numbers from bf16 storage has the float32 bits."""
    from mtpc.kernels import rowdot_batched

    gen = torch.Generator().manual_seed(N)
    J, K, G = 12, 16, 3
    x = torch.randn(J, K, generator=gen)
    wt = torch.randn(J, K, N, generator=gen).bfloat16().float()
    bias = torch.randn(G, N, generator=gen)
    y = rowdot_batched(x, wt, bias)
    ref = torch.bmm(x.double().unsqueeze(1), wt.double()).squeeze(1) + bias.double().repeat_interleave(
        J // G, 0
    )
    assert y.shape == (J, N) and torch.allclose(y.double(), ref, atol=1e-5)
    narrow = rowdot_weight(wt.view(J * K, N)).view(J, K, N)
    assert narrow.dtype == torch.bfloat16
    assert torch.equal(rowdot_batched(x, narrow, bias), y)
    with pytest.raises(RuntimeError, match="G dividing J"):
        rowdot_batched(x, wt, torch.randn(5, N))
