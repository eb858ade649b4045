"""The btree circuit's native greedy draft (mtpc/csrc/btree_greedy.cpp via mtpc.kernels): the same
window as the torch max-product path for every tree shape, rank and prefix length, ties included
(parameters rounded before normalising, so many rows hold equal maxima), and where it steps aside."""

from __future__ import annotations

import pytest
import torch

from mtpc.circuits import build_circuit
from mtpc.kernels import btree_greedy_draft, native_draft_unsupported

WHY = native_draft_unsupported("cpu", torch.float32)
pytestmark = pytest.mark.skipif(WHY is not None, reason=str(WHY))


def _params(circuit, gen, ties: bool, dtype=torch.float32):
    raw = {k: torch.randn(sh, generator=gen, dtype=dtype) for k, sh in circuit.param_shapes.items()}
    if ties:  # integers: equal maxima in most rows, so the first-maximum rule is exercised
        raw = {k: v.round() for k, v in raw.items()}
    return circuit.normalize(raw)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 16])
@pytest.mark.parametrize("r", [1, 3, 16])
def test_native_greedy_window_equals_the_torch_path(n, r, monkeypatch):
    circuit = build_circuit("btree", n, r, 40)
    gen = torch.Generator().manual_seed(n * 100 + r)
    for trial in range(12):
        q = _params(circuit, gen, ties=trial % 2 == 1)
        for k in sorted({0, 1, min(2, n), n}):
            prefix = None if k == 0 else torch.randint(0, 40, (k,), generator=gen)
            native = circuit._native_greedy(q, prefix)
            assert native is not None  # the native path ran (not a silent fallback)
            monkeypatch.setenv("MTPC_NATIVE_DRAFT", "0")
            assert circuit._native_greedy(q, prefix) is None
            ref, conds = circuit._draft(q, prefix, greedy=True, conditionals=False)
            monkeypatch.delenv("MTPC_NATIVE_DRAFT")
            assert conds is None
            assert torch.equal(native, ref), (n, r, k, trial)
            got, _ = circuit._draft(q, prefix, greedy=True, conditionals=False)
            assert torch.equal(got, ref)


def test_the_torch_path_runs_where_the_kernel_does_not_apply():
    circuit = build_circuit("btree", 4, 3, 40)
    gen = torch.Generator().manual_seed(0)
    batch = {k: v.expand(2, *v.shape) for k, v in _params(circuit, gen, ties=False).items()}
    assert circuit._native_greedy(batch, None) is None  # a batch of contexts
    assert circuit._native_greedy(_params(circuit, gen, False, torch.float64), None) is None  # float64
    x, _ = circuit._draft(batch, None, greedy=True, conditionals=False)
    assert x.shape == (2, 4)


def test_kernel_refusals_name_what_was_wrong():
    circuit = build_circuit("btree", 4, 3, 40)
    q = _params(circuit, torch.Generator().manual_seed(1), ties=False)
    plan = circuit._sched(torch.device("cpu")).native_plan
    args = (q["root"], q["internal"], q["leaves"])
    with pytest.raises(RuntimeError, match="prefix id out of range"):
        btree_greedy_draft(*args, torch.tensor([40]), plan)
    with pytest.raises(RuntimeError, match="do not match the plan"):
        btree_greedy_draft(
            q["root"], q["internal"], q["leaves"][:3].contiguous(), torch.zeros(0, dtype=torch.long), plan
        )
    with pytest.raises(RuntimeError, match="float32"):
        btree_greedy_draft(*(t.double() for t in args), torch.zeros(0, dtype=torch.long), plan)
