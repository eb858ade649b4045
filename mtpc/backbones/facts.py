"""Facts about a backbone that a config check needs without loading its weights or running its code:
the short names of the paper's backbones (`ALIASES`),
its config.json read as JSON (`backbone_config_dict`: a local directory, the shipped default, the
local Hugging Face cache), its number of layers (`backbone_num_layers`, which also knows the
paper's backbones by name) and the longest sequence it admits (`backbone_max_context`). Offline: None when a fact cannot be known on this machine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: short names of the paper's backbones (`load_backbone("evabyte")`)
ALIASES = {
    "evabyte": "EvaByte/EvaByte-SFT",
    "llama3-byte": "benjamin/Llama3-2-3B-IT-Byte",
}
#: layer counts of the paper's backbones, so a config can check lora_depth without their weights
KNOWN_NUM_LAYERS = {"benjamin/Llama3-2-3B-IT-Byte": 28, "EvaByte/EvaByte-SFT": 32, "EvaByte/EvaByte": 32}


def backbone_config_dict(name: str, revision: str | None = None) -> dict[str, Any] | None:
    """The raw config.json of backbone `name` if it is on this machine (a directory, the shipped default,
    the local HF cache), read as JSON (no code runs); None otherwise."""
    from mtpc.backbones.shipped import SHIPPED_DIR

    name = ALIASES.get(name, name)
    if name == "default" or name.startswith("default@"):
        name = str(SHIPPED_DIR)
    cfg = Path(name).expanduser() / "config.json"
    if cfg.is_file():
        return json.loads(cfg.read_text())
    try:  # a hub name already in the local HF cache
        from transformers import PretrainedConfig

        return PretrainedConfig.get_config_dict(name, local_files_only=True, revision=revision)[0]
    except Exception:
        return None


def backbone_num_layers(name: str, revision: str | None = None) -> int | None:
    """Number of layers of backbone `name` without loading weights; None when it cannot be known offline."""
    if ALIASES.get(name, name) in KNOWN_NUM_LAYERS:
        return KNOWN_NUM_LAYERS[ALIASES.get(name, name)]
    c = backbone_config_dict(name, revision) or {}
    return c.get("num_hidden_layers", c.get("n_layer", c.get("num_layers")))


def backbone_max_context(name: str, revision: str | None = None) -> int | None:
    """The longest sequence backbone `name` admits (`max_position_embeddings`, as `max_context` of a
    loaded backbone), from its config.json; None when it cannot be known offline or is unbounded."""
    c = backbone_config_dict(name, revision) or {}
    n = c.get("max_position_embeddings", c.get("n_positions"))
    return int(n) if n else None
