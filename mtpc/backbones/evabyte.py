"""EvaByte adapter (EvaByte/EvaByte-SFT, remote code): e_t, STP/MTP unembeddings, the LoRA split.

Tested against EvaByte's own Hugging Face code (tiny random-weight checkpoints written from its
unchanged files; tests/evabyte_real.py). What the adapter uses of that code:

- `model.model` (EvaByteModel): `embed_tokens`, `layers`, `norm`, `rotary_emb(x, seq_len)` -> (cos,
  sin) tables indexed by position, and `_prepare_eva_generation_attn_mask_triton` (the mask tuple of
  a non-multi-byte call on a cache);
- each decoder layer's forward(hidden, attention_mask, position_ids, past_key_value, use_cache, cos,
  sin, multibyte_decoding) -> (hidden, ...), with `self_attn.layer_idx` indexing the cache;
- `model.lm_head`: d -> num_pred_heads * vocab (8 x 320); rows [0, v) are the next-byte (STP)
  head, rows [j v, (j+1) v) predict the byte j+1 positions further;
- its cache `EvaStaticCacheForTriton(batch, heads, window + extra, head_dim, layers, dtype, device)`
  from the modelling module; a multi-byte step (multibyte_decoding=True) writes its keys after the
  current window without committing them; `model.multi_byte_pred_update_cache(cache,
  retrieve_indices, best, n)` commits the first n (and folds a full window into EVA's chunk
  summaries); `_multi_byte_pred_update_cache_when_prefil_len_eq_window_size` after a prefill;
- the multi-byte attention mask (True = attend) over [chunk summaries | window | new bytes].

EvaByte's `forward` insists on `input_ids` and always runs embed -> all layers -> norm, so the
adapter does not call it: it runs the model's own layers (and final norm) itself, the way
`EvaByteModel.forward` does on a cache (the same rotary tables, the same mask objects, the same
cache class), in three segments: trunk [0, L-k) without the final norm, verifier top [L-k, L) +
norm, LoRA draft top (weight-sharing clones of the top layers, renumbered from 0) + norm. Each
segment has its own static cache; the cache routines that walk `config.num_hidden_layers` and
`model.layers` see a shallow copy of the model holding only that segment's layers. An uncached call
is a prefill on fresh caches, which is what EvaByte's own uncached forward does.

Triton: EvaByte's EVA attention has a triton path (`EvaStaticCacheForTriton`, multi-byte steps)
and a pure-PyTorch fallback (`eva_pt_ref.py`, `EvaCache`), chosen by its module's `USE_TRITON_IMPL`.
The fallback cannot take a cached multi-byte step and its cache cannot crop, so without triton the
adapter runs uncached calls and prefills only; a cached step (speculative or plain decoding) is
refused naming triton.

Crop: the static cache cannot forget committed bytes. `EvaByteCache.crop(length)` inside the last
call commits only the kept bytes (the speculative-decoding case); a crop further back marks the
cache for a rebuild (the kept byte history is prefilled again on the next call: exact, slower). A
call that would cross a window boundary is split there (EVA's outputs past the boundary of an
uncommitted step are not exact), so a crop into the first part also rebuilds.

Loading (`prepare_config`, `repair_loaded`, `check_finite`): transformers 5 standardises
`rope_scaling` to `{'rope_type': 'default', ...}` (EvaByte reads `rope_scaling["type"]`) and leaves
the rotary tables that EvaByte builds after `post_init` uninitialised; both are repaired when found
(no-ops on transformers 4), and a probe forward must give finite logits.
Leaves out: EvaByte's own tree (Medusa) decoding.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mtpc.backbones.common import (
    LORA_TARGETS,
    ConfigFacts,
    SplitOutput,
    _DraftTop,
    _shared_clone,
    build_lora_top,
    load_lora_state_dict,
    lora_named_parameters,
    lora_parameters,
)

PROBE = (1, 72 + 64, 105 + 64, 33 + 64)  # <bos> "Hi!": the finite-logits probe of a loaded EvaByte


def modelling_module(model: nn.Module) -> Any:
    return sys.modules.get(type(model).__module__)


def uses_triton(model: nn.Module) -> bool:
    """Whether EvaByte's code runs its triton path (its module's `USE_TRITON_IMPL`)."""
    return bool(getattr(modelling_module(model), "USE_TRITON_IMPL", False))


def prepare_config(config: Any) -> Any:
    """Give EvaByte's `_init_rope` the `rope_scaling` form it reads (None or {'type', 'factor'}).

    transformers >= 5 rewrites it to {'rope_type': 'default', 'rope_theta': ...} (no 'type'); earlier
    versions leave None alone, and then this does nothing.
    """
    rope = getattr(config, "rope_scaling", None)
    if not isinstance(rope, dict) or "type" in rope:
        return config
    kind = rope.get("rope_type")
    if kind in (None, "default"):
        fixed = None
    elif kind in ("linear", "dynamic") and "factor" in rope:
        fixed = {**rope, "type": kind}
    else:
        raise ValueError(
            f"EvaByte config: rope_scaling={rope!r}; its code implements none, 'linear' or 'dynamic'"
        )
    if "rope_parameters" in type(config).__dict__ or hasattr(type(config), "rope_parameters"):
        config.rope_parameters = fixed  # transformers 5: rope_scaling reads rope_parameters
    else:
        config.rope_scaling = fixed
    return config


def repair_loaded(model: nn.Module) -> list[str]:
    """Repair what loading left broken; returns what was repaired (empty where nothing was, e.g. on
    transformers 4): rotary tables left uninitialised (transformers 5 skips the buffers EvaByte builds
    after `post_init`; rebuilt with EvaByte's own rotary class, in the dtype they had), a missing
    `generation_config` (its `multi_byte_generate` reads eos there) and a list `_tied_weights_keys`
    where transformers reads the {target: source} dict form (`save_pretrained` failed)."""
    repaired = []
    for name, rot in model.named_modules():
        if not (
            hasattr(rot, "inv_freq") and hasattr(rot, "_set_cos_sin_cache") and hasattr(rot, "cos_cached")
        ):
            continue
        kw = {"scaling_factor": rot.scaling_factor} if hasattr(rot, "scaling_factor") else {}
        fresh = type(rot)(rot.dim, rot.max_position_embeddings, rot.base, device="cpu", **kw)
        if (
            all(
                torch.equal(getattr(rot, b).cpu(), getattr(fresh, b).to(getattr(rot, b).dtype))
                for b in ("inv_freq", "cos_cached", "sin_cached")
                if getattr(rot, b).shape == getattr(fresh, b).shape
            )
            and rot.cos_cached.shape == fresh.cos_cached.shape
        ):
            continue
        for b in ("inv_freq", "cos_cached", "sin_cached"):
            old = getattr(rot, b)
            rot.register_buffer(b, getattr(fresh, b).to(device=old.device, dtype=old.dtype), persistent=False)
        rot.max_seq_len_cached = fresh.max_seq_len_cached
        repaired.append(f"{name}: rotary tables")
    if (
        getattr(model, "generation_config", None) is None
    ):  # transformers 5: only GenerationMixin models get one
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_model_config(model.config)
        repaired.append("generation_config (multi_byte_generate reads its eos)")
    tied = getattr(model, "_tied_weights_keys", None)
    if isinstance(tied, list) and not getattr(model.config, "tie_word_embeddings", False):
        from transformers import PreTrainedModel

        if hasattr(
            PreTrainedModel, "get_expanded_tied_weights_keys"
        ):  # the {target: source} dict form is read
            model._tied_weights_keys = {}
            repaired.append("_tied_weights_keys")
    return repaired


class EvaByteCache:
    """The three static caches of one decoding stream, its byte history and the pending step."""

    def __init__(self, adapter: EvaByteAdapter):
        self._adapter = adapter
        self.stores: dict[str, Any] | None = None  # segment name -> EvaStaticCacheForTriton
        self.length = 0  # positions fed (committed + pending)
        self.pending: tuple[int, int] | None = None  # (start, count) of the last uncommitted step
        self.history: torch.Tensor | None = None  # (B, length) ids, for rebuilds
        self.rebuild = False

    def crop(self, length: int) -> None:
        """Forget positions >= length in all three caches (commit only the kept part of the last step)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"crop: length={length} must lie in [0, cache.length={self.length}]")
        if length == self.length:
            return
        if self.pending is not None and length >= self.pending[0] and not self.rebuild:
            self._adapter._commit(self, length - self.pending[0])
        else:
            self.rebuild = True
            self.pending = None
        self.length = length
        self.history = self.history[:, :length]


class EvaByteAdapter(ConfigFacts, nn.Module):
    """EvaByte behind the `Backbone` interface (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        lora_depth: int = 0,
        name: str | None = None,
        tokenizer: Any = None,
        lora_rank: int = 16,
        lora_alpha: float | None = None,
        lora_dropout: float = 0.0,
        lora_targets: Sequence[str] = LORA_TARGETS,
        extra_window: int = 256,
        engine: str = "auto",
    ):
        super().__init__()
        inner, cfg = getattr(model, "model", None), getattr(model, "config", None)
        need = [a for a in ("embed_tokens", "layers", "norm", "rotary_emb") if not hasattr(inner, a)] + [
            a for a in ("num_pred_heads", "vocab_size", "window_size", "chunk_size") if not hasattr(cfg, a)
        ]
        if need or not hasattr(model, "lm_head"):
            raise ValueError(
                f"EvaByteAdapter: {type(model).__name__} lacks {need or ['lm_head']}; expected EvaByte's layout"
            )
        module = modelling_module(model)
        self.triton = uses_triton(model)
        self._cache_cls = getattr(module, "EvaStaticCacheForTriton" if self.triton else "EvaCache", None)
        if self._cache_cls is None or not hasattr(model, "multi_byte_pred_update_cache"):
            raise ValueError(
                f"EvaByteAdapter: {type(model).__module__} has no EvaStaticCacheForTriton / EvaCache / "
                "multi_byte_pred_update_cache; expected EvaByte's remote code"
            )
        if engine == "compact":
            raise ValueError("engine='compact' implements Llama only, not EvaByte; use engine='auto' or 'hf'")
        L = len(inner.layers)
        if not isinstance(lora_depth, int) or isinstance(lora_depth, bool) or not 0 <= lora_depth <= L:
            raise ValueError(f"lora_depth={lora_depth!r}: must be an int in [0, num_layers={L}]")
        self.model = model
        self.model.requires_grad_(False)
        self.engine = "hf"  # decoding through its own layers (mtpc.backbones.engine.AdapterEngine)
        self.name = name or getattr(cfg, "_name_or_path", "") or "evabyte"
        self.tokenizer = tokenizer
        self.lora_depth, self.num_layers, self.lora_rank = lora_depth, L, lora_rank if lora_depth else 0
        self.extra_window = extra_window
        split = L - lora_depth
        self.draft_top: _DraftTop | None = None
        self.verify_top: _DraftTop | None = None
        layers: dict[str, list[nn.Module]] = {"trunk": list(inner.layers[:split])}
        if lora_depth:
            top = {}
            for tag in ("verify", "draft"):
                clones = {i: _shared_clone(inner.layers[i], keep=[cfg]) for i in range(split, L)}
                for j, layer in enumerate(clones.values()):
                    layer.self_attn.layer_idx = j  # each top has its own cache, indexed from 0
                top[tag] = clones
            self.verify_top = _DraftTop(top["verify"])
            self.draft_top = build_lora_top(top["draft"], lora_rank, lora_alpha, lora_dropout, lora_targets)
            layers["verify"] = list(self.verify_top.layers.values())
            layers["draft"] = list(self.draft_top.layers.values())
        layers = {tag: ls for tag, ls in layers.items() if ls}
        # views on registered modules (not registered twice): each segment's layers and the
        # shallow model copy EvaByte's cache routines walk
        self.__dict__["_layers"] = layers
        self.__dict__["_segments"] = {tag: self._segment(ls) for tag, ls in layers.items()}

    @classmethod
    def from_hf(
        cls, model: nn.Module, lora_depth: int = 0, name: str | None = None, tokenizer: Any = None, **kw
    ):
        return cls(model, lora_depth=lora_depth, name=name, tokenizer=tokenizer, **kw)

    prepare_config = staticmethod(prepare_config)
    repair_loaded = staticmethod(repair_loaded)

    def without_draft(self) -> EvaByteAdapter:
        """The same weights with lora_depth = 0 (the plain baseline pays for no draft top)."""
        return EvaByteAdapter(self.model, 0, self.name, self.tokenizer, extra_window=self.extra_window)

    def _segment(self, layers: list[nn.Module]) -> nn.Module:
        """A shallow copy of the causal LM whose inner model holds only `layers` (for the cache routines)."""
        cfg = copy.copy(self.model.config)
        cfg.num_hidden_layers = len(layers)
        inner = copy.copy(self.model.model)
        inner.__dict__["_modules"] = dict(self.model.model._modules)
        inner.layers = nn.ModuleList(layers)
        inner.__dict__["config"] = cfg
        seg = copy.copy(self.model)
        seg.__dict__["_modules"] = dict(self.model._modules)
        seg.model = inner
        seg.__dict__["config"] = cfg
        return seg

    # -- facts ----------------------------------------------------------------------------------
    @property
    def config(self):
        return self.model.config

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def hidden_size(self) -> int:
        return self.model.lm_head.weight.shape[1]

    @property
    def device(self) -> torch.device:
        return self.model.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.lm_head.weight.dtype

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.lm_head.weight[: self.vocab_size]  # (v, d): the next-byte head

    def mtp_unembeddings(self) -> torch.Tensor:
        """EvaByte's heads as (m, v, d); [0] is the STP head, [j] predicts the byte j+1 further."""
        return self.model.lm_head.weight.view(self.config.num_pred_heads, self.vocab_size, self.hidden_size)

    def stp_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        bias = self.model.lm_head.bias
        return nn.functional.linear(
            hidden, self.lm_head_weight, None if bias is None else bias[: self.vocab_size]
        )

    # -- compute --------------------------------------------------------------------------------
    def new_cache(self) -> EvaByteCache:
        return EvaByteCache(self)

    def _new_stores(self, batch: int) -> dict[str, Any]:
        if not self.triton:
            return {tag: self._cache_cls() for tag in self._layers}
        cfg = self.config
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        size = cfg.window_size + self.extra_window
        return {
            tag: self._cache_cls(
                batch, cfg.num_attention_heads, size, head_dim, len(ls), self.dtype, self.device
            )
            for tag, ls in self._layers.items()
        }

    def _segment_forward(self, tag, h, ids, mask, pos, stores, multibyte: bool) -> torch.Tensor:
        """One segment's layers on `h`, as EvaByteModel.forward runs them on a cache."""
        inner, store = self.model.model, stores[tag]
        if not multibyte:  # the mask tuple EvaByteModel.forward builds for this cache state
            prep = (
                inner._prepare_eva_generation_attn_mask_triton
                if self.triton
                else inner._prepare_eva_generation_attn_mask
            )
            mask = prep(None, ids, True, store)
        cos, sin = inner.rotary_emb(h, seq_len=int(pos.max()) + 1)
        cos, sin = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
        for layer in self._layers[tag]:
            h = layer(h, attention_mask=mask, position_ids=pos, past_key_value=store, use_cache=True,
                      cos=cos, sin=sin, multibyte_decoding=multibyte)[0]  # fmt: skip
        return h

    def _run(self, ids, mask, pos, stores, multibyte: bool) -> SplitOutput:
        norm = self.model.model.norm
        h = self.model.get_input_embeddings()(ids)
        if "trunk" in self._layers:
            h = self._segment_forward("trunk", h, ids, mask, pos, stores, multibyte)
        if self.lora_depth == 0:
            e = norm(h)
            return SplitOutput(verify_hidden=e, draft_hidden=e)
        verify = norm(self._segment_forward("verify", h, ids, mask, pos, stores, multibyte))
        draft = norm(self._segment_forward("draft", h, ids, mask, pos, stores, multibyte))
        return SplitOutput(verify_hidden=verify, draft_hidden=draft)

    def _commit(self, cache: EvaByteCache, keep: int) -> None:
        """Commit the first `keep` bytes of the pending step in every segment cache."""
        start, count = cache.pending
        idx = torch.arange(count, device=self.device)[None]  # one linear candidate chain
        for tag, store in cache.stores.items():
            cache.stores[tag] = self._segments[tag].multi_byte_pred_update_cache(store, idx, 0, keep)
        cache.pending = None

    def _prefill(self, ids: torch.Tensor, cache: EvaByteCache) -> SplitOutput:
        cache.stores = self._new_stores(ids.shape[0])
        pos = torch.arange(ids.shape[1], device=ids.device)[None]
        out = self._run(ids, None, pos, cache.stores, multibyte=False)
        if self.triton:
            for tag, store in cache.stores.items():
                fix = self._segments[tag]._multi_byte_pred_update_cache_when_prefil_len_eq_window_size
                cache.stores[tag] = fix(store)
        cache.length, cache.history, cache.rebuild, cache.pending = ids.shape[1], ids, False, None
        return out

    def _step(self, ids: torch.Tensor, cache: EvaByteCache) -> SplitOutput:
        """One multi-byte step within the current window; left pending until the next call or crop."""
        cfg, P, T = self.config, cache.length, ids.shape[1]
        n_chunks = (P // cfg.window_size) * (cfg.window_size // cfg.chunk_size)
        w = P % cfg.window_size
        allow = torch.ones(T, n_chunks + w + T, dtype=torch.bool, device=ids.device)
        allow[:, n_chunks + w :] = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
        pos = torch.arange(P, P + T, device=ids.device)[None]
        out = self._run(
            ids, allow[None, None].expand(ids.shape[0], 1, -1, -1), pos, cache.stores, multibyte=True
        )
        cache.pending = (P, T)
        cache.length = P + T
        cache.history = torch.cat([cache.history, ids], 1)
        return out

    def forward(self, input_ids: torch.Tensor, cache: EvaByteCache | None = None) -> SplitOutput:
        if (
            not isinstance(input_ids, torch.Tensor)
            or input_ids.dim() != 2
            or input_ids.dtype.is_floating_point
        ):
            raise ValueError(
                f"input_ids: expected an integer tensor (B, T), got {getattr(input_ids, 'shape', type(input_ids))}"
            )
        past = cache.length if cache is not None else 0
        if past + input_ids.shape[1] > self.max_context:
            raise ValueError(
                f"input: {past} cached + {input_ids.shape[1]} new positions = {past + input_ids.shape[1]} "
                f"exceeds the backbone's max_context={self.max_context}"
            )
        if cache is None:
            return self._prefill(input_ids, EvaByteCache(self))
        if cache.rebuild:
            if cache.length == 0:
                cache.stores, cache.history, cache.rebuild = None, None, False
            else:
                self._prefill(cache.history, cache)
        if cache.pending is not None:
            self._commit(cache, cache.pending[1])
        if cache.length == 0:
            return self._prefill(input_ids, cache)
        if not self.triton:
            raise ValueError(
                "EvaByte without triton: its PyTorch EVA path cannot take cached multi-byte steps or crop, so "
                "decoding on a cache needs triton (a CUDA machine with `pip install triton`)"
            )
        W, outs, start, T = self.config.window_size, [], 0, input_ids.shape[1]
        while start < T:
            n = min(T - start, W - cache.length % W)  # never cross a window boundary in one step
            if outs:
                self._commit(cache, cache.pending[1])
            outs.append(self._step(input_ids[:, start : start + n], cache))
            start += n
        if len(outs) == 1:
            return outs[0]
        return SplitOutput(
            verify_hidden=torch.cat([o.verify_hidden for o in outs], 1),
            draft_hidden=torch.cat([o.draft_hidden for o in outs], 1),
        )

    def check_finite(self, label: str = "evabyte") -> None:
        """A probe forward must give finite logits (else a broken load would decode garbage)."""
        ids = torch.tensor([PROBE], device=self.device) % self.vocab_size
        with torch.no_grad():
            logits = self.stp_logits(self(ids).verify_hidden)
        if not torch.isfinite(logits).all():
            raise ValueError(
                f"backbone {label!r}: a probe forward gives non-finite logits ({int((~torch.isfinite(logits)).sum())} "
                f"of {logits.numel()}); the checkpoint or its loading is broken (dtype {self.dtype}, device {self.device})"
            )

    # -- LoRA -----------------------------------------------------------------------------------
    def lora_parameters(self) -> list[nn.Parameter]:
        return lora_parameters(self.draft_top)

    def lora_state_dict(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in lora_named_parameters(self.draft_top).items()}

    def load_lora_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        load_lora_state_dict(
            self.draft_top, state_dict, f"lora_depth={self.lora_depth}, rank={self.lora_rank}"
        )
