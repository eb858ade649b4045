"""btree: latent variables at the internal nodes of a balanced binary tree over the window.

Structure (DESIGN section 1): the root covers x_1..x_n; a node covering L >= 2 positions splits into
a left child covering the first floor(L/2) and a right child covering the rest; a span of one
position is a leaf. Every internal node holds an r-state latent: the root has a prior `root` (r,),
every other internal node a table `internal[k]` (r, r) with [k, a, b] = log q(child = b | parent = a);
leaf i is a categorical `leaves[i]` (r, v) indexed by the state of the node above it. n = 1 (the root
has the single leaf as child) and n = 2 are exactly cp. Non-root internal nodes are numbered
breadth-first, left to right: `internal[k]` belongs to node k + 1 of `nodes()` (node 0 = root).

Queries take O(depth) sequential steps, each batched over a whole tree level:
  upward pass (by height): message of a node to its parent, m(a) = logsumexp_b T[a, b] + U(b), where
    U(b) sums the messages of its children (leaf messages are leaf scores, or 0 when marginalised);
  downward pass (by depth): A(b) = log q(node = b, x before the node's span), which gives, for every
    leaf, w_i(a) = log q(parent state a, x_<i) -> all prefix marginals and conditionals at once;
  sampling given a prefix: upward pass with the prefix as evidence, then top-down sampling of every
    node from q(node | parent, evidence below) and of the free leaves (exact);
  greedy: the same with max instead of logsumexp (max-product), then top-down argmax.
Leaves out: everything shared (base.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import Circuit, Params, gather_leaf_scores, gather_rows, log_matvec, log_vecmat, with_prefix


@dataclass(frozen=True)
class BtreeNode:
    """One internal node. Spans are 0-based half-open: the node covers x_{start+1} .. x_{stop}."""

    node: int  # breadth-first id, root = 0
    internal_index: int  # row of params["internal"] (= node - 1); -1 for the root
    start: int
    stop: int
    depth: int  # root = 0
    parent: int  # node id of the parent; -1 for the root
    left: tuple[str, int]  # ("node", id) or ("leaf", position)
    right: tuple[str, int] | None  # None only for the root of n = 1


def btree_nodes(n: int) -> list[BtreeNode]:
    """The internal nodes of the n-leaf balanced tree in breadth-first, left-to-right order."""
    out: list[BtreeNode] = []
    queue = [(0, n, 0, -1)]  # (start, stop, depth, parent)
    while queue:
        start, stop, depth, parent = queue.pop(0)
        node = len(out)
        if stop - start == 1:  # only the root of n = 1
            out.append(BtreeNode(node, node - 1, start, stop, depth, parent, ("leaf", start), None))
            continue
        mid = start + (stop - start) // 2
        kids = []
        for s, e in ((start, mid), (mid, stop)):
            if e - s == 1:
                kids.append(("leaf", s))
            else:
                kids.append(("node", node + len(queue) + 1))
                queue.append((s, e, depth + 1, node))
        out.append(BtreeNode(node, node - 1, start, stop, depth, parent, kids[0], kids[1]))
    return out


class _Schedule:
    """Index tensors for the level-by-level passes (built once per device)."""

    def __init__(self, nodes: list[BtreeNode], n: int, device: torch.device) -> None:
        m = len(nodes) - 1  # non-root internal nodes
        height = [0] * len(nodes)
        for nd in reversed(nodes):  # children come after parents in BFS order
            height[nd.node] = 1 + max((height[c[1]] for c in (nd.left, nd.right) if c and c[0] == "node"), default=0)
        up_order = sorted(range(1, len(nodes)), key=lambda k: (height[k], k))
        # message buffer: 0 = zero message, 1..n = leaves, then non-root nodes in up_order
        buf_index = {("leaf", i): 1 + i for i in range(n)}
        buf_index.update({("node", k): 1 + n + j for j, k in enumerate(up_order)})

        def kid(c):
            return 0 if c is None else buf_index[c]

        def t(xs):
            return torch.tensor(xs, dtype=torch.long, device=device)

        self.up_levels = []  # (a, b, child buffer indices (2 (b - a),)) over up_order positions a..b
        a = 0
        while a < m:
            b = a
            while b < m and height[up_order[b]] == height[up_order[a]]:
                b += 1
            self.up_levels.append((a, b, t([kid(c) for k in up_order[a:b] for c in (nodes[k].left, nodes[k].right)])))
            a = b
        self.perm_height = t([k - 1 for k in up_order])  # internal rows in up_order
        self.inv_height = t([up_order.index(k) for k in range(1, len(nodes))])  # BFS row -> up_order position
        self.root_children = t([kid(nodes[0].left), kid(nodes[0].right)])
        # downward levels by depth: BFS ids lo..hi-1 = internal rows lo-1..hi-2
        self.down_levels = []  # (row lo, row hi, parent ids, left-sibling buffer indices)
        depth_max = max(nd.depth for nd in nodes)
        for d in range(1, depth_max + 1):
            ids = [nd.node for nd in nodes if nd.depth == d]
            sibs = []
            for k in ids:
                par = nodes[nodes[k].parent]
                sibs.append(kid(par.left) if par.right == ("node", k) else 0)
            self.down_levels.append((ids[0] - 1, ids[-1], t([nodes[k].parent for k in ids]), t(sibs)))
        leaf_parent, leaf_sib = [0] * n, [0] * n
        for nd in nodes:
            for c in (nd.left, nd.right):
                if c is not None and c[0] == "leaf":
                    leaf_parent[c[1]] = nd.node
                    leaf_sib[c[1]] = kid(nd.left) if c == nd.right else 0
        self.leaf_parent, self.leaf_sib = t(leaf_parent), t(leaf_sib)


class BTreeCircuit(Circuit):
    kind = "btree"

    def __init__(self, window: int, rank: int, vocab: int) -> None:
        super().__init__(window, rank, vocab)
        self._nodes = btree_nodes(window)
        self._schedules: dict[torch.device, _Schedule] = {}

    @property
    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        n, r, v = self.window, self.rank, self.vocab
        return {"root": (r,), "internal": (len(self._nodes) - 1, r, r), "leaves": (n, r, v)}

    def nodes(self) -> list[BtreeNode]:
        """Internal nodes, breadth-first: node k + 1 owns params["internal"][k]; node 0 is the root."""
        return list(self._nodes)

    def leaf_parents(self) -> list[int]:
        """Node id above each position 0..n-1 (the state that indexes leaves[i])."""
        out = [0] * self.window
        for nd in self._nodes:
            for c in (nd.left, nd.right):
                if c is not None and c[0] == "leaf":
                    out[c[1]] = nd.node
        return out

    def _sched(self, device: torch.device) -> _Schedule:
        s = self._schedules.get(device)
        if s is None:
            s = self._schedules[device] = _Schedule(self._nodes, self.window, device)
        return s

    def _parts(self, q: Params, ids: Tensor | None):
        batch = self._batch_shape(q, *(() if ids is None else (ids.shape[:-1],)))
        e = self._expand(q, batch)
        leaves = e["leaves"]
        if ids is None:
            scores = leaves.new_zeros(*batch, 0, self.rank)
        else:
            ids = ids.expand(*batch, ids.shape[-1])
            scores = gather_leaf_scores(leaves[..., : ids.shape[-1], :, :], ids)  # (..., k, r)
        return e["root"], e["internal"], leaves, ids, scores

    def _upward(self, s: _Schedule, table: Tensor, leaf_msg: Tensor, use_max: bool):
        """table: internal rows in up_order (probs for sum, logs for max); leaf_msg (..., n, r).

        -> message buffer (..., 1 + n + m, r), U of the non-root nodes in up_order (..., m, r), U of the root.
        """
        buf = torch.cat([leaf_msg.new_zeros(*leaf_msg.shape[:-2], 1, self.rank), leaf_msg], dim=-2)
        us = []
        for a, b, kids in s.up_levels:
            u = buf.index_select(-2, kids).unflatten(-2, (b - a, 2)).sum(-2)  # (..., S, r)
            tl = table[..., a:b, :, :]  # (..., S, r, r)
            msg = (tl + u.unsqueeze(-2)).amax(-1) if use_max else log_matvec(tl, u)
            us.append(u)
            buf = torch.cat([buf, msg], dim=-2)
        u_root = buf.index_select(-2, s.root_children).sum(-2)  # (..., r)
        u_all = torch.cat(us, dim=-2) if us else leaf_msg.new_zeros(*leaf_msg.shape[:-2], 0, self.rank)
        return buf, u_all, u_root

    def _log_prob(self, q: Params, x: Tensor) -> Tensor:
        root, internal, _, _, scores = self._parts(q, x)
        s = self._sched(x.device)
        _, _, u_root = self._upward(s, internal.index_select(-3, s.perm_height).exp(), scores, False)
        return torch.logsumexp(root + u_root, dim=-1)

    def _leaf_context(self, q: Params, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        root, internal, leaves, x, scores = self._parts(q, x)
        s = self._sched(x.device)
        probs = internal.exp()  # (..., m, r, r) breadth-first
        buf, _, _ = self._upward(s, probs.index_select(-3, s.perm_height), scores, False)
        a = root.unsqueeze(-2)  # (..., 1, r)  A(root) = log prior; A buffer indexed by node id
        for lo, hi, parents, sibs in s.down_levels:
            v = a.index_select(-2, parents) + buf.index_select(-2, sibs)  # (..., S, r) parent state & x left of it
            a = torch.cat([a, log_vecmat(v, probs[..., lo:hi, :, :])], dim=-2)
        w = a.index_select(-2, s.leaf_parent) + buf.index_select(-2, s.leaf_sib)  # (..., n, r)
        return w, leaves, x

    def _topdown(self, s, root, internal, u_all, u_root, leaves, noise):
        """Choose every node state given its parent (argmax of logits + Gumbel noise; noise None =
        greedy), then every leaf token. u_* are the upward U's (evidence below each node)."""

        def pick(logits: Tensor, g: Tensor | None) -> Tensor:
            return (logits if g is None else logits + g).argmax(-1)

        u_bfs = u_all.index_select(-2, s.inv_height)  # (..., m, r) breadth-first
        z = pick(root + u_root, None if noise is None else noise["root"]).unsqueeze(-1)  # (..., 1) by node id
        for lo, hi, parents, _ in s.down_levels:
            rows = gather_rows(internal[..., lo:hi, :, :], z.index_select(-1, parents))  # (..., S, r)
            g = None if noise is None else noise["internal"][..., lo:hi, :]
            z = torch.cat([z, pick(rows + u_bfs[..., lo:hi, :], g)], dim=-1)
        rows = gather_rows(leaves, z.index_select(-1, s.leaf_parent))  # (..., n, v)
        return pick(rows, None if noise is None else noise["leaves"])  # (..., n)

    def _sample(self, q: Params, generator: torch.Generator | None = None, prefix: Tensor | None = None) -> Tensor:
        root, internal, leaves, prefix, scores = self._parts(q, prefix)
        s = self._sched(root.device)
        k = scores.shape[-2]
        evidence = torch.cat([scores, scores.new_zeros(*scores.shape[:-2], self.window - k, self.rank)], dim=-2)
        _, u_all, u_root = self._upward(s, internal.index_select(-3, s.perm_height).exp(), evidence, False)
        batch, m = root.shape[:-1], internal.shape[-3]
        r, n, v = self.rank, self.window, self.vocab
        u = torch.rand(*batch, r + m * r + n * v, generator=generator, dtype=root.dtype, device=root.device)
        g = -(-u.clamp_min(torch.finfo(root.dtype).tiny).log()).log()  # Gumbel noise for every choice
        noise = {"root": g[..., :r], "internal": g[..., r : r + m * r].unflatten(-1, (m, r)),
                 "leaves": g[..., r + m * r :].unflatten(-1, (n, v))}
        return with_prefix(prefix, self._topdown(s, root, internal, u_all, u_root, leaves, noise))

    def _greedy(self, q: Params, prefix: Tensor | None = None) -> Tensor:
        root, internal, leaves, prefix, scores = self._parts(q, prefix)
        s = self._sched(root.device)
        k = scores.shape[-2]
        evidence = torch.cat([scores, leaves[..., k:, :, :].amax(-1)], dim=-2)  # (..., n, r)
        _, u_all, u_root = self._upward(s, internal.index_select(-3, s.perm_height), evidence, True)
        return with_prefix(prefix, self._topdown(s, root, internal, u_all, u_root, leaves, None))
