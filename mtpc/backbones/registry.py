"""Which adapter wraps a model: one table keyed by the config's `model_type`.

`FAMILIES[model_type]` names the adapter class as "module:Class" (imported on first use, so the
families never import each other); a model_type not listed takes `DEFAULT` (the HF-layer Llama
adapter, which checks the layout it needs). Adding a family = its adapter file + one line here.
An adapter class provides:
- `from_hf(model, lora_depth=..., name=..., tokenizer=..., engine=..., **lora_kw)` -> a `Backbone`
  (common.py) wrapping a loaded transformers model;
- optionally `prepare_config(config) -> config` (repairs before the weights are loaded),
  `repair_loaded(model) -> list[str]` (repairs after) and, on the adapter, `check_finite(label)`
  (a probe forward that must give finite logits), all used by `load_backbone`.
"""

from __future__ import annotations

import importlib
from typing import Any

DEFAULT = "mtpc.backbones.hf_llama:BackboneAdapter"
FAMILIES: dict[str, str] = {
    "evabyte": "mtpc.backbones.evabyte:EvaByteAdapter",
}


def model_type_of(model_or_config: Any) -> str:
    config = getattr(model_or_config, "config", model_or_config)
    return str(getattr(config, "model_type", "") or "")


def adapter_class(model_or_config: Any) -> type:
    """The adapter class for a transformers model or config (by its `model_type`)."""
    module, name = FAMILIES.get(model_type_of(model_or_config), DEFAULT).split(":")
    return getattr(importlib.import_module(module), name)


def wrap(model: Any, lora_depth: int = 0, **kw: Any) -> Any:
    """A loaded transformers causal LM wrapped by its family's adapter."""
    return adapter_class(model).from_hf(model, lora_depth=lora_depth, **kw)
