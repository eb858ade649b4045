"""Compact Llama forward for decoding: preallocated KV caches, the 1-byte step and the n-byte verify.

`LlamaEngine` runs a transformers Llama (`LlamaForCausalLM`: the embedded default byte Llama,
Llama-3.2 with `llama3` RoPE scaling) wrapped in a `BackboneAdapter` with its own small forward
in the style of gpt-fast's model.py, reading the adapter's peft LoRA matrices as they are (views)
and the base weights in one of four layouts (`weights=`; None picks "rowdot" where it runs, else
"onednn" where it runs, else "views"): `"views"` multiplies by the HF parameters themselves
(nothing copied unless `lora="merged"`); `"packed"` by one transposed copy with q|k|v and gate|up
side by side (fewer, row-major products); `"onednn"` (CPU, float32 / bf16) by the same groups
reordered once into oneDNN's blocked format and multiplied by oneDNN
(`torch.ops.mkldnn._linear_pointwise`); `"rowdot"` (x86 CPU with AVX2 + FMA, float32) by the same
groups as one contiguous (out, in) copy each, multiplied by mtpc's row-dot kernel
(mtpc/csrc/rowdot.cpp), whose rows come out with the same bits whatever the number of rows in the
call. The copies double the base weights' memory and are rebuilt at `reset` when a source tensor
changed in place. On the 2-core CPU (AMD EPYC, bench_decode's engine section) the row-dot step
and verify cost less than oneDNN's, and oneDNN's less than the views layout's
(docs/decoding.md has the figures). In a fused layout the trunk's layers take fast paths with
fewer calls and the same bits: `_block_one` for the plain step, `_block_rows` for the verify.
The forward:

    embed -> layers[0, L-k)                         trunk, one batch row
          -> layers[L-k, L) on rows [verify, draft] both tops in one pass: one weight read;
             + s * B (A x) on the draft row only    (LoRA as low-rank matmuls beside W)
          -> norm -> lm_head on the verify row      p logits; the draft row is the head's input

Caches: per layer, keys and values of shape (rows, h_kv, C, hd) (rows = 1 in the trunk, 2 in
the top), written in place at positions [length, length + T); `crop(length)` only sets the
length. `static=True` attends over the whole capacity C with one causal-mask row per position
and writes with `index_copy_` at a position tensor: fixed shapes for a given T, what a CUDA graph
captures (`cuda_graphs=True` captures the 1-byte step and the n-byte verify on first use). The
default slices the caches to the live length (views) and skips the mask for one query.
`attention="split_kv"` (static shapes, CUDA with triton; UNVERIFIED on a GPU) runs the static calls
of up to 64 new positions on the split-KV kernel of decode_attention.py instead: it reads the live
length from the position tensor on the device and attends over the live keys only, with no mask.
`fused_ops=True` (static shapes, CUDA with triton; UNVERIFIED on a GPU) runs those static calls'
norms with their residual adds and their RoPE with the cache writes as the Triton kernels of
fused_ops.py (within rounding of the eager ops).

Numerics follow transformers' Llama: RMSNorm in float32 then cast, cos/sin from float32
frequencies cast to the model dtype, sdpa with scale head_dim**-0.5, peft's LoRA dtype rules;
float64 outputs agree with the HF (sdpa) forward to ~1e-13 (tests/mtpc/test_llama_engine.py).
In float32 the packed products round differently from HF's (out, in) ones (~1e-5 on logits of
size ~10), as an n-row product already rounds differently from a 1-row one in either layout;
oneDNN's by ~4e-5 on the default model's logits (tested against HF to 1e-4 in float32: it has
no float64, so the float64 tests run the views layout).

tokenkit's byte Llama (`ExpandedLlamaForCausalLM`, tpu_llama.py) adds its expanded-id embedding:
`feed` computes the new positions' e_t from the ids fed so far (O(maxlen) each, cut at crops).

`llama_unsupported(model)` names the first thing this forward does not implement (another model
class, biases, an activation other than silu, RoPE types other than default / llama3, config
fields it does not know, LoRA variants); `load_backbone` then keeps the HF-layer path. Leaves out:
training (the HF adapter trains the LoRA), batches of several sequences, EvaByte.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F

from mtpc.backbones.common import Backbone, StepOutput
from mtpc.backbones.decode_attention import split_kv_decode_attention, split_kv_unsupported
from mtpc.backbones.fused_ops import fused_ops_unsupported
from mtpc.kernels import (
    onednn_linear,
    onednn_pack,
    rowdot_linear,
    rowdot_unsupported,
    rowdot_weight,
    use_onednn,
    warn_fallback,
)
from mtpc.names import DRAFT_LORA_MODES, ENGINE_ATTENTION, ENGINE_WEIGHT_LAYOUTS

ROPE_TYPES = ("default", "llama3")  # the rotary variants this forward implements
# config keys a saved LlamaConfig may carry beyond LlamaConfig().to_dict() that change nothing here
_HARMLESS_KEYS = {
    "_name_or_path", "architectures", "torch_dtype", "dtype", "transformers_version", "rope_scaling", "rope_theta",
    "_attn_implementation", "_attn_implementation_autoset", "attn_implementation", "use_cache", "pretraining_tp",
    "attention_dropout", "initializer_range", "tie_word_embeddings", "pad_token_id", "bos_token_id", "eos_token_id",
}  # fmt: skip


@dataclass
class LlamaArgs:
    """The shape and numerics of a Llama, read from a transformers config (`from_config`)."""

    vocab: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    norm_eps: float
    rope_theta: float
    max_context: int
    rope_type: str = "default"
    rope_factor: float = 1.0  # llama3 scaling
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max: int = 8192

    @classmethod
    def from_config(cls, config: Any) -> LlamaArgs:
        """Raises ValueError naming the first config field the compact forward does not implement."""
        reason = config_unsupported(config)
        if reason:
            raise ValueError(f"compact Llama forward: {reason}")
        rope = rope_parameters(config)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        args = cls(
            vocab=config.vocab_size, dim=config.hidden_size, n_layers=config.num_hidden_layers,
            n_heads=config.num_attention_heads, n_kv_heads=config.num_key_value_heads or config.num_attention_heads,
            head_dim=head_dim, intermediate=config.intermediate_size, norm_eps=config.rms_norm_eps,
            rope_theta=float(rope["rope_theta"]),
            max_context=int(config.max_position_embeddings), rope_type=rope.get("rope_type", "default"),
        )  # fmt: skip
        if args.rope_type == "llama3":
            args.rope_factor = float(rope["factor"])
            args.rope_low_freq_factor = float(rope["low_freq_factor"])
            args.rope_high_freq_factor = float(rope["high_freq_factor"])
            args.rope_original_max = int(rope["original_max_position_embeddings"])
        return args


def _transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def rope_parameters(config: Any) -> dict[str, Any]:
    """The rotary parameters with rope_theta, as the installed transformers reads them: 5.x's
    `rope_parameters`, or 4.x's `rope_scaling` (None for the default) and `rope_theta`."""
    if _transformers_major() >= 5:
        rope = dict(getattr(config, "rope_parameters", None) or {})
    else:
        rope = dict(getattr(config, "rope_scaling", None) or {})
    if "type" in rope:  # the old spelling of rope_type
        rope.setdefault("rope_type", rope.pop("type"))
    rope.setdefault("rope_theta", float(getattr(config, "rope_theta", None) or 10000.0))
    return rope


def config_unsupported(config: Any) -> str | None:
    """Why the compact forward cannot run this config (one line), or None."""
    from transformers import LlamaConfig

    if getattr(config, "model_type", None) != "llama":
        return f"model_type={getattr(config, 'model_type', None)!r} is not 'llama'"
    checks = (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False))
    for key, want in checks:
        if getattr(config, key, want) != want:
            return f"config field {key}={getattr(config, key)!r} is not implemented (expected {want!r})"
    rope = rope_parameters(config)
    if rope.get("rope_type", "default") not in ROPE_TYPES:
        return f"config field rope_parameters.rope_type={rope.get('rope_type')!r} is not implemented (expected one of {ROPE_TYPES})"
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        return f"config field rope_parameters.partial_rotary_factor={rope['partial_rotary_factor']!r} is not implemented (expected 1.0)"
    known_rope = {
        "rope_type",
        "rope_theta",
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    }
    extra_rope = sorted(set(rope) - known_rope)
    if extra_rope:
        return f"config field(s) rope_parameters.{extra_rope} are not implemented"
    known = set(LlamaConfig().to_dict()) | _HARMLESS_KEYS
    if _transformers_major() < 5:
        known.add("rope_parameters")  # a 5.x config.json read by 4.x: unknown to its Llama, ignored by both
    extra = sorted(k for k in config.to_dict() if k not in known)
    if extra:
        return f"config field(s) {extra} are not implemented by the compact forward"
    return None


def llama_unsupported(model: Any) -> str | None:
    """Why `model` (an HF causal LM) cannot take the compact path (one line), or None."""
    from mtpc.backbones.tpu_llama import ExpandedLlamaForCausalLM

    cls = type(model)
    stock = cls.__name__ == "LlamaForCausalLM" and cls.__module__.startswith("transformers.")
    if not stock and cls is not ExpandedLlamaForCausalLM:
        return f"model class {cls.__module__}.{cls.__name__} is not transformers' LlamaForCausalLM"
    return config_unsupported(model.config)


# ------------------------------------------------------------------------------------ numerics


def rope_inv_freq(args: LlamaArgs) -> Tensor:
    """Inverse frequencies (head_dim / 2,) float32, default or llama3-scaled (as transformers)."""
    dim = args.head_dim
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))
    if args.rope_type == "default":
        return inv
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate smoothly between
    low_wavelen = args.rope_original_max / args.rope_low_freq_factor
    high_wavelen = args.rope_original_max / args.rope_high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / args.rope_factor, inv)
    smooth = (args.rope_original_max / wavelen - args.rope_low_freq_factor) / (
        args.rope_high_freq_factor - args.rope_low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / args.rope_factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_table(args: LlamaArgs, length: int, device, dtype) -> tuple[Tensor, Tensor]:
    """cos, sin (length, head_dim) for positions 0..length-1, in float32 then cast (as transformers)."""
    inv = rope_inv_freq(args).to(device)
    freqs = torch.arange(length, device=device)[:, None].float() * inv[None, :]  # (length, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def signed_sin(sin: Tensor) -> Tensor:
    """[-sin_1, sin_2]: with it, rotate_half(x) * sin == x.roll(hd / 2) * signed_sin (bit for bit)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' LlamaRMSNorm: normalise in float32, cast back, scale.

    For float32 torch's fused rms_norm gives the same bits (checked in the tests); for float64 it
    would stay in float64 and for bf16 it scales before the cast, so the HF steps are spelled out."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def apply_rope(x: Tensor, cos: Tensor, ssin: Tensor) -> Tensor:
    """x (B, h, T, hd), cos / signed_sin (T, hd): HF's rotate-half layout, x cos + rotate_half(x) sin."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * ssin


# ------------------------------------------------------------------------------------ weights


@dataclass
class _Lora:
    a: Tensor  # (r, in) lora_A weight (a view of the peft parameter)
    b: Tensor  # (out, r)
    scale: float


@dataclass
class _Layer:
    """One decoder layer's weights; `lora` (draft row) and `merged` only in the top.

    w: the HF parameters by name (q k v o gate up down: (out, in) views), always kept: the views
    layout multiplies by them, the packed ones were built from them. packed (layouts "packed" and
    "onednn"): group -> one copy of its members side by side (qkv, o, gu, down), so that a group
    is one product whose outputs are column slices: (in, out) contiguous ("packed") or oneDNN's
    blocked format ("onednn"). merged (lora="merged"): group or name -> (2, ...) [W, W + s B A]
    in the layout's orientation ("onednn": a pair of blocked copies)."""

    ln1: Tensor
    ln2: Tensor
    w: dict[str, Tensor]
    lora: dict[str, _Lora]
    merged: dict[str, Any]
    packed: dict[str, Tensor]
    widths: dict[str, list[int]]  # group -> its members' output widths (the packed column split)


_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
# the packed layout's groups: members side by side along the output axis (one product each)
_GROUPS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gu": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


def _peft_lora(module: Any) -> _Lora | None:
    """The LoRA of a peft-wrapped Linear (None for a plain Linear); refuses variants (DoRA, ...)."""
    if not hasattr(module, "lora_A"):
        return None
    names = [n for n in module.active_adapters if n in module.lora_A]
    if len(names) != 1 or getattr(module, "lora_variant", {}) or getattr(module, "merged", False):
        raise ValueError(
            f"compact Llama forward: LoRA module {type(module).__name__} has adapters {names} / a variant; expected one plain LoRA"
        )
    n = names[0]
    return _Lora(module.lora_A[n].weight.detach(), module.lora_B[n].weight.detach(), float(module.scaling[n]))


def _base_weight(module: Any) -> Tensor:
    return getattr(module, "base_layer", module).weight.detach()


def _merge(wt: Tensor, lo: _Lora | None) -> Tensor:
    """W + s B A formed in the wider of the two dtypes (as peft's merge); W itself without a LoRA."""
    if lo is None:
        return wt
    dt = torch.promote_types(wt.dtype, lo.a.dtype)
    return (wt.to(dt) + lo.b.to(dt) @ lo.a.to(dt) * lo.scale).to(wt.dtype)


def _add_lora(y: Tensor, x: Tensor, lo: _Lora) -> None:
    """y[1] += s B (A x[1]) in place: the draft row's LoRA (y may be a column slice of a group)."""
    if lo.a.dtype == y.dtype:  # two BLAS calls
        y[1].addmm_(F.linear(x[1], lo.a), lo.b.t(), alpha=lo.scale)
    else:  # float32 LoRA under a half-precision backbone: peft's casts (result + lora_B(lora_A(x)) * scaling)
        y[1:] += F.linear(F.linear(x[1:].to(lo.a.dtype), lo.a), lo.b) * lo.scale


def _pack(mats: list[Tensor]) -> Tensor:
    """(out_i, in) matrices -> one (in, sum out_i) contiguous copy: x @ it == cat(x W_i^T) bit for bit."""
    return torch.cat(mats, dim=0).t().contiguous()


def _onednn_pack(mats: list[Tensor]) -> Tensor:
    """(out_i, in) matrices -> one oneDNN-blocked copy of cat(W_i): `onednn_linear(x, it)` == cat(x W_i^T)."""
    return onednn_pack(torch.cat(mats, dim=0))


def _rowdot_pack(mats: list[Tensor]) -> Tensor:
    """(out_i, in) matrices -> one contiguous (sum out_i, in) copy, in bf16 storage where every value
    is a bf16 number (`rowdot_weight`): `rowdot_linear(x, it)` == cat(x W_i^T)."""
    return rowdot_weight(torch.cat(mats, dim=0))


_PACKERS = {"packed": _pack, "onednn": _onednn_pack, "rowdot": _rowdot_pack}  # layout -> its group copy


def _layer(hf_layer: Any, draft_layer: Any | None, lora_mode: str, layout: str) -> _Layer:
    attn, mlp = hf_layer.self_attn, hf_layer.mlp
    w = {n: getattr(attn, n).weight.detach() for n in _ATTN} | {
        n: getattr(mlp, n).weight.detach() for n in _MLP
    }
    lora: dict[str, _Lora] = {}
    if draft_layer is not None:
        for n in _ATTN + _MLP:
            mod = getattr(draft_layer.self_attn if n in _ATTN else draft_layer.mlp, n)
            if _base_weight(mod).data_ptr() != w[n].data_ptr():
                raise ValueError(
                    f"compact Llama forward: the draft top's {n} does not share the verifier's weight"
                )
            lo = _peft_lora(mod)
            if lo is not None:
                lora[n] = lo
    pack = _PACKERS.get(layout)
    packed = {g: pack([w[n] for n in ms]) for g, ms in _GROUPS.items()} if pack else {}
    merged: dict[str, Any] = {}
    if lora_mode == "merged" and draft_layer is not None:  # a copy: the draft top's merged weights
        if layout in ("onednn", "rowdot"):  # (verifier, draft) copies: one product per top row
            for g, ms in _GROUPS.items():
                merged[g] = (packed[g], pack([_merge(w[n], lora.get(n)) for n in ms]))
        elif layout == "packed":
            for g, ms in _GROUPS.items():
                merged[g] = torch.stack([packed[g], _pack([_merge(w[n], lora.get(n)) for n in ms])])
        else:
            merged = {n: torch.stack([wt, _merge(wt, lora.get(n))]) for n, wt in w.items()}
    return _Layer(
        hf_layer.input_layernorm.weight.detach(),
        hf_layer.post_attention_layernorm.weight.detach(),
        w,
        lora,
        merged,
        packed,
        {g: [w[n].shape[0] for n in ms] for g, ms in _GROUPS.items()},
    )


# ------------------------------------------------------------------------------------ engine


SPLIT_KV_MAX_ROWS = 64  # attention="split_kv" takes the static calls of at most this many new positions


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


class LlamaEngine:
    """An `Engine` (see engine.py) on the compact Llama forward; one sequence, batch rows = tops.

    adapter: a `BackboneAdapter` over a transformers LlamaForCausalLM (its draft top, if any,
    supplies the LoRA). draft: run the draft top (False: verifier only, for plain decoding).
    static: fixed-shape attention over the whole capacity (default: on CUDA). cuda_graphs:
    capture `feed` per input length T on its first use (CUDA and static only). lora:
    "lowrank" (s B (A x) beside the shared W) or "merged" (a stacked copy [W, W + s B A]).
    compile: run the decoding calls (T <= 64 new positions after a prefill: the 1-byte step, the
    n-byte verify) through torch.compile with static shapes (implies static=True; one graph per
    T, compiled on its first use; on the CPU with inductor's C++ wrapper, which leaves out most
    of the per-kernel Python overhead). The prefill runs eagerly. Fusion rounds differently from
    eager (~1e-6 on float32 logits). Off by default: each T compiles for seconds (needs a C++
    compiler on the CPU).
    weights: "views" (multiply by the HF parameters as they are), "packed" (one transposed, fused
    copy: q|k|v and gate|up as one product each), "onednn" (the same groups in oneDNN's blocked
    format: CPU, float32 / bf16, not with compile) or "rowdot" (the same groups as (out, in)
    copies for the row-dot kernel: x86 CPU with AVX2 + FMA, float32, not with compile); None:
    "rowdot" where it runs, else "onednn" where it runs, else "views". A packed, oneDNN, row-dot
    (or merged) copy doubles the base weights' memory and is rebuilt at `reset` when a source
    tensor changed in place (its version moved).
    attention: "sdpa" (default: torch's attention over the whole capacity with a causal mask in
    the static calls) or "split_kv": the static calls of at most SPLIT_KV_MAX_ROWS new positions
    (the step, the verify; not the prefill) attend with the split-KV Triton kernel over the live
    length, read on the device from the position tensor, so a captured graph replays at any
    length (mtpc/backbones/decode_attention.py). Needs static shapes, CUDA with triton importable
    (or TRITON_INTERPRET=1, the interpreter the tests run on CPU tensors) and float32 / bf16 / fp16;
    not with compile. UNVERIFIED on a GPU: bench/bench_gpu.py is where it is to be measured.
    fused_ops: the same static calls with each layer's norms (the second one with its residual add)
    and its RoPE with the cache writes as one Triton kernel each (mtpc/backbones/fused_ops.py; within
    rounding of the eager ops, so the step and the verify both use them). Needs what split_kv needs;
    UNVERIFIED on a GPU.
    """

    def __init__(
        self,
        adapter: Backbone,
        capacity: int = 0,
        draft: bool = True,
        static: bool | None = None,
        cuda_graphs: bool = False,
        lora: str = "lowrank",
        compile: bool = False,
        weights: str | None = None,
        attention: str = "sdpa",
        fused_ops: bool = False,
    ):
        reason = llama_unsupported(adapter.model)
        if reason:
            raise ValueError(f"compact Llama forward: {reason}; use engine='hf'")
        if lora not in DRAFT_LORA_MODES:
            raise ValueError(f"lora={lora!r}: expected one of {DRAFT_LORA_MODES}")
        if weights is not None and weights not in ENGINE_WEIGHT_LAYOUTS:
            raise ValueError(f"weights={weights!r}: expected one of {ENGINE_WEIGHT_LAYOUTS} or None")
        model = adapter.model
        self.args = LlamaArgs.from_config(model.config)
        self.name = getattr(adapter, "name", "")
        self._model = model
        self.k = adapter.lora_depth if (draft and adapter.lora_depth > 0) else 0
        self.split = self.args.n_layers - self.k
        self._draft_top = adapter.draft_top if self.k else None
        self.lora_mode = lora
        self.embed = model.model.embed_tokens.weight.detach()  # (v, d)
        # tokenkit's byte Llama: + expand_embed_tokens(e_t), e_t from the ids fed so far (tpu_llama.py)
        self.expand = getattr(model.model, "expand_embed_tokens", None)
        self._expand_state = None
        self.device, self.dtype = self.embed.device, self.embed.dtype
        if compile and static is False:
            raise ValueError("compile=True needs static shapes: pass static=True or None")
        auto = weights is None
        # auto: the row-dot kernel where it runs (x86, float32), else oneDNN where it runs, else views
        if auto and not compile and rowdot_unsupported(self.device, self.dtype) is None:
            weights = "rowdot"
        if weights == "rowdot":
            reason = (
                "weights='rowdot' does not combine with compile=True (use views or packed)"
                if compile
                else rowdot_unsupported(self.device, self.dtype)
            )
            if reason:
                raise ValueError(f"compact Llama forward: {reason}")
        elif weights == "onednn" or auto:  # auto: oneDNN's products where they run, else the HF views
            if compile and weights:
                raise ValueError(
                    "compact Llama forward: weights='onednn' does not combine with compile=True (use views or packed)"
                )
            wanted = use_onednn(True if weights else None, self.device, self.dtype, "compact Llama forward")
            weights = "onednn" if wanted and not compile else "views"
        self.layout = weights
        self.layout_fallback: str | None = None  # why the automatic choice fell back to views
        try:
            self._build_weights()
        except RuntimeError as e:  # a oneDNN build that cannot reorder here: the chosen default only
            if not (auto and weights == "onednn"):
                raise
            self.layout, self.layout_fallback = "views", f"{type(e).__name__}: {e}"
            warn_fallback("compact Llama forward", e, "the views layout")
            self._build_weights()
        # the one-row fast path (`_block_one`): fused layouts, layers without LoRA (the trunk)
        self._one_row = self.layout != "views"
        self._mm = {"onednn": onednn_linear, "rowdot": rowdot_linear}.get(self.layout, torch.matmul)
        self._qk_width = (self.args.n_heads + self.args.n_kv_heads) * self.args.head_dim
        self.static = (self.device.type == "cuda" or compile) if static is None else static
        self.cuda_graphs = bool(cuda_graphs and self.static and self.device.type == "cuda")
        if attention not in ENGINE_ATTENTION:
            raise ValueError(f"attention={attention!r}: expected one of {ENGINE_ATTENTION}")
        # the Triton options: static shapes, no compile, and a device / dtype their kernels take
        for option, on, unsupported in (
            ("attention='split_kv'", attention == "split_kv", split_kv_unsupported),
            ("fused_ops=True", fused_ops, fused_ops_unsupported),
        ):
            reason = on and (
                "it needs static shapes (static=True, or None on CUDA) and does not combine with compile"
                if compile or not self.static
                else unsupported(self.device, self.dtype)
            )
            if reason:
                raise ValueError(f"compact Llama forward: {option}: {reason}")
        self.attention = attention
        self.fused_ops = bool(fused_ops)
        self.scale = self.args.head_dim**-0.5
        kw = {"dtype": self.dtype, "device": self.device}
        self._mask_values = (torch.zeros((), **kw), torch.full((), float("-inf"), **kw))  # attend, masked
        self.n_rep = self.args.n_heads // self.args.n_kv_heads
        self.capacity = 0
        self.length = 0
        self.calls = 0
        self._compiled = None
        if compile:  # fixed shapes per T: no dynamic-shape guards, no recompiles as the length grows
            from mtpc.backbones.graphs import compile_static

            self._compiled = compile_static(self._forward, self.device)
        self._graphs: dict[int, Any] = {}  # input length T -> CapturedFn
        self.graph_epoch = 0  # +1 whenever the buffers a captured graph reads are replaced
        self.graph_errors: dict[int, str] = {}
        if capacity:
            self.reset(capacity)

    def _build_weights(self) -> None:
        inner, top = self._model.model, self._draft_top
        self.layers = [
            _layer(
                inner.layers[i],
                top.layers[str(i)] if (top is not None and i >= self.split) else None,
                self.lora_mode,
                self.layout,
            )
            for i in range(self.args.n_layers)
        ]
        self.norm = inner.norm.weight.detach()  # (d,)
        self.lm_head = self._model.get_output_embeddings().weight.detach()  # (v, d)
        pack = _PACKERS.get(self.layout)
        # (d, v), blocked or (v, d): the layout's copy
        self.lm_head_packed = pack([self.lm_head]) if pack else None
        # the row-dot layout holds every base weight in bf16 storage (exact: a bf16 checkpoint loaded to float32)
        copies = [self.lm_head_packed] + [t for L in self.layers for t in L.packed.values()]
        self.bf16_storage = self.layout == "rowdot" and all(t.dtype == torch.bfloat16 for t in copies)
        # what the copies were made from: the base weights (packed), the top's LoRA too (merged)
        merged = any(L.merged for L in self.layers)
        base = [self.lm_head] + [t for L in self.layers for t in L.w.values()]
        lora = [q for L in self.layers for lo in L.lora.values() for q in (lo.a, lo.b)]
        sources = (base if self.layout != "views" or merged else []) + (lora if merged else [])
        self._sources = [(t, t._version, t.data_ptr()) for t in sources]

    def _stale(self) -> bool:
        """A source of a packed / merged copy was changed in place (or replaced) since the copy."""
        return any(t._version != ver or t.data_ptr() != ptr for t, ver, ptr in self._sources)

    # -- state ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def reset(self, capacity: int) -> None:
        """Forget the sequence; (re)allocate the caches if `capacity` positions do not fit."""
        if capacity > self.args.max_context:
            raise ValueError(
                f"capacity={capacity} exceeds the backbone's max_context={self.args.max_context}"
            )
        self.length = 0
        self.calls = 0
        if self.expand is not None:
            from mtpc.backbones.tpu_llama import ExpandState

            self._expand_state = ExpandState(self.expand.table)
        if self._sources and self._stale():
            self._build_weights()
            self._graphs.clear()  # captured graphs read the old copies
            self.graph_epoch += 1
        if capacity <= self.capacity:
            return
        cap = min(_round_up(capacity, 256), self.args.max_context)
        a, kw = self.args, {"device": self.device, "dtype": self.dtype}
        self.kv = [
            (torch.zeros(1 if i < self.split else 2, a.n_kv_heads, cap, a.head_dim, **kw),
             torch.zeros(1 if i < self.split else 2, a.n_kv_heads, cap, a.head_dim, **kw))
            for i in range(a.n_layers)
        ]  # fmt: skip
        self.cos, sin = rope_table(a, cap, self.device, self.dtype)  # (C, hd)
        self.sin = signed_sin(sin)
        self.positions = torch.arange(cap, device=self.device)
        self.capacity = cap
        self._graphs.clear()
        self.graph_epoch += 1

    def crop(self, length: int) -> None:
        """Forget every position >= length (the caches keep their bytes; only the length moves)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"crop: length={length} must lie in [0, length={self.length}]")
        self.length = length

    # -- forward --------------------------------------------------------------------------------
    @torch.inference_mode()
    def feed(self, ids: Tensor) -> StepOutput:
        """Append ids (T,) to every cache; p logits (T, v) and draft hidden (T, d), valid until the next feed."""
        T, start = ids.shape[0], self.length
        self.check_room(start, T)
        eids = None
        if self.expand is not None:  # O(maxlen) per new id; the history before `start` is kept
            eids = torch.tensor(
                self._expand_state.feed(ids.tolist(), start), dtype=torch.long, device=ids.device
            )
        if self.cuda_graphs and start > 0 and T <= 64:  # decoding calls; the prefill runs eagerly
            out = self._graphed(ids, start, eids)
        elif (
            self._compiled is not None and start > 0 and T <= 64
        ):  # start=0: unused with pos, so no int guard
            out = self._compiled(ids, self.positions[start : start + T].clone(), 0, eids)
        elif self.static:
            out = self._forward(ids, self.positions[start : start + T], start, eids)
        else:
            out = self._forward(ids, None, start, eids)
        self.length = start + T
        self.calls += 1
        return out

    def check_room(self, start: int, T: int) -> None:
        """Refuse T new positions after `start` cached ones beyond the caches' capacity (feed and
        the fused cycle, which writes at device positions and cannot check there)."""
        if start + T > self.capacity:
            raise ValueError(
                f"input: {start} cached + {T} new positions exceed the engine's capacity={self.capacity}; "
                "call reset(capacity) with the sequence's full length first"
            )

    def forward_at(self, ids: Tensor, pos: Tensor) -> StepOutput:
        """The static call for ids (T,) at the device positions pos (T,): caches written there,
        `length` and `calls` left to the caller (a cycle captured as one graph,
        mtpc/speculative/fused_cycle.py). Static shapes only; eager (the caller captures it)."""
        if not self.static:
            raise ValueError("forward_at: needs static shapes (LlamaEngine(static=True))")
        return self._forward(ids, pos, 0)

    def _forward(self, ids: Tensor, pos: Tensor | None, start: int, eids: Tensor | None = None) -> StepOutput:
        """pos: (T,) position tensor (static shapes) or None (slice the caches at host ints);
        eids: (T,) expanded ids (tokenkit's byte Llama) or None."""
        T = ids.shape[0]
        x = F.embedding(ids, self.embed)
        if eids is not None:
            x = x + F.embedding(eids, self.expand.weight)
        x = x.unsqueeze(0)  # (1, T, d)
        # a prefill from slot 0 is plain causal attention: SDPA's is_causal skips the masked blocks
        # and builds no (n_rep T, T) mask (checked against the HF forward: tests/mtpc/test_llama_engine.py)
        causal = pos is None and start == 0 and T > 1
        # split-KV attention: the live length from the positions on the device, no mask (static calls only)
        split_kv = self.attention == "split_kv" and pos is not None and T <= SPLIT_KV_MAX_ROWS
        length = pos[-1:] + 1 if split_kv else None
        if split_kv:
            cos, sin = self.cos.index_select(0, pos), self.sin.index_select(0, pos)
            mask = None
        elif pos is None:
            cos, sin = self.cos[start : start + T], self.sin[start : start + T]
            rows = self.positions[start : start + T, None]
            mask = (
                self.positions[None, : start + T] <= rows if T > 1 and not causal else None
            )  # (T, S) causal
        else:
            cos, sin = self.cos.index_select(0, pos), self.sin.index_select(0, pos)
            mask = self.positions[None, :] <= pos[:, None]  # (T, C) causal over the whole capacity
        if mask is not None and self.n_rep > 1:
            mask = mask.repeat(self.n_rep, 1)  # grouped-query rows r*T + t -> mask row t (see _attend)
        if mask is not None:  # additive, once per call: sdpa would convert a bool mask in every layer
            mask = torch.where(mask, self._mask_values[0], self._mask_values[1])
        one = T == 1 and pos is None and self._one_row  # the plain step's fast path (same bits)
        rows = T > 1 and pos is None and not causal and self._one_row  # the verify's (same bits)
        for i, layer in enumerate(self.layers):
            if i == self.split:
                x = x.expand(2, T, x.shape[-1])  # rows: verifier top, draft top (same trunk output)
            if one and i < self.split:
                x = self._block_one(x, layer, self.kv[i], cos[0], sin[0], start)
            elif rows and i < self.split:
                x = self._block_rows(x, layer, self.kv[i], cos, sin, mask, start)
            elif self.fused_ops and pos is not None and T <= SPLIT_KV_MAX_ROWS:
                x = self._block_fused(x, layer, self.kv[i], mask, pos, length)
            else:
                x = self._block(x, layer, self.kv[i], cos, sin, mask, pos, start, causal, length)
        h = rms_norm(x, self.norm, self.args.norm_eps)  # (rows, T, d)
        if self.lm_head_packed is not None:
            logits = self._mm(h[0], self.lm_head_packed)
        else:
            logits = F.linear(h[0], self.lm_head)
        return StepOutput(logits, h[-1])  # (T, v), (T, d)

    def _linear(self, x: Tensor, layer: _Layer, name: str) -> Tensor:
        """views layout: x W^T for one HF name (+ the draft row's LoRA)."""
        if layer.merged:
            return torch.matmul(x, layer.merged[name].transpose(-1, -2))  # (2, T, out)
        y = F.linear(x, layer.w[name])
        lo = layer.lora.get(name)
        if lo is not None:
            _add_lora(y, x, lo)
        return y

    def _group(self, x: Tensor, layer: _Layer, group: str) -> tuple[Tensor, ...]:
        """The outputs of a group's members (q k v / o / gate up / down) for x (rows, T, in)."""
        members = _GROUPS[group]
        if self.layout == "views":
            return tuple(self._linear(x, layer, n) for n in members)
        if not layer.merged:
            y = self._mm(x, layer.packed[group])  # (rows, T, out): one product, column slices below
        elif self.layout in ("onednn", "rowdot"):  # one product per top row, each with its own weights
            y = torch.stack([self._mm(x[0], layer.merged[group][0]), self._mm(x[1], layer.merged[group][1])])
        else:
            y = torch.matmul(x, layer.merged[group])  # (2, T, in) @ (2, in, out): one batched product
        parts = y.split(layer.widths[group], dim=-1)  # column views, one per member
        if not layer.merged:
            for n, part in zip(members, parts, strict=True):
                lo = layer.lora.get(n)
                if lo is not None:
                    _add_lora(part, x, lo)
        return parts

    def _block_one(self, x: Tensor, layer: _Layer, kv, cos: Tensor, sin: Tensor, start: int) -> Tensor:
        """`_block` for one row and one byte in a fused layout (packed / onednn), without a LoRA:
        the same ops on the same values, hence the same bits (tested), minus the generality that
        cost ~10-14 % of the plain step on the CPU. q and k come out of one product side by side,
        so one RoPE covers both; the caches are written at an int position."""
        a, p = self.args, layer.packed
        h = rms_norm(x, layer.ln1, a.norm_eps)
        y = self._mm(h, p["qkv"])  # (1, 1, q | k | v)
        qk = y[..., : self._qk_width].view(a.n_heads + a.n_kv_heads, a.head_dim)
        qk = apply_rope(qk, cos, sin)  # (h + h_kv, hd)
        kc, vc = kv
        kc[0, :, start] = qk[a.n_heads :]
        vc[0, :, start] = y[0, 0, self._qk_width :].view(a.n_kv_heads, a.head_dim)
        end = start + 1
        q = qk[: a.n_heads].view(1, a.n_kv_heads, self.n_rep, a.head_dim)  # the grouped layout (see _block)
        o = F.scaled_dot_product_attention(q, kc[:, :, :end], vc[:, :, :end], scale=self.scale)
        return self._out_and_mlp(x, layer, o.reshape(1, 1, a.n_heads * a.head_dim))

    def _out_and_mlp(self, x: Tensor, layer: _Layer, o: Tensor) -> Tensor:
        """The fast paths' end of a layer: x + o W_o, then the MLP's residual (fused layouts, no LoRA)."""
        p = layer.packed
        x = x + self._mm(o, p["o"])
        h = rms_norm(x, layer.ln2, self.args.norm_eps)
        g, u = self._mm(h, p["gu"]).split(self.args.intermediate, dim=-1)
        return x + self._mm(F.silu(g) * u, p["down"])

    def _block_rows(
        self, x: Tensor, layer: _Layer, kv, cos: Tensor, sin: Tensor, mask: Tensor | None, start: int
    ) -> Tensor:
        """`_block` for T > 1 new bytes after cached ones (the verify) in a fused layout, without a
        LoRA: the same ops on the same values, hence the same bits (tested), in fewer calls. As in
        `_block_one`, q and k come out of one product side by side and take one RoPE (cos / sin
        (T, hd) broadcast over the heads); the caches are written at int positions."""
        a, p = self.args, layer.packed
        T, end = x.shape[1], start + x.shape[1]
        h = rms_norm(x, layer.ln1, a.norm_eps)
        y = self._mm(h, p["qkv"])[0]  # (T, q | k | v)
        qk = y[:, : self._qk_width].unflatten(-1, (a.n_heads + a.n_kv_heads, a.head_dim))
        qk = apply_rope(qk, cos[:, None], sin[:, None])  # (T, h + h_kv, hd)
        kc, vc = kv
        kc[0, :, start:end] = qk[:, a.n_heads :].transpose(0, 1)
        vc[0, :, start:end] = y[:, self._qk_width :].unflatten(-1, (a.n_kv_heads, a.head_dim)).transpose(0, 1)
        # grouped queries (see _attend): head g n_rep + r of the group g is row r T + t
        q = qk[:, : a.n_heads].transpose(0, 1).reshape(1, a.n_kv_heads, self.n_rep * T, a.head_dim)
        o = F.scaled_dot_product_attention(
            q, kc[:, :, :end], vc[:, :, :end], attn_mask=mask, scale=self.scale
        )
        o = o.reshape(a.n_heads, T, a.head_dim).transpose(0, 1).reshape(1, T, a.n_heads * a.head_dim)
        return self._out_and_mlp(x, layer, o)

    def _block(self, x, layer, kv, cos, sin, mask, pos, start, causal=False, length=None):
        B, T, _ = x.shape
        a = self.args
        h = rms_norm(x, layer.ln1, a.norm_eps)
        q, k, v = self._group(h, layer, "qkv")
        if T == 1:  # one query: (B, 1, h hd) already is the grouped layout (B, h_kv, n_rep, hd), a view
            q = q.view(B, a.n_kv_heads, self.n_rep, a.head_dim)
            k, v = (t.view(B, a.n_kv_heads, 1, a.head_dim) for t in (k, v))
        else:
            q = q.reshape(B, T, a.n_heads, a.head_dim).transpose(1, 2)  # (B, h, T, hd)
            k, v = (
                t.reshape(B, T, a.n_kv_heads, a.head_dim).transpose(1, 2) for t in (k, v)
            )  # (B, h_kv, T, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        kc, vc = kv
        if pos is None:
            end = start + T
            kc[:, :, start:end] = k
            vc[:, :, start:end] = v
            kc, vc = kc[:, :, :end], vc[:, :, :end]  # (B, h_kv, S, hd) views
        else:
            kc.index_copy_(2, pos, k)
            vc.index_copy_(2, pos, v)
        if length is not None:  # the split-KV kernel: q (B, h, T, hd) (for T = 1 the grouped layout is one)
            qh = q.reshape(B, a.n_heads, T, a.head_dim)
            y = split_kv_decode_attention(qh, kc, vc, length, scale=self.scale)  # a (B, T, h, hd) buffer
            y = y.transpose(1, 2).reshape(B, T, a.n_heads * a.head_dim)  # so this is a view
        elif T == 1:
            y = F.scaled_dot_product_attention(
                q, kc, vc, attn_mask=mask, scale=self.scale
            )  # (B, h_kv, n_rep, hd)
            y = y.reshape(
                B, 1, a.n_heads * a.head_dim
            )  # a view where SDPA's output is contiguous (CPU); CUDA's need not be
        else:
            y = self._attend(q, kc, vc, mask, causal).transpose(1, 2).reshape(B, T, a.n_heads * a.head_dim)
        (o,) = self._group(y, layer, "o")
        x = x + o
        h = rms_norm(x, layer.ln2, a.norm_eps)
        g, u = self._group(h, layer, "gu")
        (down,) = self._group(F.silu(g) * u, layer, "down")
        return x + down

    def _block_fused(self, x, layer, kv, mask, pos, length):
        """`_block` for a static call (positions on the device) with the fused Triton ops
        (`fused_ops=True`): the first norm, RoPE of q and k with the cache writes, and the residual
        add with the second norm, one kernel each; the products and the attention as in `_block`."""
        from mtpc.backbones.fused_ops import add_rms_norm, rope_cache_write

        B, T, _ = x.shape
        a = self.args
        _, h = add_rms_norm(x, None, layer.ln1, a.norm_eps)
        q, k, v = self._group(h, layer, "qkv")
        kc, vc = kv
        q = rope_cache_write(q, k, v, self.cos, self.sin, pos, kc, vc, a.n_heads, a.n_kv_heads, a.head_dim)
        if length is not None:  # (B, h, T, hd) -> the split-KV kernel's (B, T, h, hd) buffer
            y = split_kv_decode_attention(q, kc, vc, length, scale=self.scale)
            y = y.transpose(1, 2).reshape(B, T, a.n_heads * a.head_dim)
        elif T == 1:  # one query: (B, h, 1, hd) is the grouped layout (B, h_kv, n_rep, hd)
            q = q.view(B, a.n_kv_heads, self.n_rep, a.head_dim)
            y = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, scale=self.scale)
            y = y.reshape(B, 1, a.n_heads * a.head_dim)
        else:
            y = self._attend(q, kc, vc, mask).transpose(1, 2).reshape(B, T, a.n_heads * a.head_dim)
        (o,) = self._group(y, layer, "o")
        x, h = add_rms_norm(x, o, layer.ln2, a.norm_eps)
        g, u = self._group(h, layer, "gu")
        (down,) = self._group(F.silu(g) * u, layer, "down")
        return x + down

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool = False) -> Tensor:
        if causal:  # queries and keys both start at slot 0 (a prefill): no mask tensor
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.scale, enable_gqa=self.n_rep > 1
            )
        if self.n_rep == 1:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        # grouped queries: the n_rep query heads of a group attend to its one key head as n_rep * T rows
        B, H, T, hd = q.shape
        qg = q.reshape(B, self.args.n_kv_heads, self.n_rep * T, hd)
        y = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=self.scale)
        return y.reshape(B, H, T, hd)  # SDPA's output need not be contiguous (CUDA kernels)

    # -- CUDA graphs (unverified here: no GPU) ---------------------------------------------------
    def _graphed(self, ids: Tensor, start: int, eids: Tensor | None = None) -> StepOutput:
        """Replay the graph of this input length (captured on first use; eager if capture failed)."""
        from mtpc.backbones.graphs import CapturedFn

        T, pos = ids.shape[0], self.positions[start : start + ids.shape[0]]
        inputs = (ids, pos) if eids is None else (ids, pos, eids)
        if T not in self._graphs and T not in self.graph_errors:

            def fn(ids_buf, pos_buf, eids_buf=None):
                out = self._forward(ids_buf, pos_buf, 0, eids_buf)
                return out.p_logits, out.draft_hidden

            try:  # the warm-up and capture write this call's own keys/values at pos: idempotent
                self._graphs[T] = CapturedFn(fn, inputs)
            except Exception as e:  # noqa: BLE001 - any capture failure: run eagerly, say why
                self.graph_errors[T] = f"{type(e).__name__}: {e}"
        if T in self._graphs:
            return StepOutput(*self._graphs[T](*inputs))
        return self._forward(ids, pos, start, eids)
