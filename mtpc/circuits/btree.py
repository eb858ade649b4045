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
    gumbel,
    leaf_probs,
    log_rowvec,
    mix_probs,
    sample_probs,
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
            height[nd.node] = 1 + max(
                (height[c[1]] for c in (nd.left, nd.right) if c and c[0] == "node"), default=0
            )
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
            self.up_levels.append(
                (a, b, t([kid(c) for k in up_order[a:b] for c in (nodes[k].left, nodes[k].right)]))
            )
            a = b
        self.perm_height = t([k - 1 for k in up_order])  # internal rows in up_order
        # when the tree is perfect (n a power of 2) height order is reverse breadth-first order, level
        # by level: then the upward pass slices the breadth-first table and needs no permuted copy
        # Level tables are taken with torch.split (one concatenation in backward), not by slicing per
        # level (each slice's backward zero-fills a full-size gradient).
        self.up_sizes = [b - a for a, b, _ in self.up_levels]  # split sizes of the height-ordered table
        self.up_slices = None  # else: (split sizes of the breadth-first table, which chunk each level uses)
        if self.up_levels and all(
            sorted(up_order[a:b]) == list(range(up_order[a], up_order[a] + b - a))
            for a, b, _ in self.up_levels
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
        self.down_sizes = [
            hi - lo for lo, hi, _, _ in self.down_levels
        ]  # split sizes of the breadth-first table
        leaf_parent, leaf_sib = [0] * n, [0] * n
        for nd in nodes:
            for c in (nd.left, nd.right):
                if c is not None and c[0] == "leaf":
                    leaf_parent[c[1]] = nd.node
                    leaf_sib[c[1]] = kid(nd.left) if c == nd.right else 0
        self.leaf_parent, self.leaf_sib = t(leaf_parent), t(leaf_sib)
        self._down_rows = [
            t(list(range(lo, hi))) for lo, hi, _, _ in self.down_levels
        ]  # internal rows per level
        # the spine: the non-root nodes above position 0 (internal rows, bottom-up); with evidence at
        # position 0 only, every other node's upward message is exactly 0
        spine, node = [], nodes[0]
        while node.left[0] == "node":
            node = nodes[node.left[1]]
            spine.append(node.internal_index)
        self.spine_rows = spine[::-1]
        self.spine_index = t(self.spine_rows)
        self._offsets: dict[int, list[Tensor]] = {}
        # the tree for the native drafts (mtpc/csrc/btree_draft.cpp, its header has the layout)
        plan = [m, n]
        for k in up_order:
            plan += [k - 1, kid(nodes[k].left), kid(nodes[k].right)]
        plan += [kid(nodes[0].left), kid(nodes[0].right)]
        plan += [nodes[k].parent for k in range(1, len(nodes))]
        plan += leaf_parent
        for k in range(1, len(nodes)):  # the sampled draft's downward pass: left siblings' slots
            par = nodes[nodes[k].parent]
            plan.append(kid(par.left) if par.right == ("node", k) else 0)
        plan += leaf_sib
        self.native_plan = torch.tensor(plan, dtype=torch.long)  # host memory: the kernel reads it there

    def down_offsets(self, rank: int) -> list[Tensor]:
        """Per downward level, the offsets k r of its internal rows k into a flattened (m r) table."""
        if rank not in self._offsets:
            self._offsets[rank] = [rows * rank for rows in self._down_rows]
        return self._offsets[rank]


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

    def _up_tables(self, s: _Schedule, table: Tensor) -> list[Tensor]:
        """Breadth-first tables (..., m, r, r) -> one chunk (..., S, r, r) per upward level (height order)."""
        if not s.up_levels:
            return []
        if s.up_slices is None:
            return list(torch.split(table.index_select(-3, s.perm_height), s.up_sizes, dim=-3))
        parts = torch.split(table, s.up_slices[0], dim=-3)
        return [parts[j] for j in s.up_slices[1]]

    def _down_tables(self, s: _Schedule, table: Tensor) -> list[Tensor]:
        """Breadth-first tables (..., m, r, r) -> one chunk per downward level (by depth)."""
        return list(torch.split(table, s.down_sizes, dim=-3)) if s.down_sizes else []

    def _upward(
        self,
        s: _Schedule,
        chunks: list[Tensor],
        leaf_msg: Tensor,
        use_max: bool,
        keep_u: bool = True,
        exact: bool = True,
    ):
        """Upward pass. chunks: `_up_tables` of the internal tables, logs T[a, b] for max-product or
        transposed probabilities [b, a] for sum-product; leaf_msg (..., n, r) (leaf scores, or 0 /
        max-over-tokens for free leaves). exact=False: sum-product messages up to a constant per node
        (see log_rowvec), which every use in a draft (softmaxes and argmaxes per node) cancels.

        -> message buffer (..., 1 + n + m, 1, r) (messages kept as rows), U of the non-root nodes in
        height order (..., m, r) (None unless keep_u), U of the root (..., r).
        """
        zero = leaf_msg.new_zeros(*leaf_msg.shape[:-2], 1, self.rank)
        buf = torch.cat([zero, leaf_msg], dim=-2).unsqueeze(-2)  # (..., 1 + n, 1, r)
        us = []
        for tl, (a0, b0, kids) in zip(chunks, s.up_levels, strict=True):
            u = buf.index_select(-3, kids).unflatten(-3, (b0 - a0, 2)).sum(-3)  # (..., S, 1, r)
            if use_max:  # max_b T[a, b] + U(b)
                msg = (tl + u).amax(-1).unsqueeze(-2)
            else:  # logsumexp_b T[a, b] + U(b)
                msg = log_rowvec(u, tl, exact)
            if keep_u:
                us.append(u)
            buf = torch.cat([buf, msg], dim=-3)
        u_root = buf.index_select(-3, s.root_children).sum(-3).squeeze(-2)  # (..., r)
        if not keep_u:
            return buf, None, u_root
        u_all = (
            torch.cat(us, dim=-3).squeeze(-2)
            if us
            else leaf_msg.new_zeros(*leaf_msg.shape[:-2], 0, self.rank)
        )
        return buf, u_all, u_root

    def _log_prob(self, q: Params, x: Tensor) -> Tensor:
        root, internal, _, _, scores = self._parts(q, x)
        s = self._sched(x.device)
        up = self._up_tables(s, internal.exp().transpose(-1, -2))
        _, _, u_root = self._upward(s, up, scores, False, keep_u=False)
        return torch.logsumexp(root + u_root, dim=-1)

    def _context(
        self,
        s: _Schedule,
        root: Tensor,
        up: list[Tensor],
        down: list[Tensor],
        scores: Tensor,
        exact: bool = True,
    ) -> Tensor:
        """w (..., n, r): log q(state a of the node above leaf i, x_<i), from full leaf scores (..., n, r);
        up / down: `_up_tables` of the transposed and `_down_tables` of the plain probabilities.
        exact=False: each row w_i up to an additive constant (enough for softmax(w_i))."""
        buf, _, _ = self._upward(s, up, scores, False, keep_u=False, exact=exact)
        a = root.unsqueeze(-2).unsqueeze(
            -2
        )  # (..., 1, 1, r)  A(root) = log prior; A buffer indexed by node id
        for tl, (_, _, parents, sibs) in zip(down, s.down_levels, strict=True):
            v = a.index_select(-3, parents) + buf.index_select(
                -3, sibs
            )  # (..., S, 1, r) parent state & x left of it
            a = torch.cat([a, log_rowvec(v, tl, exact)], dim=-3)
        return (a.index_select(-3, s.leaf_parent) + buf.index_select(-3, s.leaf_sib)).squeeze(
            -2
        )  # (..., n, r)

    def _leaf_context(self, q: Params, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        root, internal, leaves, x, scores = self._parts(q, x)
        s = self._sched(x.device)
        probs = internal.exp()
        w = self._context(
            s, root, self._up_tables(s, probs.transpose(-1, -2)), self._down_tables(s, probs), scores
        )
        return w, leaves, scores

    def _topdown(self, s, root, internal, u_bfs, u_root, noise: Tensor | None) -> Tensor:
        """States of every node given its parent from q(node | parent, evidence below) (Gumbel-max
        with noise (..., m + 1, r), or argmax when None) -> the state above each leaf (..., n).
        u_bfs (..., m, r) / u_root (..., r): the upward U's of the non-root nodes (breadth-first)
        and of the root.

        Every node's choice is formed for every parent state at once, choice[k, a] = argmax_b
        T_k[a, b] + U_k(b) + g_k(b) (one batched op over all nodes), and the levels then only look
        up choice[k, state of the parent]."""
        logits = internal + u_bfs.unsqueeze(-2)  # (..., m, r, r)
        top = root + u_root  # (..., r)
        if noise is not None:
            logits = logits + noise[..., 1:, :].unsqueeze(-2)
            top = top + noise[..., 0, :]
        choice = logits.argmax(-1).flatten(
            -2
        )  # (..., m r): [k r + a] = state of node k + 1 given parent state a
        z = top.argmax(-1, keepdim=True)  # (..., 1) states by node id
        for (_, _, parents, _), offset in zip(s.down_levels, s.down_offsets(self.rank), strict=True):
            z = torch.cat([z, choice.gather(-1, z.index_select(-1, parents) + offset)], dim=-1)
        return z.index_select(-1, s.leaf_parent)  # (..., n)

    def _noise(self, root: Tensor, generator: torch.Generator | None) -> Tensor:
        """Gumbel noise for the top-down sampling of every node's state (..., m + 1, r)."""
        m1, r = len(self._nodes), self.rank
        u = torch.rand(*root.shape[:-1], m1 * r, generator=generator, dtype=root.dtype, device=root.device)
        return gumbel(u).unflatten(-1, (m1, r))

    def _evidence(self, scores: Tensor) -> Tensor:
        k = scores.shape[-2]
        return torch.cat([scores, scores.new_zeros(*scores.shape[:-2], self.window - k, self.rank)], dim=-2)

    def _sample(
        self, q: Params, generator: torch.Generator | None = None, prefix: Tensor | None = None
    ) -> Tensor:
        root, internal, leaves, prefix, scores = self._parts(q, prefix)
        s = self._sched(root.device)
        up = self._up_tables(s, internal.exp().transpose(-1, -2))
        _, u_all, u_root = self._upward(s, up, self._evidence(scores), False)
        u_bfs = u_all.index_select(-2, s.inv_height)
        states = self._topdown(s, root, internal, u_bfs, u_root, self._noise(root, generator))
        return with_prefix(prefix, sample_rows(gather_rows(leaves, states), generator, normalised=True))

    def _greedy(self, q: Params, prefix: Tensor | None = None) -> Tensor:
        root, internal, leaves, prefix, scores = self._parts(q, prefix)
        return with_prefix(
            prefix, self._greedy_window(self._sched(root.device), root, internal, leaves, scores)
        )

    def _greedy_window(self, s: _Schedule, root, internal, leaves, scores) -> Tensor:
        """Max-product: upward with the prefix scores and the best free token per state, top-down argmax."""
        k = scores.shape[-2]
        evidence = torch.cat([scores, leaves[..., k:, :, :].amax(-1)], dim=-2)  # (..., n, r)
        _, u_all, u_root = self._upward(s, self._up_tables(s, internal), evidence, True)
        states = self._topdown(s, root, internal, u_all.index_select(-2, s.inv_height), u_root, None)
        return gather_rows(leaves, states).argmax(-1)

    def _spine_upward(self, s: _Schedule, probs_t: Tensor, score: Tensor) -> tuple[Tensor, Tensor]:
        """The upward pass for evidence at position 0 only, score (..., r) its leaf scores: just the
        chain of nodes above it (every other message is exactly 0), up to a constant per node (as
        exact=False) -> U of the non-root nodes breadth-first (..., m, r), U of the root (..., r).
        probs_t: the transposed probability tables breadth-first (..., m, r, r)."""
        u, us = score.unsqueeze(-2), []  # (..., 1, r)
        for row in s.spine_rows:
            us.append(u)
            u = log_rowvec(u, probs_t[..., row, :, :], exact=False)
        m = probs_t.shape[-3]
        u_bfs = score.new_zeros(*score.shape[:-1], m, self.rank)
        if us:
            u_bfs = u_bfs.index_copy(-2, s.spine_index, torch.cat(us, dim=-2))
        return u_bfs, u.squeeze(-2)

    def _native_args(self, q: Params, prefix: Tensor | None) -> tuple[Tensor, ...] | None:
        """(root, internal, leaves, prefix (k,), plan) for the native kernels, or None where they do not
        apply: a batch, not float32 on the CPU, the kernels not built, $MTPC_NATIVE_CYCLE=0."""
        root, internal, leaves = q["root"], q["internal"], q["leaves"]
        if root.dim() != 1 or (prefix is not None and prefix.dim() != 1):
            return None
        from mtpc.kernels import native_cycle_unsupported

        if native_cycle_unsupported(root.device, root.dtype) is not None:
            return None
        if internal.dtype != root.dtype or leaves.dtype != root.dtype:
            return None
        pre = prefix if prefix is not None else self._no_prefix
        plan = self._sched(root.device).native_plan
        return root.contiguous(), internal.contiguous(), leaves.contiguous(), pre.contiguous(), plan

    def _native_sample(
        self, q: Params, prefix: Tensor | None, generator: torch.Generator | None
    ) -> tuple[Tensor, Tensor] | None:
        """The batch-1 sampled window and its log conditionals (n, v) from the native kernel
        (mtpc.kernels.btree_sample_draft: an exact draw from this circuit with its conditionals, its
        own float order and 1 + m + n uniforms from `generator`), or None where it does not apply
        (`_native_args`)."""
        args = self._native_args(q, prefix)
        if args is None:
            return None
        from mtpc.kernels import btree_sample_draft

        root, internal, leaves, pre, plan = args
        u = torch.rand(len(self._nodes) + self.window, generator=generator, dtype=torch.float64)
        x, probs = btree_sample_draft(root, internal, leaf_probs(leaves).contiguous(), pre, u, plan)
        return x, probs.log()

    def _native_greedy(self, q: Params, prefix: Tensor | None) -> Tensor | None:
        """The batch-1 greedy window from the native kernel (mtpc.kernels.btree_greedy_draft: the same
        window as `_greedy_window`, bits and ties), or None where it does not apply (`_native_args`)."""
        args = self._native_args(q, prefix)
        if args is None:
            return None
        from mtpc.kernels import btree_greedy_draft

        return btree_greedy_draft(*args)

    _no_prefix = torch.zeros(0, dtype=torch.long)

    def _draft(self, q, prefix, generator=None, greedy=False, conditionals=True):
        if greedy and not conditionals:  # the decoding cycle's greedy draft: one native call where it runs
            x = self._native_greedy(q, prefix)
            if x is not None:
                return x, None
        if not greedy and conditionals:  # the sampling cycle's draft: one native call where it runs
            got = self._native_sample(q, prefix, generator)
            if got is not None:
                return got
        # one set of level tables for every pass, one exp of the leaves for the sampled rows and the
        # mix; messages up to a constant per node (each only enters a softmax or argmax over its row)
        root, internal, leaves, prefix, scores = self._parts(q, prefix)
        s = self._sched(root.device)
        probs = internal.exp() if conditionals or not greedy else None
        up = None if probs is None else self._up_tables(s, probs.transpose(-1, -2))
        p_leaves = leaf_probs(leaves) if conditionals else None  # (..., n, r, v)
        if greedy:
            x = self._greedy_window(s, root, internal, leaves, scores)
        else:
            k = scores.shape[-2]
            if k == 0:  # no evidence: every upward message is log sum_b T[a, b] = 0
                u_bfs, u_root = (
                    root.new_zeros(*root.shape[:-1], internal.shape[-3], self.rank),
                    torch.zeros_like(root),
                )
            elif k == 1:  # the keep cycle's prefix [c]: only the nodes above position 0
                u_bfs, u_root = self._spine_upward(s, probs.transpose(-1, -2), scores[..., 0, :])
            else:
                _, u_all, u_root = self._upward(s, up, self._evidence(scores), False, exact=False)
                u_bfs = u_all.index_select(-2, s.inv_height)
            states = self._topdown(s, root, internal, u_bfs, u_root, self._noise(root, generator))
            rows = gather_rows(leaves, states).exp() if p_leaves is None else gather_rows(p_leaves, states)
            x = sample_probs(rows, generator)
        x = with_prefix(prefix, x)
        if not conditionals:
            return x, None
        w = self._context(
            s, root, up, self._down_tables(s, probs), gather_leaf_scores(leaves, x), exact=False
        )
        return x, mix_probs(w, p_leaves)
