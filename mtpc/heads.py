"""MtPC heads: a hidden state e_t becomes the parameter logits of a probabilistic circuit.

Holds `HeadConfig` (validated dataclass), `MtpcHead` (nn.Module: e (..., d) -> dict of
unnormalised logits shaped like `circuit.param_shapes`), its initialisation from the backbone's
unembeddings, its batch-1 decoding path (`HeadDecoder`, from `head.decoder()`: one context ->
normalised parameters and the draft, at the cost of reading the weights once), and the export
format (`save_head` / `load_head`: safetensors + config.json).

Input units (leaves) come from an unembedding tensor W (n, r, v, d): logits W[i, j] e_t, computed
as one matmul e (..., d) x W.view(n*r*v, d)^T. Optionally (App. G of the paper,
`leaf_delta_rank=k > 0`) W[i, j] = U[i] + B[i, j] A[i, j], a shared per-position unembedding
U (n, v, d) plus a rank-k delta per component, which cuts the head from n r v d to about
n (v d + r k (v + d)) parameters. Sum units come from R e_t + b, one weight/bias pair per
circuit parameter name (mixture, initial, transitions, root, internal); the head knows nothing
kind-specific beyond `circuit.param_shapes`. The circuit normalises the logits itself.

Known byte (`known_byte=True`, beyond the paper): in the keep cycle window position 1 is the byte c
the previous cycle already emitted, so the head reads u = e_t + E[c] instead of e_t, E a learnt
vocab x d table (`known_embedding`; from the backbone's input embedding when trained, random for
random heads), and every path that computes the parameters takes c (`forward(e, c)`,
`HeadDecoder.params(e, c)`): the product keeps its size d. Such a head scores window positions
2..n only (position 1 is its input) and cannot draft a window without a known byte (drop cycle).

Left out: the loss (mtpc/losses.py), the backbone and its LoRA adapter (mtpc/backbones/; only
the adapter's state dict passes through `save_head` / `load_head`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes
from torch import Tensor, nn
from torch.nn import functional as F

from mtpc.atomic import sha256_file, write_bytes, write_json
from mtpc.circuits import build_circuit
from mtpc.kernels import (
    head_params,
    native_cycle_unsupported,
    onednn_linear,
    onednn_pack,
    rowdot_batched,
    rowdot_linear,
    rowdot_unsupported,
    rowdot_weight,
    use_onednn,
    warn_fallback,
)
from mtpc.names import ArchitectureError, check_architecture

FORMAT_VERSION = 2  # 2: config.json has known_byte (version-1 exports load as known_byte False)
FORMAT_VERSIONS = (1, 2)  # what load_head reads
HEAD_FILE = "head.safetensors"
LORA_FILE = "lora.safetensors"
CONFIG_FILE = "config.json"
SHA256_KEY = "sha256"  # config.json: {file name: SHA-256} of the export's tensor files


@dataclass
class HeadConfig:
    """What a head is: circuit kind, window n, rank r, vocab v, hidden size d (+ provenance)."""

    kind: str
    """circuit kind: ff, cp, hmm or btree"""
    window: int
    """n, the number of future bytes the head predicts (bounds: `mtpc.names`)"""
    rank: int
    """r, latent states per sum unit (ff: must be 1; bounds: `mtpc.names`)"""
    vocab: int
    """v, must equal the backbone's vocab size"""
    hidden: int
    """d, must equal the backbone's hidden size (the size of e_t)"""
    lora_depth: int = 0
    """k, number of top backbone layers with a draft LoRA adapter (0: none)"""
    backbone: str = ""
    """name or path of the backbone the head was trained on (provenance only)"""
    leaf_delta_rank: int = 0
    """0: a full unembedding per (position, component); k > 0: shared per-position unembedding
    plus a rank-k delta per component (paper App. G)"""
    known_byte: bool = False
    """condition on the window's first byte c (known in the keep cycle): the head reads e_t + E[c],
    scores positions 2..n only, and cannot decode with extra_token="drop" """

    def __post_init__(self) -> None:
        try:
            check_architecture(self.kind, self.window, self.rank)
        except ArchitectureError as e:  # the head calls the circuit `kind`
            raise ValueError(f"{'kind' if e.key == 'circuit' else e.key}: {e.detail}") from None
        for name, low in (("vocab", 2), ("hidden", 1), ("lora_depth", 0), ("leaf_delta_rank", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: expected an integer >= {low}, got {value!r}")
        if not isinstance(self.known_byte, bool):
            raise ValueError(f"known_byte: expected true or false, got {self.known_byte!r}")
        if not isinstance(self.backbone, str):
            raise ValueError(f"backbone: expected a string (name or path), got {self.backbone!r}")

    @property
    def first_scored(self) -> int:
        """The first window position (1-based) the head is trained and evaluated on: 2 for a
        known-byte head (position 1 is its input c), else 1."""
        return 2 if self.known_byte else 1

    def check_compatible(self, backbone_hidden: int, backbone_vocab: int) -> None:
        """Raise ValueError unless this head reads e_t of size d and predicts the backbone's vocab."""
        if self.hidden != backbone_hidden:
            raise ValueError(
                f"hidden: the head expects e_t of size {self.hidden}, the backbone's hidden size is "
                f"{backbone_hidden}; expected hidden={backbone_hidden}"
            )
        if self.vocab != backbone_vocab:
            raise ValueError(
                f"vocab: the head predicts {self.vocab} symbols, the backbone's vocab is "
                f"{backbone_vocab}; expected vocab={backbone_vocab}"
            )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str = "config") -> HeadConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(
                f"{where}: unknown head config keys {unknown}; expected a subset of {sorted(known)}"
            )
        missing = [k for k in ("kind", "window", "rank", "vocab", "hidden") if k not in d]
        if missing:
            raise ValueError(f"{where}: missing head config keys {missing}")
        return cls(**d)


class MtpcHead(nn.Module):
    """e_t (..., d) -> {name: unnormalised logits (..., *circuit.param_shapes[name])}."""

    def __init__(self, config: HeadConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        self.config = config
        n, r, v, d, k = config.window, config.rank, config.vocab, config.hidden, config.leaf_delta_rank
        self.circuit = build_circuit(config.kind, window=n, rank=r, vocab=v)
        shapes = {name: tuple(s) for name, s in self.circuit.param_shapes.items()}
        if shapes.get("leaves") != (n, r, v):
            raise ValueError(
                f"circuit {config.kind}: expected leaves of shape {(n, r, v)}, got {shapes.get('leaves')}"
            )
        fk = {"device": device, "dtype": dtype}
        if k == 0:
            self.leaf_weight = nn.Parameter(torch.empty(n, r, v, d, **fk))  # W
        else:
            self.leaf_base = nn.Parameter(torch.empty(n, v, d, **fk))  # U
            self.leaf_delta_in = nn.Parameter(torch.empty(n, r, k, d, **fk))  # A
            self.leaf_delta_out = nn.Parameter(torch.empty(n, r, v, k, **fk))  # B
        self.sum_names = tuple(name for name in shapes if name != "leaves")
        self._decoder: tuple[tuple, HeadDecoder] | None = None  # (weights' stamp, decoder) of decoder()
        self.sum_weight = nn.ParameterDict(
            {name: nn.Parameter(torch.empty(*shapes[name], d, **fk)) for name in self.sum_names}
        )  # R per name
        self.sum_bias = nn.ParameterDict(
            {name: nn.Parameter(torch.empty(*shapes[name], **fk)) for name in self.sum_names}
        )
        if config.known_byte:
            self.known_embedding = nn.Parameter(torch.empty(v, d, **fk))  # E: the known byte's vector
        self.reset_parameters()

    # --- parameters -------------------------------------------------------------------------

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Random leaves (std d^-1/2, so logits are O(1) for unit-RMS e_t); zero sum weights and
        biases (uniform mixtures / transitions). The delta's B starts at zero. A known-byte head's
        E is drawn last, N(0, 1) (rows of unit RMS, like e_t), so the other draws do not move."""
        std = self.config.hidden**-0.5
        with torch.no_grad():
            if self.config.leaf_delta_rank == 0:
                self.leaf_weight.normal_(0.0, std, generator=generator)
            else:
                self.leaf_base.normal_(0.0, std, generator=generator)
                self.leaf_delta_in.normal_(0.0, std, generator=generator)
                self.leaf_delta_out.zero_()
            for name in self.sum_names:
                self.sum_weight[name].zero_()
                self.sum_bias[name].zero_()
            if self.config.known_byte:
                self.known_embedding.normal_(0.0, 1.0, generator=generator)

    def init_known_embedding(self, E: Tensor) -> None:
        """Copy a (v, d) table into a known-byte head's E (training: the backbone's input embedding,
        so u = e_t + E[c] starts from vectors the backbone already gives the byte c)."""
        cfg = self.config
        if not cfg.known_byte:
            raise ValueError("init_known_embedding: this head has known_byte=False (no E to set)")
        if not isinstance(E, Tensor) or tuple(E.shape) != (cfg.vocab, cfg.hidden):
            got = tuple(E.shape) if isinstance(E, Tensor) else type(E).__name__
            raise ValueError(f"E: expected shape (v={cfg.vocab}, d={cfg.hidden}), got {got}")
        with torch.no_grad():
            self.known_embedding.copy_(E.detach().to(self.known_embedding.dtype))

    def init_from_unembeddings(
        self,
        W: Tensor,
        noise: float = 0.01,
        transition_bias: float | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        """Start the head from per-position unembeddings W (m, v, d) (or (v, d) = one).

        Position i (0-based) copies W[min(i, m-1)]: with EvaByte, W[0] is the STP lm_head and
        W[1..7] its MTP heads; for n > m the positions past m repeat the last unembedding.
        Every component j gets the same copy plus `noise` x std(W[i]) Gaussian noise when r > 1
        (identical components get identical gradients forever); with the delta option the copy
        goes to U and the noise to B (A is random already, which breaks the symmetry alone).
        Sum weights R start at zero, so mixtures and roots are uniform; every r x r table
        (hmm transitions, btree internal nodes) gets a diagonal bias b (default ln(r-1) + 4:
        stay probability 1/(1+e^-4) = 0.982), so hmm/btree start as cp up to about (r-1)e^-b
        per table. With noise=0, cp is exactly ff and hmm/btree are cp up to that bound.
        """
        cfg = self.config
        n, r, v, d = cfg.window, cfg.rank, cfg.vocab, cfg.hidden
        if not isinstance(W, Tensor):
            raise ValueError(f"W: expected a tensor (m, v, d), got {type(W).__name__}")
        if W.dim() == 2:
            W = W.unsqueeze(0)
        if W.dim() != 3 or W.shape[1] != v or W.shape[2] != d or W.shape[0] < 1:
            raise ValueError(f"W: expected shape (m >= 1, v={v}, d={d}) or (v, d), got {tuple(W.shape)}")
        if noise < 0 or not math.isfinite(noise):
            raise ValueError(f"noise: expected a finite value >= 0, got {noise}")
        if transition_bias is None:
            transition_bias = math.log(max(r - 1, 1)) + 4.0
        idx = torch.arange(n).clamp(max=W.shape[0] - 1)
        dtype, device = self._param_dtype, next(self.parameters()).device
        base = W.detach().cpu()[idx].to(dtype)  # (n, v, d)  built on CPU (seeded noise), then moved
        eye = torch.eye(r, dtype=dtype, device=device)
        with torch.no_grad():
            if cfg.leaf_delta_rank == 0:
                target = base.unsqueeze(1).expand(n, r, v, d).clone()  # (n, r, v, d)
                if noise > 0 and r > 1:
                    std = base.float().flatten(1).std(dim=1).view(n, 1, 1, 1).to(target.dtype)  # (n, 1, 1, 1)
                    target += noise * std * torch.randn(target.shape, generator=generator, dtype=target.dtype)
                self.leaf_weight.copy_(target.to(device))
            else:
                self.leaf_base.copy_(base.to(device))
                self.leaf_delta_out.zero_()
                if noise > 0 and r > 1:
                    std = base.float().flatten(1).std(dim=1).view(n, 1, 1, 1).to(base.dtype)
                    noisy = (
                        noise * std * torch.randn(self.leaf_delta_out.shape, generator=generator, dtype=dtype)
                    )
                    self.leaf_delta_out.copy_(noisy.to(device))
            for name in self.sum_names:
                self.sum_weight[name].zero_()
                bias = self.sum_bias[name]
                bias.zero_()
                if bias.dim() >= 2 and tuple(bias.shape[-2:]) == (r, r) and r > 1:
                    bias.copy_((transition_bias * eye).expand_as(bias))

    @property
    def _param_dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def check_compatible(self, backbone_hidden: int, backbone_vocab: int) -> None:
        self.config.check_compatible(backbone_hidden, backbone_vocab)

    # --- forward ----------------------------------------------------------------------------

    def leaf_logits(self, e: Tensor) -> Tensor:
        """e (..., d) -> leaf logits (..., n, r, v)."""
        cfg = self.config
        n, r, v, d, k = cfg.window, cfg.rank, cfg.vocab, cfg.hidden, cfg.leaf_delta_rank
        lead = e.shape[:-1]
        if k == 0:
            return F.linear(e, self.leaf_weight.view(n * r * v, d)).view(*lead, n, r, v)
        flat = e.reshape(-1, d)  # (N, d)
        base = F.linear(flat, self.leaf_base.view(n * v, d)).view(-1, n, 1, v)  # (N, n, 1, v)
        h = F.linear(flat, self.leaf_delta_in.view(n * r * k, d)).view(-1, n * r, k)  # (N, n r, k)
        delta = torch.bmm(
            h.transpose(0, 1), self.leaf_delta_out.view(n * r, v, k).transpose(1, 2)
        )  # (n r, N, v)
        delta = delta.transpose(0, 1).reshape(-1, n, r, v)  # (N, n, r, v)
        return (base + delta).view(*lead, n, r, v)

    def forward(self, e: Tensor, c: Tensor | None = None) -> dict[str, Tensor]:
        """e (..., d), c (...) int: the known byte (window position 1) of each context, required by
        a known-byte head and ignored by others -> unnormalised logits (`logits(head_input(e, c))`)."""
        return self.logits(self.head_input(e, c))

    def head_input(self, e: Tensor, c: Tensor | None = None) -> Tensor:
        """What the head's products read, in the head's dtype: u = e + E[c] for a known-byte head,
        else e. e (..., d), c (...) int -> (..., d)."""
        d = self.config.hidden
        if e.shape[-1] != d:
            raise ValueError(f"e: expected last dim = hidden = {d}, got shape {tuple(e.shape)}")
        e = e.to(self._param_dtype)
        if not self.config.known_byte:
            return e
        if c is None or tuple(c.shape) != tuple(e.shape[:-1]) or c.dtype.is_floating_point:
            got = "none" if c is None else f"{c.dtype} {tuple(c.shape)}"
            raise ValueError(
                f"c: a known-byte head needs the known byte of each context, an integer tensor "
                f"of shape {tuple(e.shape[:-1])}; got {got}"
            )
        return e + F.embedding(c, self.known_embedding)  # (..., d)

    def logits(self, u: Tensor) -> dict[str, Tensor]:
        """u (..., d) in the head's dtype (`head_input`) -> {name: unnormalised logits}."""
        return {"leaves": self.leaf_logits(u), **self.sum_logits(u)}  # leaves (..., n, r, v)

    def sum_logits(self, e: Tensor) -> dict[str, Tensor]:
        """e (..., d) in the head's dtype -> the sum-unit logits only (everything but leaves)."""
        d, lead = self.config.hidden, e.shape[:-1]
        out = {}
        for name in self.sum_names:
            w, b = self.sum_weight[name], self.sum_bias[name]
            out[name] = F.linear(e, w.view(-1, d), b.reshape(-1)).view(*lead, *b.shape)
        return out

    # --- decoding (batch 1, no autograd) ----------------------------------------------------

    def decoder(self, onednn: bool | None = None) -> HeadDecoder:
        """The head's decoding path for the current weights: a `HeadDecoder` (see there), built on
        the first call and returned again while no parameter has changed (storage, dtype, device
        or version counter, which every in-place update such as an optimiser step or
        `load_state_dict` bumps; writes through `.data`, invisible to autograd too, are not seen,
        nor are in-place writes to parameters that are inference tensors). Call it once per
        generation, not per cycle: the check costs tens of microseconds in a decoding loop.
        onednn: multiply by oneDNN (mtpc.kernels; None: automatic, the row-dot kernel where it runs
        (x86 CPU, float32), else oneDNN where it runs (CPU float32 / bf16); False under
        torch.compile, which lowers neither)."""
        stamp = tuple(
            (p.device, p.dtype, p.data_ptr(), -1 if p.is_inference() else p._version)
            for p in self.parameters()
        )
        if self._decoder is None or self._decoder[0] != (stamp, onednn):
            self._decoder = ((stamp, onednn), HeadDecoder(self, onednn=onednn))
        return self._decoder[1]


class HeadDecoder:
    """A head's batch-1 decoding path: one context e (d,) -> normalised circuit parameters, and the draft.

    The interface of the decoding loop (once per generation `dec = head.decoder()`, then per cycle):
      theta = dec.params(e, c)   # what circuit.normalize(head(e, c)) returns: the same keys, shapes
                                 # (*param_shapes[name]) and dtype (float64 for a float64 head,
                                 # else float32), equal to rounding; c (1,) the known byte (a
                                 # known-byte head needs it, others ignore it)
      x, log_q = circuit._draft(theta, prefix, generator=g, greedy=greedy)  # as before, or at once:
      x, log_q = dec.draft(e, prefix, g, greedy)   # conditionals=False: (x, None), same x; c = prefix[0]
    No autograd (train with `MtpcHead.forward`), no host sync, fixed shapes.

    How: every weight that multiplies e (leaves W, or for App. G leaves the shared unembedding U
    and the deltas' A; every sum weight R) is copied once and concatenated into one matrix with
    the biases beside it, so that one row-vector product reads each byte once: on an x86 CPU in
    float32 the (N, d) copy as it is, multiplied by the row-dot kernel (`rowdot`, mtpc.kernels),
    where it runs and the choice is automatic; else on the CPU in float32 / bf16 an (N, d) copy in
    oneDNN's blocked format (`onednn`: ~1.4x faster than MKL's best layout on the CPU measured),
    else a transposed (d, N) copy for `addmm` (about twice MKL's (N, d) layout there; cuBLAS on
    CUDA). App. G leaves are then U e + B (A e): one (1, k) x (k, v) product per component on a
    contiguous copy of B^T (a bmm reads it ~3x faster than a transposed view of B) plus U e
    broadcast over the components, or with the row-dot kernels one `rowdot_batched` call over that
    copy (bf16 storage where exact) with U e as each row's bias; nothing of size (n r, N, v) or
    (n, r, v, d) is formed. One log_softmax normalises the leaves and one every sum unit (all have
    r children). On the row-dot path the whole pass is one native call (`mtpc.kernels.head_params`:
    the same kernels, the same bits; `MTPC_NATIVE_CYCLE=0` runs the separate calls).

    A known-byte head adds E[c] to e first (one row gathered on the device, `index_select`: no
    host read, so c can be a graph's static input). A snapshot: it holds a copy of the weights it
    was built from (the head's size again); `MtpcHead.decoder()` builds a new one after the head's
    weights change.
    """

    def __init__(self, head: MtpcHead, onednn: bool | None = None) -> None:
        cfg = head.config
        n, r, v, d, k = cfg.window, cfg.rank, cfg.vocab, cfg.hidden, cfg.leaf_delta_rank
        self.circuit = head.circuit
        shapes = head.circuit.param_shapes
        self.sum_names = head.sum_names
        if any(shapes[name][-1] != r for name in self.sum_names):
            raise ValueError(
                f"circuit {cfg.kind}: HeadDecoder expects every sum unit to have r = {r} children"
            )
        with torch.no_grad():
            if k == 0:
                blocks, self.delta_out = [head.leaf_weight.view(n * r * v, d)], None
            else:
                blocks = [head.leaf_base.view(n * v, d), head.leaf_delta_in.view(n * r * k, d)]
                delta_out = head.leaf_delta_out.detach()  # B (n, r, v, k)
                # (n r, k, v) B^T as a contiguous copy: bmm reads it ~3x faster than the transposed view
                self.delta_out = delta_out.view(n * r, v, k).transpose(1, 2).contiguous()
            sums = [head.sum_weight[name].view(-1, d) for name in self.sum_names]
            stacked = torch.cat([b.detach() for b in blocks + sums])  # (N, d)
            self.dtype, width, device = stacked.dtype, stacked.shape[0], stacked.device
            # (N, d) as it is for the row-dot kernel, blocked for oneDNN, or (d, N) for addmm; the
            # copy is the head's size again
            self.rowdot = onednn is None and rowdot_unsupported(device, self.dtype) is None
            if self.rowdot and k > 0:  # B^T (n r, k, v) for rowdot_batched, bf16 storage where exact
                self.delta_out = rowdot_weight(self.delta_out.view(n * r * k, v)).view(n * r, k, v)
            self.onednn = not self.rowdot and use_onednn(onednn, device, self.dtype, "head decoder")
            if self.rowdot:
                self.weight = rowdot_weight(stacked)  # bf16 storage where exact (a bf16-stored head)
            elif self.onednn:
                try:
                    self.weight = onednn_pack(stacked)
                except (
                    RuntimeError
                ) as err:  # a oneDNN build that cannot reorder here: addmm, unless asked for
                    if onednn:
                        raise
                    self.onednn = False
                    warn_fallback("head decoder", err, "addmm")
            if not (self.onednn or self.rowdot):
                self.weight = stacked.t().contiguous()
            del stacked
            self.bias = torch.zeros(
                1, width, dtype=self.dtype, device=device
            )  # (1, N): 0 for the leaves, b for the sums
            if sums:
                tail = torch.cat([head.sum_bias[name].detach().reshape(-1) for name in self.sum_names])
                self.bias[0, width - tail.shape[0] :] = tail
            self.bias_vec = self.bias.view(-1)  # (N,) for oneDNN
            self.known = head.known_embedding.detach().clone() if cfg.known_byte else None  # E (v, d)
        self.hidden = d
        self.leaf_shape = (n, r, v)
        self.split = (
            [n * r * v] if k == 0 else [n * v, n * r * k]
        )  # leaf blocks of the product, then the sums
        self.split.append(width - sum(self.split))
        self.h_shape, self.base_shape = (n * r, 1, k), (n, 1, v)
        self.sum_split = [math.prod(shapes[name]) for name in self.sum_names]
        self.sum_shapes = [shapes[name] for name in self.sum_names]
        self.rank = r
        dtype = self.dtype
        self.out_dtype = (
            dtype if dtype in (torch.float32, torch.float64) else torch.float32
        )  # as Circuit.normalize

    def params(self, e: Tensor, c: Tensor | None = None) -> dict[str, Tensor]:
        """e (d,), c (1,) or () int the known byte (ignored unless the head has known_byte) ->
        {name: normalised log-parameters (*param_shapes[name])} (= normalize(head(e, c)))."""
        if e.shape != (self.hidden,):
            raise ValueError(
                f"e: the decoder takes one context of shape ({self.hidden},), got {tuple(e.shape)}"
            )
        if e.dtype != self.dtype:
            e = e.to(self.dtype)
        if self.known is not None:
            if c is None or c.numel() != 1 or c.dtype.is_floating_point:
                got = "none" if c is None else f"{c.dtype} {tuple(c.shape)}"
                raise ValueError(f"c: a known-byte head needs the known byte, one integer id; got {got}")
        if self.rowdot and native_cycle_unsupported(e.device, self.dtype) is None:  # one call, same bits
            leaves, sums = head_params(
                e.contiguous(), c if self.known is not None else None, self.known, self.weight, self.bias_vec,
                self.delta_out, self.leaf_shape[0], self.rank, self.leaf_shape[2],
            )  # fmt: skip
            out = {"leaves": leaves}
            for name, t, shape in zip(
                self.sum_names, sums.split(self.sum_split), self.sum_shapes, strict=True
            ):
                out[name] = t.view(shape)
            return out
        if self.known is not None:
            e = e + self.known.index_select(0, c.reshape(1)).view(-1)  # u = e + E[c]
        if self.rowdot:
            y = rowdot_linear(e.unsqueeze(0), self.weight, self.bias_vec).view(
                -1
            )  # (N,) every e-dependent logit
        elif self.onednn:
            y = onednn_linear(e.unsqueeze(0), self.weight, self.bias_vec).view(-1)
        else:
            y = torch.addmm(self.bias, e.unsqueeze(0), self.weight).view(-1)
        if self.delta_out is None:
            leaves, rest = y.split(self.split)
            leaves = leaves.view(self.leaf_shape)
        elif self.rowdot:  # B (A e) + U e in one call, B in its own layout (bf16 storage where exact)
            base, h, rest = y.split(self.split)
            leaves = rowdot_batched(
                h.view(self.h_shape[0], -1), self.delta_out, base.view(self.leaf_shape[0], -1)
            )
            leaves = leaves.view(self.leaf_shape)
        else:
            base, h, rest = y.split(self.split)  # U e (n v), A e (n r k), sums
            leaves = torch.bmm(h.view(self.h_shape), self.delta_out).view(self.leaf_shape)  # B (A e)
            leaves = leaves.add_(base.view(self.base_shape))  # (n, r, v)  + U e, broadcast over components
        if leaves.dtype != self.out_dtype:
            leaves, rest = leaves.to(self.out_dtype), rest.to(self.out_dtype)
        out = {"leaves": leaves.log_softmax(-1)}
        if self.sum_names:
            sums = rest.view(-1, self.rank).log_softmax(-1).view(-1).split(self.sum_split)
            for name, t, shape in zip(self.sum_names, sums, self.sum_shapes, strict=True):
                out[name] = t.view(shape)
        return out

    def draft(
        self,
        e: Tensor,
        prefix: Tensor | None,
        generator: torch.Generator | None = None,
        greedy: bool = False,
        conditionals: bool = True,
    ) -> tuple[Tensor, Tensor | None]:
        """Head + draft for one context e (d,): `circuit._draft(params(e), prefix, ...)` ->
        (window x (n,) int64 with x[:k] = prefix (k,), log q(x_i = . | x_<i) (n, v)).

        prefix: the k bytes the window starts with ([c] in the keep cycle; a known-byte head reads
        prefix[0] as its c) or None (drop cycle);
        generator: the sampling generator (unused when greedy). conditionals=False returns
        (x, None), the same x, without the conditionals (greedy verification does not read them).
        """
        q = self.params(e, None if prefix is None else prefix[:1])
        return self.circuit._draft(q, prefix, generator=generator, greedy=greedy, conditionals=conditionals)


# --- export ---------------------------------------------------------------------------------


RANDOM_INITS = ("reset", "unembedding")


def random_head(
    config: HeadConfig, seed: int = 0, *, device=None, dtype=None, init: str = "reset", sum_std: float = 0.0
) -> MtpcHead:
    """A head with seeded random weights, in eval mode: the one builder of untrained heads
    (`MtpcModel.from_components` with a dict, the benchmarks).

    init "reset": `reset_parameters` drawn from a generator on `device` seeded with `seed`, then
    the sum units' biases N(0, sum_std^2) from it (sum_std > 0 makes cp / hmm / btree differ from
    ff; 0 keeps them uniform). init "unembedding": parameterised like a trained head, from a CPU
    generator: leaves through `init_from_unembeddings` of a random unembedding (std d^-1/2, noise
    0.01), then the sum weights and the App. G delta B drawn N(0, sum_std^2).
    """
    if init not in RANDOM_INITS:
        raise ValueError(f"init: expected one of {RANDOM_INITS}, got {init!r}")
    head = MtpcHead(config, device=device, dtype=dtype)
    with torch.no_grad():
        if init == "reset":
            gen = torch.Generator(device=device or "cpu").manual_seed(int(seed))
            head.reset_parameters(generator=gen)
            if sum_std:
                for name in head.sum_names:
                    head.sum_bias[name].normal_(0.0, sum_std, generator=gen)
        else:
            gen = torch.Generator().manual_seed(int(seed))
            v, d = config.vocab, config.hidden
            head.init_from_unembeddings(torch.randn(v, d, generator=gen) * d**-0.5, noise=0.01, generator=gen)
            for name in head.sum_names:
                head.sum_weight[name].copy_(sum_std * torch.randn(head.sum_weight[name].shape, generator=gen))
            if config.leaf_delta_rank:
                head.leaf_delta_out.copy_(sum_std * torch.randn(head.leaf_delta_out.shape, generator=gen))
            if config.known_byte:
                head.known_embedding.copy_(torch.randn(v, d, generator=gen))
    return head.eval()


def save_head(directory: str | Path, head: MtpcHead, lora_state: dict[str, Tensor] | None = None) -> Path:
    """Write head.safetensors + config.json (+ lora.safetensors when `lora_state` is given).

    Each file is written atomically (`mtpc.atomic`); config.json, written last, records the
    SHA-256 of each tensor file (`sha256`), which `load_head` checks.
    """
    directory = Path(directory).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().contiguous().cpu() for name, t in head.state_dict().items()}
    write_bytes(
        directory / HEAD_FILE, safetensors_bytes(state, metadata={"format_version": str(FORMAT_VERSION)})
    )
    lora_path = directory / LORA_FILE
    if lora_state:
        write_bytes(
            lora_path, safetensors_bytes({k: t.detach().contiguous().cpu() for k, t in lora_state.items()})
        )
    elif lora_path.exists():
        lora_path.unlink()  # a stale adapter from an earlier save must not be picked up
    files = [HEAD_FILE] + ([LORA_FILE] if lora_state else [])
    config = {
        "format_version": FORMAT_VERSION,
        **head.config.to_dict(),
        SHA256_KEY: {name: sha256_file(directory / name) for name in files},
    }
    write_json(directory / CONFIG_FILE, config, indent=2, sort_keys=True)
    return directory


def load_head(
    directory: str | Path, *, device=None, dtype: torch.dtype | None = None, allow_unverified: bool = False
) -> tuple[MtpcHead, dict[str, Tensor] | None]:
    """Read a `save_head` directory -> (head, lora_state or None). No Lightning needed.

    A path that is not a directory raises FileNotFoundError saying so; a directory without the
    export's files, or with bad ones, raises ValueError naming the file. An export whose config.json
    records no `sha256` (written before 2026-12-02, or with the key stripped) is refused unless
    `allow_unverified=True`; `migrate_head(directory)` re-exports such a head with its checksums.

    Every tensor is checked against the shapes the config implies before loading, so a config
    that does not match its tensors fails with a ValueError naming the tensor.
    """
    directory = Path(directory).expanduser()
    if not directory.is_dir():
        what = "is a file, not a directory" if directory.exists() else "does not exist"
        raise FileNotFoundError(
            f"head directory {directory} {what} (a head export is a directory holding "
            f"{CONFIG_FILE} and {HEAD_FILE}, written by save_head or a training run)"
        )
    config_path, head_path = directory / CONFIG_FILE, directory / HEAD_FILE
    for p in (config_path, head_path):
        if not p.is_file():
            raise ValueError(f"{directory}: not a head export, missing {p.name}")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{config_path}: not valid JSON ({err})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{config_path}: expected a JSON object")
    version = raw.pop("format_version", None)
    if version not in FORMAT_VERSIONS or isinstance(version, bool):
        raise ValueError(
            f"{config_path}: format_version {version!r} is not supported; expected one of {FORMAT_VERSIONS}"
        )
    if version == 1 and "known_byte" in raw:  # version 1 predates the option: its heads read e_t alone
        raise ValueError(f"{config_path}: format_version 1 has no known_byte key; expected format_version 2")
    _check_sha256(directory, raw.pop(SHA256_KEY, None), config_path, allow_unverified)
    config = HeadConfig.from_dict(raw, where=str(config_path))
    state = _read_tensors(head_path)
    head = MtpcHead(config, device="meta")
    expected = {name: tuple(t.shape) for name, t in head.state_dict().items()}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{head_path}: tensors do not match {config_path.name} (kind={config.kind}): "
            f"missing {missing}, unexpected {unexpected}"
        )
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise ValueError(
                f"{head_path}: tensor {name!r} has shape {tuple(state[name].shape)}, but {config_path.name} "
                f"(kind={config.kind}, window={config.window}, rank={config.rank}, vocab={config.vocab}, "
                f"hidden={config.hidden}, leaf_delta_rank={config.leaf_delta_rank}, "
                f"known_byte={config.known_byte}) implies {shape}"
            )
    dtype = dtype or next(iter(state.values())).dtype
    _check_finite(state, head_path)
    head = MtpcHead(config, device=device, dtype=dtype)
    head.load_state_dict(state)
    lora_path = directory / LORA_FILE
    lora_state = _read_tensors(lora_path, device) if lora_path.is_file() else None
    if lora_state is not None:
        _check_finite(lora_state, lora_path)
    return head, lora_state


def migrate_head(directory: str | Path) -> Path:
    """Re-export a head in place with the SHA-256s `load_head` checks: for an export written before
    they were recorded (2026-12-02) whose files you trust. Same tensors, atomic writes.

        python -c "from mtpc.heads import migrate_head; migrate_head('runs/<name>/head')"
    """
    head, lora_state = load_head(directory, allow_unverified=True)
    return save_head(directory, head, lora_state)


def _check_sha256(
    directory: Path, digests: object, config_path: Path, allow_unverified: bool = False
) -> None:
    """The tensor files against the SHA-256s config.json records. None (an export from before
    2026-12-02, or one whose key was stripped to pass replaced tensors off as older) is refused
    unless the caller opts in."""
    if digests is None:
        if allow_unverified:
            return
        raise ValueError(
            f"{config_path}: no {SHA256_KEY!r} for the tensor files, so they cannot be verified (an export from "
            "before 2026-12-02, or a stripped one); if you trust its files, re-export it with "
            f"`python -c \"from mtpc.heads import migrate_head; migrate_head('{directory}')\"` "
            "or load it with allow_unverified=True"
        )
    if not isinstance(digests, dict):
        raise ValueError(f"{config_path}: {SHA256_KEY!r} must map file names to SHA-256 digests")
    present = {HEAD_FILE, LORA_FILE} & {p.name for p in directory.iterdir()}
    unlisted = sorted(present - set(digests))
    if unlisted:
        raise ValueError(
            f"{directory / unlisted[0]}: not listed in {config_path.name}'s {SHA256_KEY} (not written "
            "by this export); re-export the head"
        )
    for name, digest in sorted(digests.items()):
        path = directory / str(name)
        if not path.is_file():
            raise ValueError(f"{path}: listed in {config_path.name} but missing; re-export the head")
        if sha256_file(path) != digest:
            raise ValueError(
                f"{path}: SHA-256 differs from the one in {config_path.name} (corrupt or changed "
                "file); re-export the head"
            )


def _check_finite(state: dict[str, Tensor], path: Path) -> None:
    for name, t in state.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(
                f"{path}: tensor {name!r} holds non-finite values (NaN or inf); "
                "the head diverged or the file was damaged: retrain or re-export it"
            )


def _read_tensors(path: Path, device=None) -> dict[str, Tensor]:
    """load_file, but a truncated or corrupt file is a one-line ValueError naming it."""
    try:
        return load_file(str(path), device=str(device) if device is not None else "cpu")
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{path}: not a readable safetensors file ({err}); re-export the head") from None
