"""What every backbone family shares: the `Backbone` protocol, `SplitOutput`, `StepOutput`, the LoRA draft top.

A family is one adapter class (`hf_llama.BackboneAdapter` for Llama-architecture models,
`evabyte.EvaByteAdapter` for EvaByte) and one line in `registry.py`; docs/backbones.md lists what
an adapter implements. Adapters import from here, never from each other.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class SplitOutput:
    """Hidden states of one call; both are post-final-norm (lm_head inputs)."""

    verify_hidden: torch.Tensor  # (B, T, d)
    draft_hidden: torch.Tensor  # (B, T, d); the same tensor as verify_hidden when k == 0


@dataclass
class StepOutput:
    """What one engine call (`Engine.feed`) returns for the fed positions; both engines
    (engine.AdapterEngine, llama.LlamaEngine) build it, so it lives below them."""

    p_logits: torch.Tensor  # (T, v) verifier (STP) logits
    draft_hidden: torch.Tensor  # (T, d) input of the head (the verifier's e_t when lora_depth == 0)


@runtime_checkable
class Backbone(Protocol):
    """A frozen byte-level LM split at depth k = `lora_depth` (trunk | verifier top | LoRA draft top).

    Everything its consumers read (the decoding loop and engines, `MtpcModel`, offline acceptance,
    the continuation cache, training, evaluation) is declared here; nothing else may be assumed.
    Both families (`hf_llama.BackboneAdapter`, `evabyte.EvaByteAdapter`) are torch modules that
    satisfy it (tests/mtpc/test_backbone_protocol.py); `ConfigFacts` gives the context length and
    the special ids from the config and tokenizer. `isinstance(x, Backbone)` checks only that the
    names exist, not their types.
    """

    # what it is
    name: str
    """the checkpoint's name or path (or `default@<sha8>`): provenance in head exports and runs"""
    model: nn.Module
    """the wrapped transformers model: the compact engine reads its weights, the cache fingerprints them"""
    config: Any
    """the wrapped model's transformers config"""
    tokenizer: Any
    """the byte tokenizer (`render_prompt`, `decode`, ...)"""
    # shapes
    vocab_size: int
    hidden_size: int
    """d, the width of e_t (the head's input)"""
    num_layers: int
    max_context: int
    """the longest sequence it admits (`max_position_embeddings`)"""
    # the split
    lora_depth: int
    """k: top layers with a LoRA draft copy (0: the draft top is the verifier)"""
    lora_rank: int
    """rank of the draft top's LoRA (0 when k = 0)"""
    draft_top: nn.Module | None
    """the LoRA clones of the top k layers (None when k = 0)"""
    engine: str
    """which decoding engine `make_engine` builds: compact (mtpc's own Llama forward) or hf (its HF layers)"""
    # placement
    device: torch.device
    dtype: torch.dtype
    # special ids
    eos_token_id: int | None
    bos_token_id: int | None
    stop_token_ids: tuple[int, ...]
    """every id that ends a turn: decoding stops on any, "EOS banned" bans all"""
    lm_head_weight: torch.Tensor
    """(v, d): the verifier's unembedding (head initialisation)"""

    def __call__(self, input_ids: torch.Tensor, cache: Any = None) -> SplitOutput:
        """e_t of the verifier and the draft top's hidden state for every fed position; appends to `cache`."""
        ...

    def new_cache(self) -> Any:
        """An empty cache for the three segments; it has `length` and `crop(length)`."""
        ...

    def stp_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-byte logits from e_t: (..., d) -> (..., v)."""
        ...

    def mtp_unembeddings(self) -> torch.Tensor | None:
        """The model's own multi-token heads as (m, v, d) ([0] = next byte), or None."""
        ...

    def without_draft(self) -> Backbone:
        """The same weights with lora_depth = 0 (the plain baseline)."""
        ...

    def lora_parameters(self) -> list[nn.Parameter]: ...

    def lora_state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_lora_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None: ...

    # the torch-module methods training uses (freezing, eval mode)
    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def eval(self) -> Any: ...


def max_context_of(config: Any) -> int:
    """The longest sequence a model config admits (`max_position_embeddings`; unbounded if absent)."""
    return int(getattr(config, "max_position_embeddings", 0) or 2**31 - 1)


def special_token_id(tokenizer: Any, config: Any, name: str) -> int | None:
    """A special id (`eos_token_id`, `bos_token_id`) from the tokenizer, else the model config;
    the first one when a config lists several."""
    tid = getattr(tokenizer, name, None)
    tid = tid if tid is not None else getattr(config, name, None)
    return tid[0] if isinstance(tid, (list, tuple)) else tid


def stop_token_ids(tokenizer: Any, config: Any) -> tuple[int, ...]:
    """Every id that ends generation: the tokenizer's (or config's) eos ids and `<|eot_id|>` when
    the tokenizer has it (Llama-3 chat turns end there), without repeats, eos first."""
    ids: list[int] = []
    for src in (tokenizer, config):
        tid = getattr(src, "eos_token_id", None)
        ids += list(tid) if isinstance(tid, (list, tuple)) else ([tid] if tid is not None else [])
        if ids:
            break
    extra = getattr(tokenizer, "stop_token_ids", None)
    if extra:
        ids += list(extra)
    out: list[int] = []
    for t in ids:
        if isinstance(t, int) and t not in out:
            out.append(t)
    return tuple(out)


class ConfigFacts:
    """The facts a family adapter reads from its HF config and tokenizer (`self.config`,
    `self.tokenizer`): context length and the special ids. Mixed into every adapter."""

    @property
    def max_context(self) -> int:
        return max_context_of(self.config)

    @property
    def eos_token_id(self) -> int | None:
        return special_token_id(self.tokenizer, self.config, "eos_token_id")

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return stop_token_ids(self.tokenizer, self.config)

    @property
    def bos_token_id(self) -> int | None:
        return special_token_id(self.tokenizer, self.config, "bos_token_id")


def _shared_clone(module: nn.Module, keep: Sequence[Any]) -> nn.Module:
    """A copy of `module` whose parameters, buffers and the objects in `keep` are the originals."""
    memo = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    memo.update({id(o): o for o in keep})
    return copy.deepcopy(module, memo)


class _DraftTop(nn.Module):
    """The draft top's layer clones, named `layers.<i>` with the model's own layer indices."""

    def __init__(self, layers: dict[int, nn.Module]):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): layer for i, layer in layers.items()})


def build_lora_top(
    clones: dict[int, nn.Module], rank: int, alpha: float | None, dropout: float, targets
) -> _DraftTop:
    """peft LoRA on the clones of the top layers (named `layers.<i>` by their model indices)."""
    from peft import LoraConfig, inject_adapter_in_model

    draft = _DraftTop(clones)
    present = {n.rsplit(".", 1)[-1] for n, m in draft.named_modules() if isinstance(m, nn.Linear)}
    chosen = [t for t in targets if t in present]
    if not chosen:
        raise ValueError(
            f"lora_targets: none of {list(targets)} is a Linear in the decoder layers ({sorted(present)})"
        )
    # every Linear of the clones is in the top, so no layers_to_transform: peft < 0.15 matches its
    # layers_pattern only below a parent module ("x.layers.3."), never at the root of `draft`
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha if alpha is not None else 2 * rank,
        lora_dropout=dropout,
        target_modules=chosen,
    )
    draft = inject_adapter_in_model(config, draft)
    for n, p in draft.named_parameters():
        p.requires_grad_("lora_" in n)
        if "lora_" in n and p.dtype in (torch.float16, torch.bfloat16):
            p.data = (
                p.data.float()
            )  # trainable adapters in float32 under a half-precision backbone (as peft's get_peft_model)
    return draft


def lora_named_parameters(draft_top: nn.Module | None) -> dict[str, nn.Parameter]:
    if draft_top is None:
        return {}
    return {n: p for n, p in draft_top.named_parameters() if "lora_" in n}


def lora_parameters(draft_top: nn.Module | None) -> list[nn.Parameter]:
    return list(lora_named_parameters(draft_top).values())


def load_lora_state_dict(draft_top: nn.Module | None, state_dict: dict[str, torch.Tensor], what: str) -> None:
    own = lora_named_parameters(draft_top)
    missing, unexpected = sorted(set(own) - set(state_dict)), sorted(set(state_dict) - set(own))
    if missing or unexpected:
        raise ValueError(
            f"load_lora_state_dict: keys differ from this backbone's LoRA ({what}): "
            f"missing {missing[:4]}, unexpected {unexpected[:4]}"
        )
    with torch.no_grad():
        for n, p in own.items():
            if state_dict[n].shape != p.shape:
                raise ValueError(
                    f"load_lora_state_dict: {n} has shape {tuple(state_dict[n].shape)}, expected {tuple(p.shape)}"
                )
            p.copy_(state_dict[n])
