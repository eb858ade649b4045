"""The shared `Circuit` base class: the public contract, argument validation, dtype rules, broadcasting.

A circuit is a *structure* (kind, window n, rank r, vocab v) plus a dict of log-parameter tensors
whose leading dims are a batch (any shape, broadcast by torch rules). Subclasses (ff, cp, hmm,
btree) implement the unchecked `_` queries on normalised parameters; this module turns them into
the validated public methods and holds the numerical helpers they share (log-space matrix-vector
products, Gumbel-max sampling, leaf mixing).

Every kind answers the prefix queries through one quantity, `_leaf_context(q, x)`: for each
position i the log joint  w_i(a) = log q(s_i = a, x_<i)  of the state s_i of the unit above leaf i
and the tokens before it. Then
    log q(x_1..x_i)          = logsumexp_a  w_i(a) + log q(x_i | s_i = a)
    log q(x_i = . | x_<i)    = logsumexp_a  log_softmax(w_i)(a) + leaves[i, a, .]
so `_prefix_log_marginals` and `_conditionals` live here once. The decoding loop's fused
`_draft` (the window and its conditionals in one call) mixes in probability space: with the
leaf probabilities P = exp(leaves) formed once per draft, log q(x_i = . | x_<i) =
log(softmax(w_i) @ P[i]) (`mix_probs`), and the sampled tokens come from rows of the same P.

What it leaves out: the structures themselves (ff.py, cp.py, hmm.py, btree.py) and the dense
brute-force oracle (reference.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

Params = dict[str, Tensor]


# ----------------------------------------------------------------------------- numerical helpers


def compute_dtype(params: Mapping[str, Tensor]) -> torch.dtype:
    """float64 if any parameter is float64, else float32 (bf16/fp16 inputs are upcast)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in params.values()) else torch.float32


def log_vecmat(logv: Tensor, probs: Tensor) -> Tensor:
    """log sum_a exp(logv[..., a]) * probs[..., a, b]  -> (..., b), by a shifted matmul.

    logv (..., a) finite, probs (..., a, b) with entries in [0, 1] (a transposed view is fine: pass
    T.transpose(-1, -2) for sum_b T[a, b] exp(logv[b])). The shift is detached: the result does not
    depend on it. A row-vector matmul is used because it is the fastest layout at batch 1.
    """
    return log_rowvec(logv.unsqueeze(-2), probs).squeeze(-2)


def log_rowvec(logv: Tensor, probs: Tensor, exact: bool = True) -> Tensor:
    """`log_vecmat` on row vectors: logv (..., 1, a), probs (..., a, b) -> (..., 1, b). Passes that
    keep their messages as rows call it without an unsqueeze / squeeze per step.

    exact=False: the result up to an additive constant per row, log(softmax(logv) @ probs), in
    three ops instead of six; for messages that only ever enter a softmax or an argmax over the
    same row (the draft's passes), where such a constant cancels.
    """
    if not exact:
        return torch.matmul(logv.softmax(-1), probs).log()
    m = (logv.detach() if logv.requires_grad else logv).amax(-1, keepdim=True)  # (..., 1, 1)
    return torch.matmul((logv - m).exp(), probs).log() + m


def gumbel(u: Tensor) -> Tensor:
    """Standard Gumbel noise -log(-log u) from uniforms u in [0, 1) (u = 0 clamped to the tiniest float)."""
    return -(-u.clamp_min(torch.finfo(u.dtype).tiny).log()).log()


def gumbel_argmax(logits: Tensor, generator: torch.Generator | None) -> Tensor:
    """One exact sample per row of the categorical softmax(logits) (Gumbel-max), int64 (...)."""
    u = torch.rand(logits.shape, generator=generator, dtype=logits.dtype, device=logits.device)
    return (logits + gumbel(u)).argmax(-1)


def sample_rows(logits: Tensor, generator: torch.Generator | None, normalised: bool = False) -> Tensor:
    """One exact sample per row of softmax(logits) (..., v) by inverse CDF -> int64 (...).

    Needs one uniform per row instead of Gumbel-max's v (twice as fast for vocab rows). With
    `normalised` (rows already log-probabilities, so their max is >= -log v) the shift is skipped.
    """
    if not normalised:
        logits = logits - logits.detach().amax(-1, keepdim=True)
    return sample_probs(logits.exp(), generator)


def sample_probs(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One exact sample per row of probs (..., v) (non-negative, any scale) by inverse CDF -> int64 (...).

    Draws one uniform per row, (..., 1), like `sample_rows`, so the two consume a generator alike.
    """
    cdf = probs.cumsum(-1)  # (..., v)
    u = torch.rand((*cdf.shape[:-1], 1), generator=generator, dtype=cdf.dtype, device=cdf.device)
    # first index with cdf > u * total: tokens of zero mass are never chosen
    return torch.searchsorted(cdf, u * cdf[..., -1:], right=True).squeeze(-1).clamp_max(cdf.shape[-1] - 1)


def gather_leaf_scores(leaves: Tensor, x: Tensor) -> Tensor:
    """leaves (..., m, r, v), x (..., k) int, k <= m -> (..., k, r): log q(x_i | state a) of the
    first k positions, for every a. Leading dims of leaves and x must already agree (expand before
    calling)."""
    r = leaves.shape[-2]
    idx = x[..., None, None].expand(*x.shape, r, 1)  # (..., k, r, 1)
    return leaves.gather(-1, idx).squeeze(-1)


def gather_rows(table: Tensor, state: Tensor) -> Tensor:
    """table (..., k, r, s), state (..., k) int -> (..., k, s) = table[..., i, state_i, :]."""
    s = table.shape[-1]
    idx = state[..., None, None].expand(*state.shape, 1, s)  # (..., k, 1, s)
    return table.gather(-2, idx).squeeze(-2)


def expand_to(t: Tensor, shape: tuple[int, ...]) -> Tensor:
    """t.expand(shape), or t itself when it has that shape already (one call less per tensor on
    the batch-1 decoding path, where nothing broadcasts)."""
    return t if t.shape == shape else t.expand(shape)


def mix_leaves(logw: Tensor, leaves: Tensor) -> Tensor:
    """logw (..., n, r) log weights, leaves (..., n, r, v) -> (..., n, v): logsumexp_a logw + leaves."""
    return torch.logsumexp(logw.unsqueeze(-1) + leaves, dim=-2)


def mix_probs(logw: Tensor, probs: Tensor) -> Tensor:
    """As mix_leaves in probability space: logw (..., n, r) log weights (any shift per row), probs
    (..., n, r, v) leaf probabilities -> log(softmax(logw) @ probs) (..., n, v).

    About 2x faster at batch 1 than the log-space mix, but an entry whose probability is below the
    dtype's smallest normal (~1e-38 in float32) comes out -inf. Used by the decoding path `_draft`
    (which forms probs once and samples from it too); the public `conditionals` mixes in log space.
    """
    return torch.matmul(logw.softmax(-1).unsqueeze(-2), probs).squeeze(-2).log()  # (..., n, v)


def leaf_probs(leaves: Tensor) -> Tensor:
    """Probabilities of normalised leaves (..., v): exp(leaves), computed as softmax (the faster
    kernel on the CPU; equal to rounding since the rows are normalised)."""
    return leaves.softmax(-1)


def with_prefix(prefix: Tensor | None, x: Tensor) -> Tensor:
    """Overwrite the first k positions of x (..., n) with prefix (..., k) (broadcast)."""
    if prefix is None or prefix.shape[-1] == 0:
        return x
    k = prefix.shape[-1]
    return torch.cat([expand_to(prefix, (*x.shape[:-1], k)), x[..., k:]], dim=-1)


# ----------------------------------------------------------------------------- the base class


class Circuit:
    """Base class of the four circuit kinds. Use `build_circuit(kind, window, rank, vocab)`.

    Public query methods validate their arguments (raising ValueError that names the argument),
    normalise the parameters (log_softmax over the last dim, float64 if any parameter is float64,
    else float32) and call the unchecked `_` method. Leading dims of params, x and prefix broadcast.
    """

    kind: str = ""
    fixed_rank: int | None = None
    """the one rank of a kind without latent states (ff: 1); None: any rank >= 1"""

    def __init__(self, window: int, rank: int, vocab: int) -> None:
        self.window = window  # n
        self.rank = rank  # r
        self.vocab = vocab  # v

    def __repr__(self) -> str:
        return f"{type(self).__name__}(kind={self.kind!r}, window={self.window}, rank={self.rank}, vocab={self.vocab})"

    # -- structure ------------------------------------------------------------------------------

    @property
    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """{name: per-context shape}; leading (batch) dims come in front of these."""
        raise NotImplementedError

    def random_params(
        self,
        batch_shape: Sequence[int] | int = (),
        generator: torch.Generator | None = None,
        dtype: torch.dtype = torch.float32,
        scale: float = 1.0,
    ) -> Params:
        """Normalised log-parameters: log_softmax(scale * N(0, 1) logits), shapes batch_shape + shape."""
        if isinstance(batch_shape, int):
            batch_shape = (batch_shape,)
        try:
            batch_shape = tuple(int(d) for d in batch_shape)
        except TypeError as e:
            raise ValueError(f"batch_shape: expected a sequence of ints, got {batch_shape!r}") from e
        if any(d < 0 for d in batch_shape):
            raise ValueError(f"batch_shape: dims must be >= 0, got {batch_shape}")
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"dtype: expected a floating torch dtype, got {dtype!r}")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ValueError(f"generator: expected a torch.Generator or None, got {type(generator).__name__}")
        out = {}
        for name, shape in self.param_shapes.items():
            logits = torch.randn(
                batch_shape + shape,
                generator=generator,
                dtype=torch.float64 if dtype == torch.float64 else torch.float32,
            )
            out[name] = (scale * logits).log_softmax(-1).to(dtype)
        return out

    # -- unchecked fast path --------------------------------------------------------------------

    def normalize(self, p: Mapping[str, Tensor]) -> Params:
        """log_softmax over the last dim of every parameter, in float64 if any is float64 else float32."""
        dtype = compute_dtype(p)
        return {name: t.to(dtype).log_softmax(-1) for name, t in p.items()}

    def _batch_shape(self, q: Mapping[str, Tensor], *others: torch.Size) -> torch.Size:
        shapes = self.param_shapes
        return torch.broadcast_shapes(*(t.shape[: t.dim() - len(shapes[k])] for k, t in q.items()), *others)

    def _expand(self, q: Mapping[str, Tensor], batch: torch.Size) -> Params:
        shapes = self.param_shapes
        return {k: expand_to(t, (*batch, *shapes[k])) for k, t in q.items()}

    def _expand_with_scores(self, q: Params, ids: Tensor | None) -> tuple[Params, Tensor | None, Tensor]:
        """q broadcast to the batch of q and ids, ids broadcast likewise, and the leaf scores of the
        ids (..., k, r) (k = 0 when ids is None). Shared by the latent-variable circuits' passes."""
        batch = self._batch_shape(q, *(() if ids is None else (ids.shape[:-1],)))
        e = self._expand(q, batch)
        leaves = e["leaves"]
        if ids is None:
            scores = leaves.new_zeros(*batch, 0, self.rank)
        else:
            k = ids.shape[-1]
            ids = expand_to(ids, (*batch, k))
            scores = gather_leaf_scores(leaves, ids)  # (..., k, r)
        return e, ids, scores

    def _log_prob(self, q: Params, x: Tensor) -> Tensor:  # (...)
        raise NotImplementedError

    def _leaf_context(self, q: Params, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """-> (w (..., n, r) = log q(s_i = a, x_<i), leaves (..., n, r, v), leaf scores of x (..., n, r)),
        all broadcast to the batch of q and x. The scores are returned so that callers do not gather
        from the leaves twice (each gather's backward zero-fills a leaves-sized gradient)."""
        raise NotImplementedError

    def _prefix_log_marginals(self, q: Params, x: Tensor) -> Tensor:  # (..., n)
        w, _, scores = self._leaf_context(q, x)
        return torch.logsumexp(w + scores, dim=-1)

    def _conditionals(self, q: Params, x: Tensor) -> Tensor:  # (..., n, v)
        w, leaves, _ = self._leaf_context(q, x)
        return mix_leaves(w.log_softmax(-1), leaves)

    def _sample(
        self, q: Params, generator: torch.Generator | None = None, prefix: Tensor | None = None
    ) -> Tensor:
        raise NotImplementedError

    def _greedy(self, q: Params, prefix: Tensor | None = None) -> Tensor:
        raise NotImplementedError

    def _draft(
        self,
        q: Params,
        prefix: Tensor | None,
        generator: torch.Generator | None = None,
        greedy: bool = False,
        conditionals: bool = True,
    ) -> tuple[Tensor, Tensor | None]:
        """Fused draft for the decoding loop: (x (..., n) int64, log q(x_i = . | x_<i) (..., n, v)).

        x is sampled from q(. | prefix) (or is the greedy max-product window), x[..., :k] = prefix;
        no validation, no host sync. The conditionals are mixed in probability space (mix_probs).
        conditionals=False returns (x, None) and skips them (greedy verification only compares
        x with the verifier's argmax; for btree and hmm that is half of the draft's work); x is
        the same either way. Every kind implements it fused, forming the leaf probabilities once for
        both.
        """
        raise NotImplementedError

    # -- validation -----------------------------------------------------------------------------

    def _check_params(self, p: object) -> torch.Size:
        if not isinstance(p, Mapping):
            raise ValueError(
                f"params: expected a dict of tensors {sorted(self.param_shapes)}, got {type(p).__name__}"
            )
        shapes = self.param_shapes
        missing = sorted(set(shapes) - set(p))
        extra = sorted(set(p) - set(shapes))
        if missing or extra:
            raise ValueError(
                f"params: {self.kind} expects keys {sorted(shapes)}; missing {missing}, unexpected {extra}"
            )
        batch = []
        for name, shape in shapes.items():
            t = p[name]
            if not isinstance(t, Tensor) or not t.is_floating_point():
                raise ValueError(f"params[{name!r}]: expected a floating-point tensor, got {_describe(t)}")
            if t.dim() < len(shape) or tuple(t.shape[t.dim() - len(shape) :]) != shape:
                raise ValueError(
                    f"params[{name!r}]: expected shape (..., {', '.join(map(str, shape))}) "
                    f"for {self!r}, got {tuple(t.shape)}"
                )
            batch.append(t.shape[: t.dim() - len(shape)])
        try:
            return torch.broadcast_shapes(*batch)
        except RuntimeError as e:
            raise ValueError(
                f"params: leading (batch) dims do not broadcast: "
                f"{ {k: tuple(b) for k, b in zip(shapes, batch, strict=True)} }"
            ) from e

    def _check_ids(self, name: str, x: object, batch: torch.Size, length: int | None) -> torch.Size:
        """Validate an id tensor: integer, last dim == length (or <= n if None), ids in [0, v)."""
        if not isinstance(x, Tensor) or x.dtype == torch.bool or x.is_floating_point() or x.is_complex():
            raise ValueError(f"{name}: expected an integer tensor of token ids, got {_describe(x)}")
        if x.dim() < 1:
            raise ValueError(f"{name}: expected shape (..., k) with a window axis last, got a 0-d tensor")
        k = x.shape[-1]
        if length is not None and k != length:
            raise ValueError(f"{name}: expected last dim = window = {length}, got shape {tuple(x.shape)}")
        if length is None and k > self.window:
            raise ValueError(f"{name}: length {k} is longer than the window n = {self.window}")
        if x.numel() > 0:
            lo, hi = int(x.min()), int(x.max())
            if lo < 0 or hi >= self.vocab:
                raise ValueError(f"{name}: ids must lie in [0, {self.vocab}) (vocab), got min {lo}, max {hi}")
        try:
            return torch.broadcast_shapes(batch, x.shape[:-1])
        except RuntimeError as e:
            raise ValueError(
                f"{name}: leading dims {tuple(x.shape[:-1])} do not broadcast with the params' batch dims {tuple(batch)}"
            ) from e

    @staticmethod
    def _check_generator(generator: object) -> None:
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ValueError(f"generator: expected a torch.Generator or None, got {type(generator).__name__}")

    # -- public, validated ------------------------------------------------------------------------

    def log_prob(self, p: Mapping[str, Tensor], x: Tensor) -> Tensor:
        """log q(x_1..x_n); x (..., n) int -> (...)."""
        self._check_ids("x", x, self._check_params(p), self.window)
        return self._log_prob(self.normalize(p), x.long())

    def prefix_log_marginals(self, p: Mapping[str, Tensor], x: Tensor) -> Tensor:
        """log q(x_1..x_i) for i = 1..n; x (..., n) -> (..., n)."""
        self._check_ids("x", x, self._check_params(p), self.window)
        return self._prefix_log_marginals(self.normalize(p), x.long())

    def conditionals(self, p: Mapping[str, Tensor], x: Tensor) -> Tensor:
        """log q(x_i = . | x_<i) for every i; x (..., n) -> (..., n, v)."""
        self._check_ids("x", x, self._check_params(p), self.window)
        return self._conditionals(self.normalize(p), x.long())

    def sample(
        self, p: Mapping[str, Tensor], generator: torch.Generator | None = None, prefix: Tensor | None = None
    ) -> Tensor:
        """Exact sample of a window from q(. | x_1..x_k = prefix); prefix (..., k), 0 <= k <= n -> (..., n) int64."""
        batch = self._check_params(p)
        self._check_generator(generator)
        if prefix is not None:
            self._check_ids("prefix", prefix, batch, None)
            prefix = prefix.long()
        return self._sample(self.normalize(p), generator, prefix)

    def greedy(self, p: Mapping[str, Tensor], prefix: Tensor | None = None) -> Tensor:
        """Token part of a joint maximiser over latents and tokens given the prefix -> (..., n) int64."""
        batch = self._check_params(p)
        if prefix is not None:
            self._check_ids("prefix", prefix, batch, None)
            prefix = prefix.long()
        return self._greedy(self.normalize(p), prefix)


def _describe(t: object) -> str:
    if isinstance(t, Tensor):
        return f"tensor of dtype {t.dtype} and shape {tuple(t.shape)}"
    return type(t).__name__
