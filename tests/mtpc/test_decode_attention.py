"""Decode attention over the live length (mtpc/backbones/decode_attention.py).

Always: the eager reference against torch SDPA with an explicit causal / length mask (capacities,
live lengths from m to the capacity and off the block size, GQA ratios 1 and 4, m in {1, 4, 16},
float32), garbage past the length, both layouts, the launch plan, the refusals (also the compact
engine's `attention=` option). Where triton imports: the split-KV kernel against the reference (on
CUDA, else under the Triton interpreter on CPU tensors when `TRITON_INTERPRET=1` is set),
NaN past the length kept out, one length tensor moved in place between two calls with the same
launch (the CUDA graph replay property) and no host read of it, and the compact engine with
`attention="split_kv"` against its default attention over prefill, steps, verifies and crops.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.testing import assert_close

from mtpc.backbones import LlamaEngine
from mtpc.backbones.decode_attention import (
    MAX_SPLITS,
    decode_attention_reference,
    split_kv_decode_attention,
    split_plan,
)
from tests.backbone_helpers import randomize_lora, tiny_backbone

D = 64
H_KV = 2


def _inputs(capacity, m, n_rep, length, dtype=torch.float32, device="cpu", garbage=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, H_KV * n_rep, m, D, generator=g)
    k = torch.randn(1, H_KV, capacity, D, generator=g)
    v = torch.randn(1, H_KV, capacity, D, generator=g)
    if garbage is not None:  # the slots past the live length
        k[:, :, length:] = garbage
        v[:, :, length:] = garbage
    return [t.to(device=device, dtype=dtype) for t in (q, k, v)]


def _lengths(capacity, m):
    """m (only the new rows), the capacity, and lengths off any power-of-2 block."""
    return sorted({m, capacity, max(m, 37), capacity - 5})


def _sdpa(q, k, v, length):
    """SDPA over the whole capacity with an explicit mask: row j attends to the keys < length - m + 1 + j."""
    m, C, n_rep = q.shape[2], k.shape[2], q.shape[1] // k.shape[1]
    limit = length - m + 1 + torch.arange(m)
    mask = torch.arange(C)[None, :] < limit[:, None]
    rep = (k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1))
    return F.scaled_dot_product_attention(q, *rep, attn_mask=mask, scale=q.shape[-1] ** -0.5)


# ------------------------------------------------------------------------------------ reference


@pytest.mark.parametrize("capacity", [64, 100, 256])
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("n_rep", [1, 4])
def test_reference_equals_sdpa_with_an_explicit_mask(capacity, m, n_rep):
    for length in _lengths(capacity, m):
        q, k, v = _inputs(capacity, m, n_rep, length, garbage=1e3)  # finite garbage: SDPA masks it
        got = decode_attention_reference(q, k, v, torch.tensor(length))
        assert_close(got, _sdpa(q, k, v, length), rtol=1e-5, atol=1e-6, msg=f"length {length}")


def test_reference_keeps_nan_past_the_length_out_and_takes_the_token_major_layout():
    q, k, v = _inputs(100, 4, 4, 37, garbage=float("nan"))
    length = torch.tensor([37])
    got = decode_attention_reference(q, k, v, length)
    assert not got.isnan().any()
    clean = [t.clone() for t in (k, v)]
    for t in clean:
        t[:, :, 37:] = 0.0
    assert_close(got, _sdpa(q, *clean, 37), rtol=1e-5, atol=1e-6)
    # (m, H, D) with (C, H_kv, D) caches: the same attention, without a batch axis
    tm = decode_attention_reference(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), length)
    assert tm.shape == (4, 8, D)
    assert_close(tm, got[0].transpose(0, 1), rtol=0, atol=0)


def test_reference_refuses_mismatched_shapes_and_a_float_length():
    q, k, v = _inputs(64, 4, 1, 10)
    with pytest.raises(ValueError, match="H a multiple of H_kv"):
        decode_attention_reference(q[:, :1], k, v, torch.tensor(10))
    with pytest.raises(ValueError, match="integer tensor"):
        decode_attention_reference(q, k, v, torch.tensor(10.0))
    with pytest.raises(ValueError, match="expected"):
        decode_attention_reference(q[0], k, v, torch.tensor(10))


def test_the_plan_depends_on_the_capacity_only_and_covers_it():
    for capacity in (16, 64, 100, 1280, 4096):
        for block_n, splits in ((None, None), (16, None), (32, 3), (64, 1000)):
            p = split_plan(capacity, block_n, splits)
            assert p.split_size % p.block_n == 0
            assert (p.num_splits - 1) * p.split_size < capacity <= p.num_splits * p.split_size
            assert p.num_splits <= (MAX_SPLITS if splits is None else splits)
    with pytest.raises(ValueError, match="power of 2"):
        split_plan(64, 24)


def test_the_kernel_and_the_engine_option_refuse_what_they_cannot_run(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # on this CPU: no CUDA, no interpreter
    q, k, v = _inputs(64, 1, 1, 10)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="triton is not importable|runs on CUDA"):
            split_kv_decode_attention(q, k, v, torch.tensor(10))
    bb = tiny_backbone(dtype=torch.float32)
    with pytest.raises(ValueError, match="attention='bogus'"):
        LlamaEngine(bb, capacity=40, static=True, attention="bogus")
    with pytest.raises(ValueError, match="needs static shapes"):
        LlamaEngine(bb, capacity=40, static=False, attention="split_kv")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="attention='split_kv'"):
            LlamaEngine(bb, capacity=40, static=True, attention="split_kv")
    assert LlamaEngine(bb, capacity=40).attention == "sdpa"  # the default is unchanged


# ------------------------------------------------------------------------------------ Triton kernel


@pytest.fixture(scope="module")
def device():
    """CUDA when there is one, else the Triton interpreter on CPU tensors (TRITON_INTERPRET=1 must be
    set before triton is first imported: triton.language's own helpers are jitted at import).
    Without them these tests skip, unless MTPC_REQUIRE_TRITON=1 (`make test-triton`, CI) makes that
    a failure."""
    required = os.environ.get("MTPC_REQUIRE_TRITON") == "1"
    try:
        import triton  # noqa: F401
    except ImportError:
        if required:
            pytest.fail("MTPC_REQUIRE_TRITON=1 but triton is not importable (make test-triton installs it)")
        pytest.skip("the split-KV kernel needs triton (not a dependency)")
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") != "1":
        if required:
            pytest.fail("MTPC_REQUIRE_TRITON=1 without CUDA needs TRITON_INTERPRET=1")
        pytest.skip("no CUDA: set TRITON_INTERPRET=1 to run the split-KV kernel in Triton's interpreter")
    return "cpu"


@pytest.mark.parametrize("capacity", [64, 100])
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("n_rep", [1, 4])
def test_kernel_equals_the_reference_and_keeps_nan_past_the_length_out(device, capacity, m, n_rep):
    for length in _lengths(capacity, m)[:3]:
        q, k, v = _inputs(capacity, m, n_rep, length, device=device, garbage=float("nan"))
        ln = torch.tensor([length], device=device)
        want = decode_attention_reference(q, k, v, ln)
        got = split_kv_decode_attention(q, k, v, ln, block_n=16)  # several splits, the last one partial
        assert not got.isnan().any(), f"length {length}"
        assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"length {length}")


def test_kernel_with_several_tiles_per_split_and_row_tiles_the_token_major_layout_and_bf16(device):
    q, k, v = _inputs(100, 16, 8, 61, device=device, garbage=float("nan"))  # 128 query rows: 2 row tiles
    ln = torch.tensor(61, device=device)
    want = decode_attention_reference(q, k, v, ln)
    assert_close(split_kv_decode_attention(q, k, v, ln, block_n=16, num_splits=3), want, rtol=1e-5, atol=1e-5)
    tm = split_kv_decode_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), ln)
    assert_close(tm, want[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    got = split_kv_decode_attention(qb, kb, vb, ln, block_n=16)
    assert got.dtype == torch.bfloat16
    assert_close(got.float(), decode_attention_reference(qb, kb, vb, ln).float(), rtol=0, atol=3e-2)


HOST_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"}


class _LengthReads(TorchFunctionMode):
    """Records a host read (item, int, cpu, ...) of one tensor."""

    def __init__(self, watched):
        super().__init__()
        self.watched, self.reads = watched, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS and any(a is self.watched for a in args):
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def test_one_length_tensor_moved_in_place_replays_the_same_launch(device, monkeypatch):
    """What a CUDA graph needs: the launch (grid, buffers) does not depend on the length, which the
    kernels read on the device; so moving the captured length tensor in place moves the attention."""
    kernels = importlib.import_module("mtpc.backbones.decode_attention_triton")
    launches = []
    real = kernels.launch

    def recording(q, k, v, length, out, mid_o, mid_m, mid_l, scale, plan):
        launches.append((tuple(q.shape), tuple(k.shape), tuple(mid_o.shape), plan))
        return real(q, k, v, length, out, mid_o, mid_m, mid_l, scale, plan)

    monkeypatch.setattr(kernels, "launch", recording)
    q, k, v = _inputs(100, 4, 4, 100, device=device)
    length = torch.tensor([30], device=device)
    outs = []
    with _LengthReads(length) as mode:
        for n in (30, 83):
            length.fill_(n)  # the captured buffer moved in place, as a graph's input copy does
            outs.append((split_kv_decode_attention(q, k, v, length, block_n=16), n))
    assert mode.reads == [], f"host reads of the length: {mode.reads}"
    assert len(launches) == 2 and launches[0] == launches[1]
    for got, n in outs:
        assert_close(
            got, decode_attention_reference(q, k, v, torch.tensor([n], device=device)), rtol=1e-5, atol=1e-5
        )
    assert (outs[0][0] - outs[1][0]).abs().max() > 1e-2  # not vacuous: the two lengths differ in the output


def test_engine_with_split_kv_equals_its_default_attention(device, monkeypatch):
    """The compact engine's static calls (prefill <= 64, steps, verifies, crops; the draft top's two
    rows) on the split-KV kernel give the default (masked SDPA) engine's logits and draft hidden."""
    from mtpc.backbones import llama

    calls = []
    real = llama.split_kv_decode_attention
    monkeypatch.setattr(
        llama, "split_kv_decode_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    bb = tiny_backbone(lora_depth=1, dtype=torch.float32).to(device)
    randomize_lora(bb)
    base = LlamaEngine(bb, capacity=40, static=True)
    split = LlamaEngine(bb, capacity=40, static=True, attention="split_kv")
    assert split.attention == "split_kv"
    g = torch.Generator().manual_seed(3)
    script = [("feed", 10), ("feed", 1), ("feed", 4), ("crop", 12), ("feed", 1), ("feed", 4), ("feed", 1)]
    for op, n in script:
        if op == "crop":
            base.crop(n)
            split.crop(n)
            continue
        ids = torch.randint(0, 16, (n,), generator=g).to(device)
        a, b = base.feed(ids), split.feed(ids)
        # float32 through 4 layers: two attentions' roundings apart (the repo's float32 bound, 1e-4)
        assert_close(b.p_logits, a.p_logits, rtol=1e-4, atol=1e-4)
        assert_close(b.draft_hidden, a.draft_hidden, rtol=1e-4, atol=1e-4)
    assert split.length == base.length == 18
    assert len(calls) == 6 * bb.model.config.num_hidden_layers  # every layer of every feed took the kernel
