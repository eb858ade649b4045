"""tokenkit's byte Llama (`model_type: tpu_llama`, e.g. Llama3-2-3B-IT-Byte) loaded natively, without its code.

tokenkit exports byte models as `TPULlamaForCausalLM` with an `auto_map` to its own modelling file.
Apart from one addition the architecture is transformers' Llama, with the same weight names; so
`load_tpu_llama` builds a `LlamaConfig` from the checkpoint's config.json (every `TPULlamaConfig`
field implemented or refused with a one-line error, `tpu_llama_config`), loads the weights by
name from its safetensors and runs none of the checkpoint's Python code.

The addition is `expand_input_ids`: each position's input embedding is

    embed_tokens(byte_t) + expand_embed_tokens(e_t)

where e_t is read off the last `expand_input_ids_maxlen` ids as tokenkit's `torch_expand_input_ids`
does. Its dictionary maps *reversed* id sequences (most recent first, each id + 1, written "a,b,c")
to an expanded id + 1; a second list names the ids (+ 1) whose single-id entry is used as it is.
For position t: if id_t + 1 is in that list, e_t = dict[(id_t + 1,)] - 1; else e_t is the value - 1
of the longest key that is a prefix of (id_t + 1, id_{t-1} + 1, ..., id_{t-maxlen+1} + 1) (ids
before the sequence start do not exist), and 0 when no key matches. Padding is not special: a pad
id in the history is a byte like any other (tokenkit does the same).

`ExpandTable` stores the keys as a trie over reversed ids, so e_t costs O(maxlen) dict look-ups;
`ExpandState` keeps one sequence's ids and expanded ids, so the compact engine and the HF-layer
adapter compute them incrementally: a prefill, a 1-byte step, an n-byte verify (a drafted byte's
e_t depends on the drafts before it) and a crop (the history is cut with the caches).
`ExpandedLlamaForCausalLM` is the transformers Llama with the table attached as
`model.expand_embed_tokens` (tokenkit's weight name); its own `forward` adds the embedding too, so a
direct call gives the model's logits. Leaves out: tokenkit's training code (JAX), flash attention.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from transformers import LlamaConfig, LlamaForCausalLM

MODEL_TYPE = "tpu_llama"
EXPAND_WEIGHT = "model.expand_embed_tokens.weight"
ROPE_TYPES = ("default", "llama3")

#: TPULlamaConfig's fields carried over to LlamaConfig as they are
_LLAMA_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
    "use_cache", "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings", "attention_bias",
    "attention_dropout", "mlp_bias", "head_dim",
)  # fmt: skip
#: fields that change nothing in a forward pass (bookkeeping of PretrainedConfig and the exporter)
_BOOKKEEPING = {
    "model_type", "architectures", "auto_map", "torch_dtype", "dtype", "transformers_version", "_name_or_path",
    "keys_to_ignore_at_inference", "return_dict", "output_hidden_states", "output_attentions", "use_return_dict",
    "tokenizer_class", "_attn_implementation_autoset", "is_encoder_decoder", "is_decoder", "add_cross_attention",
    "tie_encoder_decoder", "chunk_size_feed_forward", "problem_type", "id2label", "label2id", "prefix",
    "sep_token_id", "decoder_start_token_id", "task_specific_params", "finetuning_task", "torchscript",
    "pruned_heads", "cross_attention_hidden_size", "tf_legacy_loss", "use_bfloat16", "_commit_hash",
}  # fmt: skip
_EXPAND_FIELDS = (
    "expand_input_ids",
    "expand_input_ids_maxlen",
    "expand_input_ids_vocab_size",
    "expand_input_ids_dict",
)


def _transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def is_tpu_llama(raw: dict[str, Any] | None) -> bool:
    """True for a tokenkit byte Llama's raw config.json dict (loaded natively, no remote code)."""
    return isinstance(raw, dict) and raw.get("model_type") == MODEL_TYPE


# ------------------------------------------------------------------------------------ expansion


class ExpandTable:
    """tokenkit's expand dictionary as a trie over reversed ids (+ 1), with the direct-id list.

    raw: config.json's `expand_input_ids_dict` = [{"a,b,c": value}, [ids]]; maxlen: how many recent
    ids a key may span; size: `expand_input_ids_vocab_size` (every value - 1 must index it).
    """

    def __init__(self, raw: Any, maxlen: int, size: int, where: str = "expand_input_ids_dict"):
        if not (isinstance(raw, (list, tuple)) and len(raw) == 2 and isinstance(raw[0], dict)):
            raise ValueError(f"{where}: expected [{{'a,b,...': id}}, [ids]], got {type(raw).__name__}")
        if not (isinstance(maxlen, int) and maxlen >= 1) or not (isinstance(size, int) and size >= 1):
            raise ValueError(
                f"{where}: expand_input_ids_maxlen={maxlen!r} and _vocab_size={size!r} must be ints >= 1"
            )
        self.maxlen, self.size = maxlen, size
        self._child: dict[tuple[int, int], int] = {}  # (node, id + 1) -> node
        self._value: list[int] = [0]  # node -> stored value (0: no key ends here; root = the empty key)
        self.entries = 0
        for key, value in raw[0].items():
            syms = tuple(int(n) for n in key.split(",")) if key else ()
            if not (isinstance(value, int) and 1 <= value <= size):
                raise ValueError(
                    f"{where}: key {key!r} maps to {value!r}; expected an int in [1, {size}] (id + 1)"
                )
            if not syms:
                continue  # tokenkit never looks the empty key up
            node = 0
            for s in syms:
                nxt = self._child.get((node, s))
                if nxt is None:
                    nxt = self._child[(node, s)] = len(self._value)
                    self._value.append(0)
                node = nxt
            self._value[node] = value
            self.entries += 1
        self.direct = {int(n) for n in raw[1]}
        missing = sorted(n for n in self.direct if not self._value[self._child.get((0, n), 0)])
        if missing:  # tokenkit would raise KeyError at the first such id
            raise ValueError(f"{where}: direct ids (+1) {missing[:4]} have no single-id key")

    def expanded_id(self, ids: list[int], t: int) -> int:
        """e_t for position t of `ids` (only ids[t - maxlen + 1 .. t] are read)."""
        first = ids[t] + 1
        if first in self.direct:
            return self._value[self._child[(0, first)]] - 1
        node, best, stop = 0, 0, max(t - self.maxlen, -1)
        for j in range(t, stop, -1):
            node = self._child.get((node, ids[j] + 1), -1)
            if node < 0:
                break
            if self._value[node]:
                best = self._value[node]
        return best - 1 if best else 0

    def expand(self, ids: list[int]) -> list[int]:
        """e_t for every position of a sequence that starts at `ids[0]`."""
        return [self.expanded_id(ids, t) for t in range(len(ids))]


class ExpandState:
    """One sequence's ids and expanded ids, extended as it is fed and cut when it is cropped."""

    def __init__(self, table: ExpandTable):
        self.table = table
        self.ids: list[int] = []
        self.eids: list[int] = []

    def feed(self, new: list[int], start: int | None = None) -> list[int]:
        """Append `new` at position `start` (default: the end; later positions are forgotten); their e_t."""
        if start is not None:
            self.crop(start)
        t0 = len(self.ids)
        self.ids.extend(new)
        out = [self.table.expanded_id(self.ids, t) for t in range(t0, len(self.ids))]
        self.eids.extend(out)
        return out

    def crop(self, length: int) -> None:
        if not 0 <= length <= len(self.ids):
            raise ValueError(f"crop: length={length} must lie in [0, {len(self.ids)}]")
        del self.ids[length:], self.eids[length:]


class ExpandEmbedding(nn.Module):
    """`expand_embed_tokens`: the embedding of expanded ids, with the table that computes them."""

    def __init__(self, weight: Tensor, table: ExpandTable):
        super().__init__()
        if weight.shape[0] != table.size:
            raise ValueError(
                f"{EXPAND_WEIGHT}: {weight.shape[0]} rows, config says expand_input_ids_vocab_size={table.size}"
            )
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.table = table

    def forward(self, eids: Tensor) -> Tensor:
        return F.embedding(eids, self.weight)

    def rows(self, input_ids: Tensor, states: list[ExpandState] | None = None) -> Tensor:
        """Expanded ids (B, T) for input_ids (B, T): appended to `states` (one per row), else from position 0."""
        rows = input_ids.tolist()
        if states is None:
            out = [self.table.expand(r) for r in rows]
        else:
            out = [s.feed(r) for s, r in zip(states, rows, strict=True)]
        return torch.tensor(out, dtype=torch.long, device=input_ids.device).view(input_ids.shape)


class ExpandedLlamaForCausalLM(LlamaForCausalLM):
    """transformers' Llama plus tokenkit's expanded-id input embedding (`model.expand_embed_tokens`).

    `forward(input_ids, past_input_ids=None, ...)`: as tokenkit's, the expanded ids of the new ids
    are read off `past_input_ids` (the whole history, new ids last) when given, else off input_ids.
    """

    _keys_to_ignore_on_load_unexpected = [r"model\.expand_embed_tokens\.weight"]  # loaded by load_tpu_llama

    @property
    def expand(self) -> ExpandEmbedding | None:
        return getattr(self.model, "expand_embed_tokens", None)

    def forward(self, input_ids=None, *args, past_input_ids=None, inputs_embeds=None, **kw):
        expand = self.expand
        if expand is not None and input_ids is not None and inputs_embeds is None:
            T = input_ids.shape[1]
            past = kw.get("past_key_values")
            if past_input_ids is None and past is not None and past.get_seq_length() > 0:
                raise ValueError(
                    "ExpandedLlamaForCausalLM: a call with a cache needs past_input_ids (the whole history)"
                )
            hist = past_input_ids if past_input_ids is not None else input_ids
            eids = expand.rows(hist)[:, -T:]
            inputs_embeds = self.model.embed_tokens(input_ids) + expand(eids)
            input_ids = None
        return super().forward(input_ids, *args, inputs_embeds=inputs_embeds, **kw)


# ------------------------------------------------------------------------------------ loading


def tpu_llama_config(
    raw: dict[str, Any], where: str = "tpu_llama"
) -> tuple[LlamaConfig, dict[str, Any] | None]:
    """(LlamaConfig, expand fields or None) for a TPULlamaConfig dict; ValueError names a field it cannot run."""
    if not is_tpu_llama(raw):
        raise ValueError(f"{where}: model_type={raw.get('model_type')!r}, expected {MODEL_TYPE!r}")
    known = set(_LLAMA_FIELDS) | _BOOKKEEPING | set(_EXPAND_FIELDS) | {
        "rope_theta", "rope_scaling", "pretraining_tp", "add_qk_norm", "skip_out_norm",
    }  # fmt: skip
    extra = sorted(k for k in raw if k not in known)
    if extra:
        raise ValueError(f"{where}: config field(s) {extra} are not implemented (unknown to TPULlamaConfig)")
    for key in ("add_qk_norm", "skip_out_norm"):  # declared by TPULlamaConfig, ignored by its modelling code
        if raw.get(key, False):
            raise ValueError(
                f"{where}: config field {key}={raw[key]!r} is not implemented (tokenkit's modelling code ignores it)"
            )
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(
            f"{where}: config field hidden_act={raw['hidden_act']!r} is not implemented (expected 'silu')"
        )
    tp = raw.get("pretraining_tp", 1)
    if not (isinstance(tp, int) and tp >= 1):  # tp > 1 only splits tokenkit's products: the same sums
        raise ValueError(f"{where}: config field pretraining_tp={tp!r}; expected an int >= 1")
    rope = dict(raw.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"{where}: config field rope_scaling.rope_type={rope_type!r} is not implemented (expected one of {ROPE_TYPES})"
        )
    kw = {k: raw[k] for k in _LLAMA_FIELDS if k in raw}
    theta = float(raw.get("rope_theta", 10000.0))
    rope = {k: v for k, v in rope.items() if k != "type"} | {"rope_type": rope_type}
    if _transformers_major() >= 5:
        kw["rope_parameters"] = {**rope, "rope_theta": theta}
    else:
        kw["rope_theta"], kw["rope_scaling"] = theta, (rope if rope_type != "default" else None)
    config = LlamaConfig(**kw)
    expand = None
    if raw.get("expand_input_ids", False):
        expand = {k: raw.get(k) for k in _EXPAND_FIELDS}
    return config, expand


def _safetensors_files(source: str, revision: str | None) -> list[str]:
    from transformers.utils import cached_file

    kw = {"revision": revision, "_raise_exceptions_for_missing_entries": False}
    index = cached_file(source, "model.safetensors.index.json", **kw)
    if index:
        shards = sorted(set(json.loads(Path(index).read_text())["weight_map"].values()))
        return [cached_file(source, s, revision=revision) for s in shards]
    single = cached_file(source, "model.safetensors", **kw)
    if not single:
        raise ValueError(
            f"tpu_llama {source!r}: no model.safetensors (or index) found; expected tokenkit's safetensors export"
        )
    return [single]


def load_tpu_llama(
    source: str, raw: dict[str, Any], revision: str | None = None, **from_pretrained_kw: Any
) -> ExpandedLlamaForCausalLM:
    """The checkpoint at `source` as an `ExpandedLlamaForCausalLM` (weights by name; no remote code).

    raw: its config.json dict; from_pretrained_kw: dtype / torch_dtype, attn_implementation.
    """
    from safetensors import safe_open

    config, expand = tpu_llama_config(raw, where=f"tpu_llama {source!r}")
    kw = {k: v for k, v in from_pretrained_kw.items() if k != "trust_remote_code"}
    model = ExpandedLlamaForCausalLM.from_pretrained(source, config=config, revision=revision, **kw)
    if expand is not None:
        table = ExpandTable(
            expand["expand_input_ids_dict"], expand["expand_input_ids_maxlen"], expand["expand_input_ids_vocab_size"],
            where=f"tpu_llama {source!r}: expand_input_ids_dict",
        )  # fmt: skip
        weight = None
        for f in _safetensors_files(source, revision):
            with safe_open(f, framework="pt") as st:
                if EXPAND_WEIGHT in st.keys():
                    weight = st.get_tensor(EXPAND_WEIGHT)
        if weight is None:
            raise ValueError(
                f"tpu_llama {source!r}: expand_input_ids=true but the safetensors lack {EXPAND_WEIGHT}"
            )
        emb = model.model.embed_tokens.weight
        model.model.expand_embed_tokens = ExpandEmbedding(weight.to(emb.dtype), table).to(emb.device)
    return model
