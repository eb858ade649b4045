"""Cross-check cp, hmm and btree against the same circuits built with cirkit (PyPI `libcirkit`, test oracle only).

cirkit's own templates build the structures with their default `probs` parameterisation (softmax
over a real tensor, for categorical inputs and sum weights alike); one context's parameters are
copied in (as constant initialisers of those real tensors, so softmax gives back our
probabilities); log-likelihoods and all prefix marginals (cirkit's IntegrateQuery) must agree to
1e-10 in float64, and cirkit must report every structure smooth and decomposable.

  hmm   -> cirkit.templates.pgms.hmm(ordering = 0..n-1): its sum layer over variables {i..n-1}
           has weights transitions[i-1] (rows = previous state), the outermost one `initial`.
  btree -> a RegionGraph built here with the same balanced split (left = first floor(L/2)) and
           rg.build_circuit(sum_product="cp-t"): a region's sum layer mixes the Hadamard product of
           its children; its weights are internal[k] (rows = parent state), the root's is `root`.
  cp    -> a RegionGraph whose root region is partitioned once into n singletons, "cp-t".

Exception, stated precisely: for n = 1 a region graph cannot hold a latent above a single
variable (a one-variable region is an input region, and a partition must split its scope into
disjoint non-empty parts), so cp and btree with n = 1 (which are the same circuit, a mixture of
r categoricals) are checked against cirkit's hmm template with n = 1, which is exactly that
mixture (one sum layer over one categorical layer).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from mtpc.circuits import build_circuit
from tests.circuit_helpers import all_windows

cirkit = pytest.importorskip("cirkit")  # dev extra; `make setup` installs it

from cirkit.backend.torch.queries import IntegrateQuery  # noqa: E402
from cirkit.pipeline import PipelineContext  # noqa: E402
from cirkit.symbolic.initializers import ConstantTensorInitializer  # noqa: E402
from cirkit.symbolic.layers import CategoricalLayer, SumLayer  # noqa: E402
from cirkit.symbolic.parameters import TensorParameter  # noqa: E402
from cirkit.templates import pgms  # noqa: E402
from cirkit.templates.region_graph import PartitionNode, RegionGraph, RegionNode  # noqa: E402
from cirkit.templates.utils import Parameterization, parameterization_to_factory  # noqa: E402
from cirkit.utils.scope import Scope  # noqa: E402

DEFAULT_SOFTMAX = Parameterization(activation="softmax", initialization="normal")


def _region_graph(splits: list[tuple[int, int, list[tuple[int, int]]]]) -> RegionGraph:
    """Region graph from (start, stop, child spans) splits; spans are 0-based half-open."""
    regions: dict[tuple[int, int], RegionNode] = {}

    def region(s, e):
        if (s, e) not in regions:
            regions[(s, e)] = RegionNode(Scope(range(s, e)))
        return regions[(s, e)]

    nodes, in_nodes = [], {}
    for s, e, kids in splits:
        ptn = PartitionNode(Scope(range(s, e)))
        in_nodes[region(s, e)] = [ptn]
        in_nodes[ptn] = [region(a, b) for a, b in kids]
        nodes.append(ptn)
    root = regions[(splits[0][0], splits[0][1])]
    return RegionGraph(list(regions.values()) + nodes, in_nodes, [root])


def _btree_splits(n: int):
    out, stack = [], [(0, n)]
    while stack:
        s, e = stack.pop(0)
        if e - s < 2:
            continue
        mid = s + (e - s) // 2
        out.append((s, e, [(s, mid), (mid, e)]))
        stack += [(s, mid), (mid, e)]
    return out


def _symbolic(kind: str, n: int, r: int, v: int):
    if n == 1 or kind == "hmm":
        return pgms.hmm(list(range(n)), num_latent_states=r, input_layer_kwargs={"num_categories": v})
    splits = _btree_splits(n) if kind == "btree" else [(0, n, [(i, i + 1) for i in range(n)])]
    return _region_graph(splits).build_circuit(
        input_factory=functools.partial(CategoricalLayer, num_categories=v),
        sum_product="cp-t",
        sum_weight_factory=parameterization_to_factory(DEFAULT_SOFTMAX),
        num_input_units=r,
        num_sum_units=r,
        num_classes=1,
    )


def _our_table(kind: str, circuit, p: dict[str, torch.Tensor], scope: tuple[int, ...]) -> torch.Tensor:
    """Our normalised log-weights of the cirkit sum layer over variables `scope` (rows = outputs)."""
    n = circuit.window
    if kind == "hmm" or n == 1:
        name = "initial" if kind == "hmm" else ("mixture" if kind == "cp" else "root")
        return p[name][None] if scope[0] == 0 else p["transitions"][scope[0] - 1]
    if kind == "cp":
        return p["mixture"][None]
    span = (scope[0], scope[-1] + 1)
    node = next(nd for nd in circuit.nodes() if (nd.start, nd.stop) == span)
    return p["root"][None] if node.node == 0 else p["internal"][node.internal_index]


def _copy_params(sc, kind, circuit, p):
    for layer in sc.layers:
        scope = tuple(sorted(sc.layer_scope(layer)))
        if isinstance(layer, CategoricalLayer):
            value, param = p["leaves"][scope[0]], layer.probs  # (r, v)
        elif isinstance(layer, SumLayer):
            value, param = _our_table(kind, circuit, p, scope), layer.weight  # (out, in)
        else:
            continue
        (tensor,) = [nd for nd in param.nodes if isinstance(nd, TensorParameter)]
        assert tensor.shape == tuple(value.shape), (kind, scope, tensor.shape, value.shape)
        # softmax (cirkit's default activation) of normalised log-probabilities gives back the probabilities
        tensor.initializer = ConstantTensorInitializer(value.numpy().astype(np.float64))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("kind", ["cp", "hmm", "btree"])
def test_matches_cirkit(kind, n):
    r, v = 3, 3
    c = build_circuit(kind, window=n, rank=r, vocab=v)
    p = c.random_params((), generator=torch.Generator().manual_seed(7 + n), dtype=torch.float64, scale=1.5)
    sc = _symbolic(kind, n, r, v)
    assert sc.is_smooth and sc.is_decomposable
    _copy_params(sc, kind, c, p)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # cirkit allocates its parameters in the default dtype
    try:
        with PipelineContext(backend="torch", semiring="lse-sum", fold=False, optimize=False) as ctx:
            cc = ctx.compile(sc)
    finally:
        torch.set_default_dtype(before)
    assert cc.properties.smooth and cc.properties.decomposable
    xs = all_windows(n, v)  # (V, n)
    with torch.no_grad():
        theirs = cc(xs)[:, 0, 0]  # (V,)
        ours = c.log_prob(p, xs)
        assert theirs.dtype == torch.float64
        torch.testing.assert_close(ours, theirs, atol=1e-10, rtol=0)
        integrate = IntegrateQuery(cc)
        pm = c.prefix_log_marginals(p, xs)  # (V, n)
        for i in range(1, n + 1):
            mask = torch.zeros(1, n, dtype=torch.bool)
            mask[:, i:] = True  # integrate out x_{i+1}..x_n
            torch.testing.assert_close(
                pm[:, i - 1], integrate(xs, integrate_vars=mask)[:, 0, 0], atol=1e-10, rtol=0
            )
