"""Backbone adapters and `load_backbone`: resolve a name or path to a frozen, split, byte-level LM.

Names: "default" (the byte Llama shipped in the repository under `mtpc/default_model/`, checked
against its SHA-256 manifest and named `default@<sha8>`; see `shipped.py`; "default@<sha8>" asks
for that exact one), "evabyte" (EvaByte/EvaByte-SFT), "llama3-byte"
(benjamin/Llama3-2-3B-IT-Byte), a local `save_pretrained` directory, or a hub id "org/name"
(unreachable on these machines). Checkpoints whose vocabulary exceeds 512 are refused unless
`allow_non_byte=True`.

Nobody's code runs without consent: a checkpoint that ships its own modelling code (an `auto_map`
in its config.json, e.g. EvaByte) is refused unless `trust_remote_code=True`, and for a hub id also
`revision=<40-hex commit hash>` (the commit whose code was reviewed; a branch can move). A local
directory needs only `trust_remote_code=True`: the code is the one on disk. tokenkit's byte Llama
(`model_type: tpu_llama`, e.g. "llama3-byte") is the exception: the suite implements it
(`tpu_llama.py`) and loads its weights by name, so its `auto_map` code never runs and needs no consent. `check_remote_code`
states the rule; the training config calls it too, before any weights are read. The adapter classes live in `hf_llama.py`
(Llama architecture) and `evabyte.py`, the `Backbone` protocol in `common.py`; the decoding engines in `engine.py` (protocol, HF layers)
and `llama.py` (the compact Llama forward), CUDA graph capture in `graphs.py`.
"""

from __future__ import annotations

import contextlib
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from mtpc.backbones.common import Backbone, SplitOutput
from mtpc.backbones.engine import AdapterEngine, Engine, StepOutput, make_engine
from mtpc.backbones.evabyte import EvaByteAdapter, EvaByteCache
from mtpc.backbones.facts import ALIASES, backbone_config_dict, backbone_num_layers
from mtpc.backbones.hf_llama import BackboneAdapter, KVStore, SplitCache
from mtpc.backbones.llama import LlamaEngine
from mtpc.backbones.registry import FAMILIES, adapter_class
from mtpc.backbones.shipped import DEFAULT, SHIPPED_DIR, check_backbone_label, verify_shipped
from mtpc.backbones.tpu_llama import ExpandedLlamaForCausalLM, is_tpu_llama, load_tpu_llama, tpu_llama_config
from mtpc.paths import cache_dir

MAX_BYTE_VOCAB = 512

__all__ = [
    "ALIASES",
    "AdapterEngine",
    "Backbone",
    "backbone_config_dict",
    "backbone_num_layers",
    "BackboneAdapter",
    "FAMILIES",
    "adapter_class",
    "Engine",
    "LlamaEngine",
    "StepOutput",
    "EvaByteAdapter",
    "EvaByteCache",
    "ExpandedLlamaForCausalLM",
    "KVStore",
    "SplitCache",
    "SplitOutput",
    "check_backbone_label",
    "check_remote_code",
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


@contextlib.contextmanager
def _no_weight_bars():
    """transformers' per-file progress bars ("Loading weights") off while a backbone loads: a library
    call keeps the caller's console quiet (restored afterwards; a caller that turned them off keeps them off)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


COMMIT_HASH = re.compile(r"[0-9a-f]{40}")


def check_remote_code(
    name_or_path: str,
    trust_remote_code: bool,
    revision: str | None = None,
    config: dict[str, Any] | None = None,
) -> None:
    """Raise ValueError (saying how to allow it) unless loading `name_or_path` runs no code without consent.

    config: the checkpoint's raw config.json dict, when known (its `auto_map` means it ships code).
    With trust_remote_code=True a hub id must pin `revision` to a full commit hash.
    """
    name = ALIASES.get(str(name_or_path), str(name_or_path))
    hub = bool(re.fullmatch(r"[\w.\-]+/[\w.\-]+", name)) and not Path(name).expanduser().exists()
    if trust_remote_code and hub and not (isinstance(revision, str) and COMMIT_HASH.fullmatch(revision)):
        raise ValueError(
            f"backbone {name_or_path!r}: trust_remote_code=True runs the Python code of the hub repository, so pin "
            f"the commit you reviewed: revision='<40-hex commit hash>' (training config: model.revision), got {revision!r}"
        )
    if not trust_remote_code and config is not None and config.get("auto_map") and not is_tpu_llama(config):
        raise ValueError(
            f"backbone {name_or_path!r}: the checkpoint ships its own modelling code (config.json auto_map), which runs "
            "only with consent: pass trust_remote_code=True (and for a hub id revision='<40-hex commit hash>'); in a "
            "training config set model.trust_remote_code: true and model.revision: <commit hash>"
        )


def _load_tokenizer(source: str, trust_remote_code: bool, revision: str | None, native: bool = False) -> Any:
    """native: tokenkit's byte Llama, whose fast tokenizer loads directly (AutoTokenizer would read the
    model's config.json and ask to run its auto_map code)."""
    from mtpc.tokenizer import ByteTokenizer, HFChatTokenizer

    if Path(source).is_dir() and ByteTokenizer.is_saved_in(source):
        return ByteTokenizer.from_pretrained(source)
    try:
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        if native:
            return HFChatTokenizer(PreTrainedTokenizerFast.from_pretrained(source, revision=revision))

        return HFChatTokenizer(
            AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code, revision=revision)
        )
    except Exception:  # no tokenizer files: tiny test checkpoints; callers pass ids themselves
        return None


def load_backbone(
    name_or_path: str,
    lora_depth: int = 0,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    *,
    trust_remote_code: bool = False,
    revision: str | None = None,
    allow_non_byte: bool = False,
    attn_implementation: str | None = None,
    engine: str = "auto",
    **lora_kw: Any,
) -> Backbone:
    """Load a checkpoint by name or path and wrap it; see the module docstring for names.

    engine: the decoding path — "auto" (the compact Llama forward when it implements the model,
    else the HF layers), "compact" (refuse otherwise) or "hf". EvaByte always takes the HF path.
    The adapter class comes from the config's `model_type` (registry.py); it may repair the config
    before loading and the model after, and refuses a model whose probe logits are not finite.
    trust_remote_code / revision: see the module docstring (`check_remote_code`); revision pins a hub commit.
    lora_kw: lora_rank, lora_alpha, lora_dropout, lora_targets (see `BackboneAdapter`).
    """
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

    label, source = _resolve(name_or_path)
    check_remote_code(source, trust_remote_code, revision)  # before anything is fetched
    hub = {"revision": revision, "trust_remote_code": trust_remote_code}
    try:
        raw, _ = PretrainedConfig.get_config_dict(source, revision=revision)  # JSON only, runs no code
    except (OSError, ValueError) as e:
        raise ValueError(f"backbone {label!r}: cannot read its config from {source!r} ({e})") from e
    check_remote_code(source, trust_remote_code, revision, raw)
    native = is_tpu_llama(raw)  # tokenkit's byte Llama: its auto_map code is never run (tpu_llama.py)
    if native:  # every TPULlamaConfig field implemented or refused here, one line
        config = tpu_llama_config(raw, where=f"backbone {label!r}")[0]
    else:
        try:
            config = AutoConfig.from_pretrained(source, **hub)
        except ImportError as e:
            raise ValueError(f"backbone {label!r}: its own code does not import here ({e})") from e
        except (OSError, ValueError) as e:
            raise ValueError(f"backbone {label!r}: cannot read its config from {source!r} ({e})") from e
    family = adapter_class(config)
    if hasattr(family, "prepare_config"):
        config = family.prepare_config(config)
    vocab = getattr(config, "vocab_size", None)
    if vocab is None or (vocab > MAX_BYTE_VOCAB and not allow_non_byte):
        raise ValueError(
            f"backbone {label!r}: vocab_size={vocab} is not byte-level (limit {MAX_BYTE_VOCAB}); "
            "pass allow_non_byte=True to use it anyway"
        )
    kw: dict[str, Any] = dict(hub)
    if dtype is None and source == str(SHIPPED_DIR):
        dtype = torch.float32  # shipped as bf16; upcast exactly (transformers 5 would keep bf16)
    if dtype is not None:
        major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
        kw["dtype" if (major, minor) >= (4, 56) else "torch_dtype"] = dtype
    if attn_implementation is not None:
        kw["attn_implementation"] = attn_implementation
    try:
        with _no_weight_bars():
            if native:
                model = load_tpu_llama(source, raw, **kw)
            else:
                model = AutoModelForCausalLM.from_pretrained(source, config=config, **kw)
    except OSError as e:
        raise ValueError(f"backbone {label!r}: cannot load weights from {source!r} ({e})") from e
    except pickle.UnpicklingError:  # torch.load(weights_only=True) met a pickled object that is not a tensor
        raise ValueError(
            f"backbone {label!r}: the pickled weights in {source!r} hold objects other than tensors; "
            "refused unread (convert them to safetensors from a trusted copy)"
        ) from None
    except ImportError as e:
        raise ValueError(f"backbone {label!r}: its own code does not import here ({e})") from e
    if hasattr(family, "repair_loaded"):
        family.repair_loaded(model)
    model.eval()
    if device is not None:
        model.to(device)
    tokenizer = _load_tokenizer(source, trust_remote_code, revision, native=native)
    try:
        backbone = family.from_hf(
            model, lora_depth=lora_depth, name=label, tokenizer=tokenizer, engine=engine, **lora_kw
        )
    except ValueError as e:
        raise ValueError(f"backbone {label!r}: {e}") from e
    if hasattr(backbone, "check_finite"):
        backbone.check_finite(label)
    return backbone
