"""Backbone adapters and `load_backbone`: resolve a name or path to a frozen, split, byte-level LM.

Names: "default" (the byte Llama shipped in the repository under `mtpc/default_model/`, checked
against its SHA-256 manifest and named `default@<sha8>`; see `shipped.py`; "default@<sha8>" asks
for that exact one), "evabyte" (EvaByte/EvaByte-SFT), "llama3-byte"
(benjamin/Llama3-2-3B-IT-Byte), a local `save_pretrained` directory, or a hub id "org/name"
(unreachable on these machines; loaded with `trust_remote_code`). Checkpoints whose vocabulary
exceeds 512 are refused unless `allow_non_byte=True`. The adapter classes live in `base.py`
(Llama architecture) and `evabyte.py`; the decoding engines in `engine.py` (protocol, HF layers)
and `llama.py` (the compact Llama forward), CUDA graph capture in `graphs.py`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from mtpc.backbones.base import BackboneAdapter, KVStore, SplitCache, SplitOutput
from mtpc.backbones.engine import AdapterEngine, Engine, StepOutput, make_engine
from mtpc.backbones.evabyte import EvaByteAdapter, EvaByteCache
from mtpc.backbones.llama import LlamaEngine
from mtpc.backbones.shipped import DEFAULT, SHIPPED_DIR, check_backbone_label, verify_shipped
from mtpc.paths import cache_dir

ALIASES = {
    "evabyte": "EvaByte/EvaByte-SFT",
    "llama3-byte": "benjamin/Llama3-2-3B-IT-Byte",
}
MAX_BYTE_VOCAB = 512

__all__ = [
    "ALIASES",
    "AdapterEngine",
    "BackboneAdapter",
    "Engine",
    "LlamaEngine",
    "StepOutput",
    "EvaByteAdapter",
    "EvaByteCache",
    "KVStore",
    "SplitCache",
    "SplitOutput",
    "check_backbone_label",
    "default_model_dir",
    "load_backbone",
    "make_engine",
    "pretrained_model_dir",
]


def default_model_dir() -> Path:
    """The shipped default model's directory (in the package, committed to the repository)."""
    return SHIPPED_DIR


def pretrained_model_dir() -> Path:
    """Where `make pretrain` saves a model it trains (load it by this path, not as "default")."""
    return cache_dir() / "models" / "pretrained"


def _resolve(name_or_path: str) -> tuple[str, str]:
    """(label, source) where source is a local directory or a hub id."""
    if not isinstance(name_or_path, (str, Path)) or not str(name_or_path):
        raise ValueError(f"backbone: expected a name or path, got {name_or_path!r}")
    name = str(name_or_path)
    if name == DEFAULT or name.startswith(f"{DEFAULT}@"):
        label = verify_shipped(SHIPPED_DIR)
        check_backbone_label(name if "@" in name else label, label, where=f"backbone {name!r}")
        return label, str(SHIPPED_DIR)
    if name in ALIASES:
        return name, ALIASES[name]
    if Path(name).expanduser().is_dir():
        path = Path(name).expanduser()
        if not (path / "config.json").is_file():
            raise ValueError(
                f"backbone {name!r}: directory has no config.json (expected a save_pretrained checkpoint)"
            )
        return name, str(path)
    if re.fullmatch(r"[\w.\-]+/[\w.\-]+", name) and not Path(name).exists():
        return name, name
    raise ValueError(
        f"backbone {name!r}: unknown name and not a directory; expected 'default', one of {sorted(ALIASES)}, "
        "a save_pretrained directory or a hub id 'org/name'"
    )


def _load_tokenizer(source: str, trust_remote_code: bool) -> Any:
    from mtpc.tokenizer import ByteTokenizer, HFChatTokenizer

    if Path(source).is_dir() and ByteTokenizer.is_saved_in(source):
        return ByteTokenizer.from_pretrained(source)
    try:
        from transformers import AutoTokenizer

        return HFChatTokenizer(AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code))
    except Exception:  # no tokenizer files: tiny test checkpoints; callers pass ids themselves
        return None


def load_backbone(
    name_or_path: str,
    lora_depth: int = 0,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    *,
    trust_remote_code: bool = True,
    allow_non_byte: bool = False,
    attn_implementation: str | None = None,
    engine: str = "auto",
    **lora_kw: Any,
) -> BackboneAdapter | EvaByteAdapter:
    """Load a checkpoint by name or path and wrap it; see the module docstring for names.

    engine: the decoding path — "auto" (the compact Llama forward when it implements the model,
    else the HF layers), "compact" (refuse otherwise) or "hf". EvaByte always takes the HF path.
    lora_kw: lora_rank, lora_alpha, lora_dropout, lora_targets (see `BackboneAdapter`).
    """
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    label, source = _resolve(name_or_path)
    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ValueError(f"backbone {label!r}: cannot read its config from {source!r} ({e})") from e
    vocab = getattr(config, "vocab_size", None)
    if vocab is None or (vocab > MAX_BYTE_VOCAB and not allow_non_byte):
        raise ValueError(
            f"backbone {label!r}: vocab_size={vocab} is not byte-level (limit {MAX_BYTE_VOCAB}); "
            "pass allow_non_byte=True to use it anyway"
        )
    kw: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if dtype is None and source == str(SHIPPED_DIR):
        dtype = torch.float32  # shipped as bf16; upcast exactly (transformers 5 would keep bf16)
    if dtype is not None:
        major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
        kw["dtype" if (major, minor) >= (4, 56) else "torch_dtype"] = dtype
    if attn_implementation is not None:
        kw["attn_implementation"] = attn_implementation
    try:
        model = AutoModelForCausalLM.from_pretrained(source, **kw)
    except OSError as e:
        raise ValueError(f"backbone {label!r}: cannot load weights from {source!r} ({e})") from e
    model.eval()
    if device is not None:
        model.to(device)
    tokenizer = _load_tokenizer(source, trust_remote_code)
    if getattr(config, "model_type", "") == "evabyte":
        if engine == "compact":
            raise ValueError(
                f"backbone {label!r}: engine='compact' implements Llama only, not EvaByte; use engine='auto' or 'hf'"
            )
        return EvaByteAdapter.from_hf(
            model, lora_depth=lora_depth, name=label, tokenizer=tokenizer, **lora_kw
        )
    return BackboneAdapter.from_hf(
        model, lora_depth=lora_depth, name=label, tokenizer=tokenizer, engine=engine, **lora_kw
    )
