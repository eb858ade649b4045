"""Tests for the decoding path of mtpc/heads.py (`MtpcHead.decoder()`: `HeadDecoder.params`,
`HeadDecoder.draft`) with the circuits' fused `_draft`: in float64, equal to 1e-10 to the training
path `circuit.normalize(head(e))` followed by the unfused queries (`_sample` / `_greedy` with a
generator of the same seed, then the log-space `_conditionals`), for every kind, both leaf forms
(full W and App. G), greedy and sampled, prefixes None / length 1 / length n-1, perfect and
unbalanced btrees, with and without the conditionals; `decoder()` follows in-place updates of the
weights; the path reads nothing back to the host."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from mtpc.heads import HeadConfig, MtpcHead
from mtpc.kernels import rowdot_unsupported
from mtpc.names import CIRCUIT_KINDS

V, D = 7, 6
HOST_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"}


def make_head(kind, n, r=3, delta=0, dtype=torch.float64, seed=0):
    head = MtpcHead(HeadConfig(kind, n, 1 if kind == "ff" else r, V, D, leaf_delta_rank=delta)).to(dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():  # random sum weights too (reset_parameters zeroes them)
            p.copy_(torch.randn(p.shape, generator=g, dtype=dtype))
    return head


def old_params(head, e):
    return head.circuit.normalize(head(e))


@pytest.mark.parametrize("kind", CIRCUIT_KINDS)
@pytest.mark.parametrize("delta", [0, 2])
@pytest.mark.parametrize("n", [1, 3, 8])
def test_decode_params_equal_normalized_forward(kind, delta, n):
    head = make_head(kind, n, delta=delta)
    for _ in range(3):
        e = torch.randn(D, dtype=torch.float64)
        want, got = old_params(head, e), head.decoder().params(e)
        assert list(got) == list(want)
        for name in want:
            assert got[name].shape == want[name].shape and got[name].dtype == torch.float64
            torch.testing.assert_close(got[name], want[name], atol=1e-10, rtol=0)


@pytest.mark.parametrize("kind", CIRCUIT_KINDS)
@pytest.mark.parametrize("dtype, expect", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)])
def test_decode_params_dtype_rule(kind, dtype, expect):
    """As `normalize`: float32 out of a float32 or bf16 head (logits in the head's dtype)."""
    head = make_head(kind, 4, delta=2, dtype=dtype)
    e = torch.randn(D)
    want, got = old_params(head, e), head.decoder().params(e)
    for name in want:
        assert got[name].dtype == expect
        torch.testing.assert_close(
            got[name], want[name], atol=0.1 if dtype == torch.bfloat16 else 1e-5, rtol=0
        )


@pytest.mark.parametrize("kind", CIRCUIT_KINDS)
@pytest.mark.parametrize("delta", [0, 2])
@pytest.mark.parametrize("greedy", [False, True], ids=["sample", "greedy"])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_draft_equals_unfused_old_path(kind, delta, greedy, n):
    head = make_head(kind, n, delta=delta, seed=n)
    c, dec = head.circuit, head.decoder()
    for trial in range(4):
        e = torch.randn(D, dtype=torch.float64)
        q = old_params(head, e)
        for k in sorted({0, 1, n - 1}):
            prefix = None if k == 0 else torch.randint(0, V, (k,))
            x, cond = dec.draft(e, prefix, generator=torch.Generator().manual_seed(trial), greedy=greedy)
            g = torch.Generator().manual_seed(trial)
            want = c._greedy(q, prefix) if greedy else c._sample(q, g, prefix)
            assert x.shape == (n,) and x.dtype == torch.long and cond.shape == (n, V)
            assert torch.equal(x, want), (k, x, want)
            torch.testing.assert_close(cond, c._conditionals(q, want), atol=1e-10, rtol=0)
            x_only, none = dec.draft(
                e, prefix, torch.Generator().manual_seed(trial), greedy, conditionals=False
            )
            assert none is None and torch.equal(x_only, x)
            # what the loop called before: the fused draft on the training path's parameters
            x_old, cond_old = c._draft(
                q, prefix, generator=torch.Generator().manual_seed(trial), greedy=greedy
            )
            assert torch.equal(x_old, x)
            torch.testing.assert_close(cond_old, cond, atol=1e-10, rtol=0)


def test_draft_old_path_test_can_fail():
    """The comparison above sees a changed draft: another seed gives another window."""
    head = make_head("btree", 8, delta=2)
    e = torch.randn(D, dtype=torch.float64)
    prefix = torch.tensor([1])
    xs = {
        tuple(head.decoder().draft(e, prefix, torch.Generator().manual_seed(s))[0].tolist()) for s in range(5)
    }
    assert len(xs) > 1


@pytest.mark.parametrize("delta", [0, 2])
def test_decode_weights_follow_updates(delta):
    head = make_head("hmm", 4, delta=delta)
    e = torch.randn(D, dtype=torch.float64)

    def check():
        got, want = head.decoder().params(e), old_params(head, e)
        for name in want:
            torch.testing.assert_close(got[name], want[name], atol=1e-10, rtol=0)
        return got["leaves"].clone()

    before = check()
    assert head.decoder() is head.decoder()  # built once while the weights stay
    opt = torch.optim.SGD(head.parameters(), lr=0.5)  # an optimiser step (in place)
    sum(
        t[..., 0].sum() for t in head(e).values()
    ).backward()  # (a uniform shift of each row would normalise away)
    opt.step()
    after_step = check()
    assert not torch.allclose(before, after_step)
    other = make_head("hmm", 4, delta=delta, seed=9)
    head.load_state_dict(other.state_dict())  # load_state_dict copies in place
    after_load = check()
    assert not torch.allclose(after_step, after_load)
    with torch.no_grad():
        head.sum_weight["transitions"].mul_(3.0)  # an in-place edit of one tensor
    check()
    head.float()  # new storage
    got = head.decoder().params(e.float())
    assert got["leaves"].dtype == torch.float32
    torch.testing.assert_close(got["leaves"], old_params(head, e.float())["leaves"], atol=1e-5, rtol=0)


def test_decoder_needs_one_context():
    head = make_head("cp", 3)
    with pytest.raises(ValueError, match=r"e: the decoder takes one context of shape \(6,\)"):
        head.decoder().params(torch.randn(2, D, dtype=torch.float64))


class _HostReads(TorchFunctionMode):
    """Counts the tensor calls that read a value back to the host (a sync on a GPU)."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", CIRCUIT_KINDS)
@pytest.mark.parametrize("greedy", [False, True], ids=["sample", "greedy"])
def test_draft_reads_nothing_back(kind, greedy):
    head = make_head(kind, 8, delta=2, dtype=torch.float32)
    e, prefix, g = torch.randn(D), torch.tensor([3]), torch.Generator().manual_seed(0)
    dec = head.decoder()
    with torch.inference_mode(), _HostReads() as mode:
        for p in (prefix, None):
            for conditionals in (True, False):
                dec.draft(e, p, g, greedy, conditionals)
    assert mode.calls == []
    with _HostReads() as probe:  # the counter sees a read
        prefix.tolist()
    assert probe.calls == ["tolist"]


@pytest.mark.parametrize("kind", CIRCUIT_KINDS)
@pytest.mark.parametrize("delta", [0, 2])
def test_cpu_float32_products(kind, delta):
    """On the CPU in float32 the decoder multiplies by the row-dot kernel where it runs (the
    automatic choice), else by oneDNN (asked for with onednn=True; never in float64): each
    decoder's parameters equal the training path's and the addmm decoder's to float32 rounding,
    and a sum bias a product left out would show up as O(1)."""
    head = make_head(kind, 8, delta=delta, dtype=torch.float32)
    e = torch.randn(D)
    auto, dnn, mkl = head.decoder(), head.decoder(onednn=True), head.decoder(onednn=False)
    assert (
        make_head(kind, 3).decoder().onednn is False and not make_head(kind, 3).decoder().rowdot
    )  # float64: addmm
    rowdot = rowdot_unsupported("cpu", torch.float32) is None
    assert auto.rowdot is rowdot and auto.onednn is not rowdot
    assert dnn.onednn and not dnn.rowdot and not (mkl.onednn or mkl.rowdot)
    with torch.inference_mode():
        want = old_params(head, e)
        for dec in (auto, dnn, mkl):
            got = dec.params(e)
            for name in want:
                torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=0)
    if head.sum_names:  # not vacuous: the sums carry biases that move the result
        assert any(float(head.sum_bias[n].detach().abs().max()) > 0.1 for n in head.sum_names)


@pytest.mark.skipif(rowdot_unsupported("cpu", torch.float32) is not None, reason="no row-dot kernel here")
@pytest.mark.parametrize("kind", CIRCUIT_KINDS)
@pytest.mark.parametrize("delta", [0, 2])
@pytest.mark.parametrize("known", [False, True])
def test_rowdot_params_in_one_call_have_the_separate_calls_bits(kind, delta, known):
    """The row-dot decoder's one native call (mtpc.kernels.head_params) against the same pass as
    separate calls (known row added, rowdot_linear, rowdot_batched for App. G, log_softmax): the
    same bits."""
    from mtpc.kernels import rowdot_batched, rowdot_linear

    cfg = HeadConfig(kind, 4, 1 if kind == "ff" else 3, V, D, leaf_delta_rank=delta, known_byte=known)
    head = MtpcHead(cfg)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    dec = head.decoder()
    assert dec.rowdot
    with torch.inference_mode():
        for c in range(3):
            e, cc = torch.randn(D, generator=g), torch.tensor([c + 2])
            got = dec.params(e, cc)
            u = e + dec.known[c + 2] if known else e
            y = rowdot_linear(u.unsqueeze(0), dec.weight, dec.bias_vec).view(-1)
            if dec.delta_out is None:
                leaves, rest = y.split(dec.split)
            else:
                base, h, rest = y.split(dec.split)
                leaves = rowdot_batched(h.view(dec.h_shape[0], -1), dec.delta_out, base.view(4, -1))
            assert torch.equal(got["leaves"], leaves.view(dec.leaf_shape).log_softmax(-1))
            sums = rest.view(-1, dec.rank).log_softmax(-1).view(-1).split(dec.sum_split)
            for name, want in zip(dec.sum_names, sums, strict=True):
                assert torch.equal(got[name], want.view(dec.sum_shapes[dec.sum_names.index(name)]))
            assert list(got) == ["leaves", *dec.sum_names]


def test_onednn_refused_where_it_cannot_run():
    with pytest.raises(
        ValueError, match=r"head decoder: weights='onednn' needs float32 or bfloat16.*float64"
    ):
        make_head("cp", 3).decoder(onednn=True)


def test_automatic_onednn_falls_back_to_addmm_when_oneDNN_cannot_reorder(monkeypatch):
    import mtpc.heads as heads

    def broken(weight):
        raise RuntimeError("could not create a primitive")

    monkeypatch.setattr(heads, "onednn_pack", broken)
    monkeypatch.setattr(heads, "rowdot_unsupported", lambda device, dtype: "no row-dot kernel here")
    head = make_head("cp", 4, dtype=torch.float32)
    e = torch.randn(D)
    with pytest.warns(RuntimeWarning, match="oneDNN could not reorder the weights"):
        dec = heads.HeadDecoder(head)
    assert dec.onednn is False
    torch.testing.assert_close(dec.params(e)["leaves"], old_params(head, e)["leaves"], atol=1e-5, rtol=0)
    with pytest.raises(RuntimeError, match="could not create a primitive"):
        heads.HeadDecoder(head, onednn=True)
