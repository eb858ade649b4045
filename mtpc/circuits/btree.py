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

from .base import (
    Circuit,
    Params,
    gather_leaf_scores,
    gather_rows,
    log_vecmat,
    mix_leaves_fast,
    sample_rows,
    with_prefix,
)


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
        # when the tree is perfect (n a power of 2) height order is reverse breadth-first order, level
        # by level: then the upward pass slices the breadth-first table and needs no permuted copy
        # Level tables are taken with torch.split (one concatenation in backward), not by slicing per
        # level (each slice's backward zero-fills a full-size gradient).
        self.up_sizes = [b - a for a, b, _ in self.up_levels]  # split sizes of the height-ordered table
        self.up_slices = None  # else: (split sizes of the breadth-first table, which chunk each level uses)
        if self.up_levels and all(
            sorted(up_order[a:b]) == list(range(up_order[a], up_order[a] + b - a)) for a, b, _ in self.up_levels
        ):
            starts = sorted(up_order[a] - 1 for a, _, _ in self.up_levels)
            sizes = [b - a for a, b in zip(starts, starts[1:] + [m], strict=True)]
            self.up_slices = (sizes, [starts.index(up_order[a] - 1) for a, _, _ in self.up_levels])
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
        self.down_sizes = [hi - lo for lo, hi, _, _ in self.down_levels]  # split sizes of the breadth-first table
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
        """-> root (..., r), internal (..., m, r, r), leaves (..., n, r, v), ids, scores (..., k, r)."""
        e, ids, scores = self._expand_with_scores(q, ids)
        return e["root"], e["internal"], e["leaves"], ids, scores

    def _upward(self, s: _Schedule, table: Tensor, leaf_msg: Tensor, use_max: bool, keep_u: bool = True):
        """Upward pass. table: internal tables breadth-first (probs for sum, logs for max) (..., m, r, r);
        leaf_msg (..., n, r) (leaf scores, or 0 / max-over-tokens for free leaves).

        -> message buffer (..., 1 + n + m, r), U of the non-root nodes in height order (..., m, r), U of the root.
        """
        if not s.up_levels:
            chunks = []
        elif s.up_slices is None:
            chunks = torch.split(table.index_select(-3, s.perm_height), s.up_sizes, dim=-3)  # height order
        else:
            parts = torch.split(table, s.up_slices[0], dim=-3)
            chunks = [parts[j] for j in s.up_slices[1]]
        buf = torch.cat([leaf_msg.new_zeros(*leaf_msg.shape[:-2], 1, self.rank), leaf_msg], dim=-2)
        us = []
        for tl, (a0, b0, kids) in zip(chunks, s.up_levels, strict=True):
            u = buf.index_select(-2, kids).unflatten(-2, (b0 - a0, 2)).sum(-2)  # (..., S, r)
            if not use_max:
                tl = tl.transpose(-1, -2)  # (..., S, r, r) [node state, parent state] for the row-vector matmul
            if use_max:  # max_b T[a, b] + U(b)
                msg = (tl + u.unsqueeze(-2)).amax(-1)
            else:  # logsumexp_b T[a, b] + U(b)
                msg = log_vecmat(u, tl)
            if keep_u:
                us.append(u)
            buf = torch.cat([buf, msg], dim=-2)
        u_root = buf.index_select(-2, s.root_children).sum(-2)  # (..., r)
        if not keep_u:
            return buf, None, u_root
        u_all = torch.cat(us, dim=-2) if us else leaf_msg.new_zeros(*leaf_msg.shape[:-2], 0, self.rank)
        return buf, u_all, u_root

    def _log_prob(self, q: Params, x: Tensor) -> Tensor:
        root, internal, _, _, scores = self._parts(q, x)
        s = self._sched(x.device)
        _, _, u_root = self._upward(s, internal.exp(), scores, False, keep_u=False)
        return torch.logsumexp(root + u_root, dim=-1)

    def _context(self, s: _Schedule, root: Tensor, probs: Tensor, scores: Tensor) -> Tensor:
        """w (..., n, r): log q(state a of the node above leaf i, x_<i), from full leaf scores (..., n, r)."""
        buf, _, _ = self._upward(s, probs, scores, False, keep_u=False)
        a = root.unsqueeze(-2)  # (..., 1, r)  A(root) = log prior; A buffer indexed by node id
        chunks = torch.split(probs, s.down_sizes, dim=-3) if s.down_sizes else []
        for tl, (_, _, parents, sibs) in zip(chunks, s.down_levels, strict=True):
            v = a.index_select(-2, parents) + buf.index_select(-2, sibs)  # (..., S, r) parent state & x left of it
            a = torch.cat([a, log_vecmat(v, tl)], dim=-2)
        return a.index_select(-2, s.leaf_parent) + buf.index_select(-2, s.leaf_sib)  # (..., n, r)

    def _leaf_context(self, q: Params, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        root, internal, leaves, x, scores = self._parts(q, x)
        return self._context(self._sched(x.device), root, internal.exp(), scores), leaves, scores

    def _topdown(self, s, root, internal, u_all, u_root, leaves, generator, greedy: bool) -> Tensor:
        """Choose every node state given its parent from q(node | parent, evidence below) (Gumbel-max,
        or argmax when greedy), then every leaf token -> (..., n). u_* are the upward U's."""
        if greedy:
            noise = None
        else:
            r, m = self.rank, internal.shape[-3]
            u = torch.rand(*root.shape[:-1], (m + 1) * r, generator=generator, dtype=root.dtype, device=root.device)
            noise = (-(-u.clamp_min(torch.finfo(root.dtype).tiny).log()).log()).unflatten(-1, (m + 1, r))  # Gumbel
        u_bfs = u_all.index_select(-2, s.inv_height)  # (..., m, r) breadth-first
        logits = root + u_root
        z = (logits if noise is None else logits + noise[..., 0, :]).argmax(-1, keepdim=True)  # (..., 1) by node id
        chunks = torch.split(internal, s.down_sizes, dim=-3) if s.down_sizes else []
        for tl, (lo, hi, parents, _) in zip(chunks, s.down_levels, strict=True):
            logits = gather_rows(tl, z.index_select(-1, parents)) + u_bfs[..., lo:hi, :]
            if noise is not None:
                logits = logits + noise[..., lo + 1 : hi + 1, :]
            z = torch.cat([z, logits.argmax(-1)], dim=-1)
        rows = gather_rows(leaves, z.index_select(-1, s.leaf_parent))  # (..., n, v)
        return rows.argmax(-1) if greedy else sample_rows(rows, generator, normalised=True)

    def _evidence(self, scores: Tensor) -> Tensor:
        k = scores.shape[-2]
        return torch.cat([scores, scores.new_zeros(*scores.shape[:-2], self.window - k, self.rank)], dim=-2)

    def _sample(self, q: Params, generator: torch.Generator | None = None, prefix: Tensor | None = None) -> Tensor:
        root, internal, leaves, prefix, scores = self._parts(q, prefix)
        s = self._sched(root.device)
        _, u_all, u_root = self._upward(s, internal.exp(), self._evidence(scores), False)
        return with_prefix(prefix, self._topdown(s, root, internal, u_all, u_root, leaves, generator, False))

    def _greedy(self, q: Params, prefix: Tensor | None = None) -> Tensor:
        root, internal, leaves, prefix, scores = self._parts(q, prefix)
        s = self._sched(root.device)
        k = scores.shape[-2]
        evidence = torch.cat([scores, leaves[..., k:, :, :].amax(-1)], dim=-2)  # (..., n, r)
        _, u_all, u_root = self._upward(s, internal, evidence, True)
        return with_prefix(prefix, self._topdown(s, root, internal, u_all, u_root, leaves, None, True))

    def _draft(self, q, prefix, generator=None, greedy=False):
        if greedy:
            return super()._draft(q, prefix, generator, greedy)
        root, internal, leaves, prefix, scores = self._parts(q, prefix)  # one set of tables for both passes
        s = self._sched(root.device)
        probs = internal.exp()
        _, u_all, u_root = self._upward(s, probs, self._evidence(scores), False)
        x = with_prefix(prefix, self._topdown(s, root, internal, u_all, u_root, leaves, generator, False))
        w = self._context(s, root, probs, gather_leaf_scores(leaves, x))
        return x, mix_leaves_fast(w, leaves)
