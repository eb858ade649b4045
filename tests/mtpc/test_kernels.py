"""mtpc/kernels.py: oneDNN's row-vector products equal x W^T (+ bias) to float32 rounding for every
row count the decoding loop uses, and say why they cannot run (float64, another device)."""

from __future__ import annotations

import pytest
import torch

from mtpc.kernels import onednn_linear, onednn_pack, onednn_unsupported


@pytest.mark.parametrize("rows", [1, 2, 8, 16, 17])
def test_onednn_linear_equals_linear(rows):
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(48, 32, generator=g), torch.randn(48, generator=g)
    x = torch.randn(2, rows, 32, generator=g)
    packed = onednn_pack(w)
    ref = torch.nn.functional.linear(x.double(), w.double(), b.double())
    assert (onednn_linear(x, packed, b).double() - ref).abs().max() < 1e-4
    assert (onednn_linear(x, packed).double() - (ref - b.double())).abs().max() < 1e-4
    assert (
        onednn_linear(x, onednn_pack(w.t().contiguous().t())).double() - (ref - b.double())
    ).abs().max() < 1e-4
    with torch.no_grad():
        w.mul_(2)  # the blocked copy does not follow its source
    assert (onednn_linear(x, packed).double() - (ref - b.double())).abs().max() < 1e-4


def test_onednn_bf16_and_reasons():
    w = torch.randn(16, 8, dtype=torch.bfloat16)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    ref = torch.nn.functional.linear(x.double(), w.double())
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert onednn_unsupported("cpu", torch.bfloat16) is None
        assert (onednn_linear(x, onednn_pack(w)).double() - ref).abs().max() < 0.05 * ref.abs().max()
    else:  # an AVX2-only CPU: the reason names what is missing, and packing indeed fails
        assert "bfloat16 needs a CPU with avx512" in onednn_unsupported("cpu", torch.bfloat16)
        with pytest.raises(RuntimeError, match="bf16"):
            onednn_pack(w)
    assert onednn_unsupported("cpu", torch.float32) is None
    assert "float64" in onednn_unsupported("cpu", torch.float64)
    assert "CPU only" in onednn_unsupported("meta", torch.float32)
