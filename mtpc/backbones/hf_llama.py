"""Backbone adapter for Llama-architecture causal LMs: e_t, STP logits, the LoRA draft/verify split.

`BackboneAdapter` wraps a Hugging Face Llama-like causal LM (`model.model.layers`, `.norm`,
`.rotary_emb`, input embeddings, `lm_head`) and calls its decoder layers itself:

    embed -> layers[0, L-k)            (shared trunk, run once)
          -> layers[L-k, L) -> norm    (verifier top: the model as it is)  -> verify_hidden
          -> layers'[L-k, L) -> norm   (draft top: the same layers + peft LoRA) -> draft_hidden

`verify_hidden` is e_t, the lm_head input (post-final-norm), never `hidden_states[-1]`. The draft
top's modules are shallow clones that share every base weight with the verifier top (no copy of
the weights); peft injects LoRA into the clones only (the draft top holds nothing else), so both tops run on
the same trunk output in one call, each with its own KV cache. With k = 0 the draft reads the
verifier's hidden state. The backbone is frozen; only the LoRA parameters train.

Decoding does not run through `forward` when the compact Llama forward implements the model
(`engine == "compact"`, see llama.py and engine.py): this module then holds the weights and the
LoRA (and trains it); the HF-layer path stays for other architectures and `engine="hf"`.

Caches are plain per-segment key/value stores (`KVStore`, duck-typed as the `Cache.update` that
transformers' attention calls), grouped in `SplitCache` so that `crop` rolls back all three
segments together. Rotary positions are `cache.length + arange(T)`; batch rows share one length
(no left padding). A tokenkit byte Llama (`model.model.expand_embed_tokens`, see tpu_llama.py)
adds its expanded-id embedding, from each row's ids since position 0 (kept in the cache). Leaves
out: the pieces every family shares (`common.py`), EvaByte (`evabyte.py`), loading by name
(`__init__.py`), choosing the family (`registry.py`).
"""

from __future__ import annotations

import inspect
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


class KVStore:
    """Keys/values of one segment of layers, keyed by each attention module's `layer_idx`.

    Duck-types `transformers.Cache.update` (the only method Llama attention calls on its cache).
    """

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}  # layer_idx -> (B, h_kv, S, hd)
        self.values: dict[int, torch.Tensor] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx in self.keys:
            key_states = torch.cat([self.keys[layer_idx], key_states], dim=-2)
            value_states = torch.cat([self.values[layer_idx], value_states], dim=-2)
        self.keys[layer_idx], self.values[layer_idx] = key_states, value_states
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        k = self.keys.get(layer_idx, next(iter(self.keys.values()), None))
        return 0 if k is None else k.shape[-2]

    def crop(self, length: int) -> None:
        for i in list(self.keys):
            self.keys[i] = self.keys[i][..., :length, :]
            self.values[i] = self.values[i][..., :length, :]


class SplitCache:
    """The three caches of one sequence batch: trunk, verifier top, draft top; cropped together."""

    def __init__(self) -> None:
        self.trunk = KVStore()
        self.verify = KVStore()
        self.draft = KVStore()
        self.length = 0  # positions fed so far (same for every segment)
        self.expand: list[Any] | None = (
            None  # per row: the ids fed so far (tokenkit's expanded ids, tpu_llama.py)
        )

    def crop(self, length: int) -> None:
        """Forget every position >= `length` (roll back rejected drafts) in all three caches."""
        if not 0 <= length <= self.length:
            raise ValueError(f"crop: length={length} must lie in [0, cache.length={self.length}]")
        for store in (self.trunk, self.verify, self.draft):
            store.crop(length)
        for state in self.expand or ():
            state.crop(length)
        self.length = length


def _cache_kwarg(layer: nn.Module) -> str:
    """Name under which this transformers version's decoder layer takes its cache."""
    params = inspect.signature(layer.forward).parameters
    for name in ("cache", "past_key_values", "past_key_value"):
        if name in params:
            return name
    raise ValueError(
        f"{type(layer).__name__}.forward takes no cache argument (cache/past_key_values/past_key_value)"
    )


class BackboneAdapter(ConfigFacts, nn.Module):
    """A frozen Llama-architecture causal LM with a shared trunk, a verifier top and a LoRA draft top."""

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
        engine: str = "auto",
    ):
        super().__init__()
        inner = getattr(model, "model", None)
        missing = [a for a in ("layers", "norm", "rotary_emb") if not hasattr(inner, a)]
        if inner is None or missing or model.get_output_embeddings() is None:
            raise ValueError(
                f"from_hf: {type(model).__name__} lacks model.{'/'.join(missing) or 'lm_head'}; expected a "
                "Llama-architecture causal LM (model.model.layers, model.model.norm, model.model.rotary_emb, lm_head)"
            )
        num_layers = len(inner.layers)
        if (
            not isinstance(lora_depth, int)
            or isinstance(lora_depth, bool)
            or not 0 <= lora_depth <= num_layers
        ):
            raise ValueError(f"lora_depth={lora_depth!r}: must be an int in [0, num_layers={num_layers}]")
        if lora_depth > 0 and lora_rank < 1:
            raise ValueError(f"lora_rank={lora_rank}: must be >= 1")
        attn = str(getattr(model.config, "_attn_implementation", "") or "")
        if "flash" in attn:
            raise ValueError(
                f"attn_implementation={attn!r}: the split forward passes an explicit causal mask over "
                "[cached | new] keys, which flash-attention kernels ignore; load with 'sdpa' or 'eager'"
            )
        from mtpc.backbones.engine import resolve_engine_kind

        self.engine = resolve_engine_kind(engine, model)  # the decoding engine: "compact" or "hf"
        self.model = model
        self.model.requires_grad_(False)
        self.name = name or getattr(model.config, "_name_or_path", "") or type(model).__name__
        self.tokenizer = tokenizer
        self.lora_depth = lora_depth
        self.num_layers = num_layers
        self._split = num_layers - lora_depth
        self._cache_kw = _cache_kwarg(inner.layers[0]) if num_layers else "cache"
        self.lora_rank = lora_rank if lora_depth else 0
        self.draft_top: _DraftTop | None = None
        if lora_depth:
            self.draft_top = self._build_draft_top(lora_rank, lora_alpha, lora_dropout, lora_targets)

    @classmethod
    def from_hf(
        cls, model: nn.Module, lora_depth: int = 0, name: str | None = None, tokenizer: Any = None, **lora_kw
    ):
        """Wrap any transformers Llama-architecture causal LM (tiny test models included)."""
        return cls(model, lora_depth=lora_depth, name=name, tokenizer=tokenizer, **lora_kw)

    def without_draft(self) -> BackboneAdapter:
        """The same weights with lora_depth = 0 (the plain baseline pays for no draft top)."""
        if not self.lora_depth:
            return self
        return BackboneAdapter(self.model, 0, self.name, self.tokenizer, engine=self.engine)

    def _build_draft_top(self, rank, alpha, dropout, targets) -> _DraftTop:
        layers = self.model.model.layers
        clones = {
            i: _shared_clone(layers[i], keep=[self.model.config]) for i in range(self._split, self.num_layers)
        }
        return build_lora_top(clones, rank, alpha, dropout, targets)

    # -- facts ----------------------------------------------------------------------------------
    @property
    def config(self):
        return self.model.config

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[1]

    @property
    def device(self) -> torch.device:
        return self.lm_head_weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head_weight.dtype

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight  # (v, d)

    def mtp_unembeddings(self) -> torch.Tensor | None:
        """Built-in multi-token heads' unembeddings (m, v, d); a plain Llama has none."""
        return None

    # -- compute --------------------------------------------------------------------------------
    def new_cache(self) -> SplitCache:
        return SplitCache()

    def stp_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's own lm_head on e_t: (..., d) -> (..., v)."""
        return self.model.get_output_embeddings()(hidden)

    def _check_input(self, input_ids: torch.Tensor, cache: SplitCache | None) -> int:
        if (
            not isinstance(input_ids, torch.Tensor)
            or input_ids.dim() != 2
            or input_ids.dtype.is_floating_point
        ):
            raise ValueError(
                f"input_ids: expected an integer tensor (B, T), got "
                f"{getattr(input_ids, 'dtype', type(input_ids).__name__)} of shape {tuple(getattr(input_ids, 'shape', ()))}"
            )
        past = cache.length if cache is not None else 0
        if past + input_ids.shape[1] > self.max_context:
            raise ValueError(
                f"input: {past} cached + {input_ids.shape[1]} new positions = {past + input_ids.shape[1]} "
                f"exceeds the backbone's max_context={self.max_context}"
            )
        return past

    def _run(self, layers, h, mask, pos, pe, store):
        kw = {self._cache_kw: store, "use_cache": store is not None}
        for layer in layers:
            out = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=pe, **kw)
            h = out[0] if isinstance(out, tuple) else out
        return h

    def forward(self, input_ids: torch.Tensor, cache: SplitCache | None = None) -> SplitOutput:
        """Trunk once, then both tops on its output. input_ids (B, T); appends to `cache` if given."""
        past = self._check_input(input_ids, cache)
        inner = self.model.model
        T = input_ids.shape[1]
        h = self.model.get_input_embeddings()(input_ids)  # (B, T, d)
        expand = getattr(inner, "expand_embed_tokens", None)  # tokenkit's byte Llama (tpu_llama.py)
        if expand is not None:
            states = None
            if cache is not None:
                if cache.expand is None:
                    from mtpc.backbones.tpu_llama import ExpandState

                    cache.expand = [ExpandState(expand.table) for _ in range(input_ids.shape[0])]
                states = cache.expand
            h = h + expand(expand.rows(input_ids, states))
        pos = torch.arange(past, past + T, device=h.device).unsqueeze(0)  # (1, T)
        pe = inner.rotary_emb(h, pos)
        mask = None
        if T > 1:  # additive causal mask over [cached | new] keys; one query needs none
            allowed = torch.arange(past + T, device=h.device)[None, :] <= pos[0, :, None]  # (T, past+T)
            mask = torch.zeros(allowed.shape, dtype=h.dtype, device=h.device)
            mask = mask.masked_fill(~allowed, torch.finfo(h.dtype).min)[None, None]  # (1, 1, T, past+T)
        layers = inner.layers
        h = self._run(layers[: self._split], h, mask, pos, pe, cache.trunk if cache else None)
        hv = self._run(layers[self._split :], h, mask, pos, pe, cache.verify if cache else None)
        verify = inner.norm(hv)
        draft = verify
        if self.draft_top is not None:
            hd = self._run(self.draft_top.layers.values(), h, mask, pos, pe, cache.draft if cache else None)
            draft = inner.norm(hd)
        if cache is not None:
            cache.length = past + T
        return SplitOutput(verify_hidden=verify, draft_hidden=draft)

    # -- LoRA -----------------------------------------------------------------------------------
    def lora_parameters(self) -> list[nn.Parameter]:
        return lora_parameters(self.draft_top)

    def lora_state_dict(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in lora_named_parameters(self.draft_top).items()}

    def load_lora_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        load_lora_state_dict(
            self.draft_top, state_dict, f"lora_depth={self.lora_depth}, rank={self.lora_rank}"
        )
