"""Dense brute-force oracle for tests: the full joint over latents and tokens, from the parameters.

For tiny sizes only (r^#latents * v^n terms). It shares no code with the circuits: the latent
structure of every kind (including the btree node order) is rebuilt here from its definition, and
the parameters are normalised here (log_softmax over the last dim), so unnormalised logits work.

  dense_joint(kind, params)      -> (..., v, ..., v)  log q(x_1..x_n)            (n trailing axes)
  dense_max_joint(kind, params)  -> (..., v, ..., v)  log max_z q(x_1..x_n, z)   (max over latents)
  btree_structure(n)             -> (parents of internal nodes, parent of each leaf), BFS order

The oracle knows a kind by its line in `LATENT_STRUCTURES`: a prior parameter is (..., r), a table
(..., m, r, r) indexed [table, parent state, child state], the leaves (..., n, r, v).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping

import torch
from torch import Tensor


def btree_structure(n: int) -> tuple[list[int], list[int]]:
    """Internal nodes of the balanced tree over positions 0..n-1 in breadth-first, left-to-right order.

    Node 0 is the root (span [0, n)); a span of length L >= 2 splits into [s, s + L//2) and the rest;
    a span of length 1 is a leaf. For n = 1 the root's only child is leaf 0.
    Returns (node_parent, leaf_parent): node_parent[k] = parent node of node k (-1 for the root),
    leaf_parent[i] = node above leaf i.
    """
    node_parent = [-1]
    leaf_parent = [-1] * n
    queue = [(0, 0, n)]
    while queue:
        node, s, e = queue.pop(0)
        if e - s == 1:
            leaf_parent[s] = node
            continue
        mid = s + (e - s) // 2
        for cs, ce in ((s, mid), (mid, e)):
            if ce - cs == 1:
                leaf_parent[cs] = node
            else:
                node_parent.append(node)
                queue.append((len(node_parent) - 1, cs, ce))
    return node_parent, leaf_parent


Latents = tuple[list[tuple[str, int, int]], list[int]]


def _btree_latents(n: int) -> Latents:
    node_parent, leaf_parent = btree_structure(n)
    return [("root", -1, -1)] + [
        ("internal", k - 1, node_parent[k]) for k in range(1, len(node_parent))
    ], leaf_parent


#: each kind's latent structure for window n, rebuilt from its definition (docs/circuits.md):
#: ([(param name, table index or -1 for a prior vector, parent latent or -1)], the latent above each
#: leaf or -1). A new kind adds its line here ("Adding a circuit kind").
LATENT_STRUCTURES: dict[str, Callable[[int], Latents]] = {
    "ff": lambda n: ([], [-1] * n),
    "cp": lambda n: ([("mixture", -1, -1)], [0] * n),
    "hmm": lambda n: (
        [("initial", -1, -1)] + [("transitions", i - 1, i - 1) for i in range(1, n)],
        list(range(n)),
    ),
    "btree": _btree_latents,
}


def _latents(kind: str, n: int) -> Latents:
    if kind not in LATENT_STRUCTURES:
        raise ValueError(
            f"kind: no latent structure for circuit kind {kind!r}; expected one of {list(LATENT_STRUCTURES)}"
        )
    return LATENT_STRUCTURES[kind](n)


def _joints(kind: str, params: Mapping[str, Tensor]) -> Tensor:
    """(..., C, v, ..., v): log q(x, z) for every latent configuration z (C = r^#latents)."""
    p = {k: t.double().log_softmax(-1) for k, t in params.items()}
    leaves = p["leaves"]  # (..., n, r, v)
    n, r, v = leaves.shape[-3:]
    latents, leaf_parent = _latents(kind, n)
    priors = {name for name, table, _ in latents if table < 0}  # (..., r); leaves and tables (..., m, r, r|v)
    batch = torch.broadcast_shapes(*(t.shape[: t.dim() - (1 if k in priors else 3)] for k, t in p.items()))
    out = []
    for z in itertools.product(range(r), repeat=len(latents)):
        logw = torch.zeros(batch, dtype=torch.float64)
        for j, (name, table, parent) in enumerate(latents):
            if table < 0:
                logw = logw + p[name][..., z[j]]
            else:
                logw = logw + p[name][..., table, z[parent], z[j]]
        grid = logw.reshape(*batch, *([1] * n))
        for i in range(n):
            state = 0 if leaf_parent[i] < 0 else z[leaf_parent[i]]
            row = leaves[..., i, state, :]  # (..., v)
            shape = [1] * n
            shape[i] = v
            grid = grid + row.reshape(*row.shape[:-1], *shape)
        out.append(grid.expand(*batch, *([v] * n)))
    return torch.stack(out, dim=len(batch))


def dense_joint(kind: str, params: Mapping[str, Tensor]) -> Tensor:
    """log q(x) for all v^n windows, float64 (..., v, ..., v)."""
    j = _joints(kind, params)
    n = params["leaves"].shape[-3]
    return torch.logsumexp(j, dim=j.dim() - n - 1)


def dense_max_joint(kind: str, params: Mapping[str, Tensor]) -> Tensor:
    """log max_z q(x, z) for all v^n windows, float64 (..., v, ..., v)."""
    j = _joints(kind, params)
    n = params["leaves"].shape[-3]
    return j.amax(dim=j.dim() - n - 1)
