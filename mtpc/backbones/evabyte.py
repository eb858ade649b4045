"""EvaByte adapter (EvaByte/EvaByte-SFT, remote code): e_t, STP/MTP unembeddings, the LoRA split.

UNVERIFIED on the real model: its weights and code cannot be downloaded here. Written against
EvaByte's published module layout and tested against an in-process stand-in with that layout
(tests/evabyte_standin). What the adapter relies on:

- `model.model` (EvaByteModel): `layers`, `norm`, forward(input_ids / inputs_embeds,
  attention_mask, position_ids, past_key_values, use_cache, multibyte_decoding) -> dict with
  `last_hidden_state` (post-final-norm: e_t);
- `model.lm_head`: d -> num_pred_heads * vocab (8 x 320); rows [0, v) are the next-byte (STP)
  head, rows [j v, (j+1) v) predict the byte j+1 positions further;
- its cache `EvaStaticCacheForTriton(batch, heads, window + extra, head_dim, layers, dtype, device)`
  imported by the modelling module; a multi-byte step (multibyte_decoding=True) writes its keys
  after the current window without committing them; `model.multi_byte_pred_update_cache(cache,
  retrieve_indices, best, n)` commits the first n (and folds a full window into EVA's chunk
  summaries); `_multi_byte_pred_update_cache_when_prefil_len_eq_window_size` after a prefill;
- the multi-byte attention mask (True = attend) over [chunk summaries | window | new bytes].

Crop: the static cache cannot forget committed bytes. `EvaByteCache.crop(length)` inside the last
call commits only the kept bytes (the speculative-decoding case); a crop further back marks the
cache for a rebuild (the kept byte history is prefilled again on the next call: exact, slower). A
call that would cross a window boundary is split there (EVA's outputs past the boundary of an
uncommitted step are not exact), so a crop into the first part also rebuilds.

Split at depth k: each segment (trunk [0, L-k) without final norm, verifier top, LoRA draft top)
is a shallow copy of the model whose `layers` are that segment (top layers are weight-sharing
clones renumbered from 0) with its own static cache, as EvaByte's routines index caches by
`config.num_hidden_layers` and `layer_idx`. Leaves out: EvaByte's own tree (Medusa) decoding.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mtpc.backbones.base import (
    LORA_TARGETS,
    SplitOutput,
    _DraftTop,
    _shared_clone,
    build_lora_top,
    load_lora_state_dict,
    lora_named_parameters,
    lora_parameters,
    max_context_of,
    special_token_id,
)


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


class EvaByteAdapter(nn.Module):
    """EvaByte behind the `BackboneAdapter` interface (see the module docstring)."""

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
    ):
        super().__init__()
        inner, cfg = getattr(model, "model", None), getattr(model, "config", None)
        need = [a for a in ("layers", "norm") if not hasattr(inner, a)] + [
            a for a in ("num_pred_heads", "vocab_size", "window_size", "chunk_size") if not hasattr(cfg, a)
        ]
        if need or not hasattr(model, "lm_head"):
            raise ValueError(f"EvaByteAdapter: {type(model).__name__} lacks {need or ['lm_head']}; expected EvaByte's layout")
        module = sys.modules.get(type(model).__module__)
        self._cache_cls = getattr(module, "EvaStaticCacheForTriton", None)
        if self._cache_cls is None or not hasattr(model, "multi_byte_pred_update_cache"):
            raise ValueError(
                f"EvaByteAdapter: {type(model).__module__} has no EvaStaticCacheForTriton / "
                "multi_byte_pred_update_cache; expected EvaByte's remote code"
            )
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
        segments: dict[str, nn.Module | None] = {"trunk": None, "verify": None, "draft": None}
        if lora_depth == 0:
            segments["trunk"] = model
        else:
            if split:
                segments["trunk"] = self._segment(list(inner.layers[:split]), keep_norm=False)
            top = {}
            for tag in ("verify", "draft"):
                clones = {i: _shared_clone(inner.layers[i], keep=[cfg]) for i in range(split, L)}
                for j, layer in enumerate(clones.values()):
                    layer.self_attn.layer_idx = j  # each top has its own cache, indexed from 0
                top[tag] = clones
            self.verify_top = _DraftTop(top["verify"])
            self.draft_top = build_lora_top(top["draft"], lora_rank, lora_alpha, lora_dropout, lora_targets)
            segments["verify"] = self._segment(list(self.verify_top.layers.values()), keep_norm=True)
            segments["draft"] = self._segment(list(self.draft_top.layers.values()), keep_norm=True)
        self.__dict__["_segments"] = segments  # views on registered modules; not registered twice

    @classmethod
    def from_hf(cls, model: nn.Module, lora_depth: int = 0, name: str | None = None, tokenizer: Any = None, **kw):
        return cls(model, lora_depth=lora_depth, name=name, tokenizer=tokenizer, **kw)

    def _segment(self, layers: list[nn.Module], keep_norm: bool) -> nn.Module:
        """A shallow copy of the causal LM whose inner model runs only `layers`."""
        cfg = copy.copy(self.model.config)
        cfg.num_hidden_layers = len(layers)
        inner = copy.copy(self.model.model)
        inner.__dict__["_modules"] = dict(self.model.model._modules)
        inner.layers = nn.ModuleList(layers)
        if not keep_norm:
            inner.norm = nn.Identity()
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
    def max_context(self) -> int:
        return max_context_of(self.config)

    @property
    def eos_token_id(self) -> int | None:
        return special_token_id(self.tokenizer, self.config, "eos_token_id")

    @property
    def bos_token_id(self) -> int | None:
        return special_token_id(self.tokenizer, self.config, "bos_token_id")

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
        return nn.functional.linear(hidden, self.lm_head_weight, None if bias is None else bias[: self.vocab_size])

    # -- compute --------------------------------------------------------------------------------
    def new_cache(self) -> EvaByteCache:
        return EvaByteCache(self)

    def _new_stores(self, batch: int) -> dict[str, Any]:
        cfg = self.config
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        size = cfg.window_size + self.extra_window
        return {
            tag: self._cache_cls(batch, cfg.num_attention_heads, size, head_dim, seg.config.num_hidden_layers, self.dtype, self.device)
            for tag, seg in self._segments.items()
            if seg is not None
        }

    def _run(self, ids, mask, pos, stores, multibyte: bool) -> SplitOutput:
        segs = self._segments

        def call(tag, **inp):
            store = stores.get(tag) if stores is not None else None
            out = segs[tag].model(attention_mask=mask, position_ids=pos, past_key_values=store,
                                  use_cache=store is not None, multibyte_decoding=multibyte, **inp)
            return out["last_hidden_state"]

        if segs["trunk"] is not None:
            h = call("trunk", input_ids=ids)
        else:
            h = self.model.get_input_embeddings()(ids)
        if self.lora_depth == 0:
            return SplitOutput(verify_hidden=h, draft_hidden=h)
        verify = call("verify", input_ids=ids, inputs_embeds=h)
        draft = call("draft", input_ids=ids, inputs_embeds=h)
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
        out = self._run(ids, allow[None, None].expand(ids.shape[0], 1, -1, -1), pos, cache.stores, multibyte=True)
        cache.pending = (P, T)
        cache.length = P + T
        cache.history = torch.cat([cache.history, ids], 1)
        return out

    def forward(self, input_ids: torch.Tensor, cache: EvaByteCache | None = None) -> SplitOutput:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
            raise ValueError(f"input_ids: expected an integer tensor (B, T), got {getattr(input_ids, 'shape', type(input_ids))}")
        past = cache.length if cache is not None else 0
        if past + input_ids.shape[1] > self.max_context:
            raise ValueError(
                f"input: {past} cached + {input_ids.shape[1]} new positions = {past + input_ids.shape[1]} "
                f"exceeds the backbone's max_context={self.max_context}"
            )
        if cache is None:
            pos = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
            return self._run(input_ids, None, pos, None, multibyte=False)
        if cache.rebuild:
            if cache.length == 0:
                cache.stores, cache.history, cache.rebuild = None, None, False
            else:
                self._prefill(cache.history, cache)
        if cache.pending is not None:
            self._commit(cache, cache.pending[1])
        if cache.length == 0:
            return self._prefill(input_ids, cache)
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

    # -- LoRA -----------------------------------------------------------------------------------
    def lora_parameters(self) -> list[nn.Parameter]:
        return lora_parameters(self.draft_top)

    def lora_state_dict(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in lora_named_parameters(self.draft_top).items()}

    def load_lora_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        load_lora_state_dict(self.draft_top, state_dict, f"lora_depth={self.lora_depth}, rank={self.lora_rank}")
