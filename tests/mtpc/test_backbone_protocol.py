"""The `Backbone` protocol declares what its consumers use, every family provides it, and the
consumers are typed with it.

Static where loading a family costs (EvaByte): every declared member is a class attribute (method,
property, `ConfigFacts`) or assigned `self.<name> = ...` in the adapter's `__init__`. At run time on
the tiny Llama adapter: `isinstance(..., Backbone)` and each fact has its declared type.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import typing
from pathlib import Path

import pytest
import torch

from mtpc.backbones import registry
from mtpc.backbones.common import Backbone
from tests.backbone_helpers import tiny_backbone

ROOT = Path(__file__).resolve().parents[2]
MEMBERS = sorted(typing._get_protocol_attrs(Backbone))  # noqa: SLF001 (typing has no public reader of a protocol's members)
FAMILY_CLASSES = sorted({registry.DEFAULT, *registry.FAMILIES.values()})


def _load(path: str) -> type:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def _assigned_in_init(cls: type) -> set[str]:
    """Names assigned as `self.<name>` (also in tuple targets) in the class's own __init__."""
    tree = ast.parse(inspect.getsource(cls))  # a module-level class: its source is not indented
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "__init__":
            for sub in ast.walk(node):
                if (
                    isinstance(sub, ast.Attribute)
                    and isinstance(sub.value, ast.Name)
                    and sub.value.id == "self"
                    and isinstance(sub.ctx, ast.Store)
                ):
                    out.add(sub.attr)
    return out


def test_the_protocol_declares_the_facts_its_docstring_and_consumers_name():
    facts = {
        "name",
        "config",
        "tokenizer",
        "vocab_size",
        "hidden_size",
        "num_layers",
        "lora_depth",
        "lora_rank",
        "max_context",
        "device",
        "dtype",
        "eos_token_id",
        "bos_token_id",
        "stop_token_ids",
        "engine",
        "lm_head_weight",
        "model",
        "draft_top",
    }
    methods = {
        "__call__",
        "new_cache",
        "stp_logits",
        "mtp_unembeddings",
        "without_draft",
        "lora_parameters",
        "lora_state_dict",
        "load_lora_state_dict",
        "parameters",
        "eval",
    }
    assert facts | methods == set(MEMBERS)


@pytest.mark.parametrize("path", FAMILY_CLASSES)
def test_every_family_provides_every_member(path):
    cls = _load(path)
    missing = [m for m in MEMBERS if not hasattr(cls, m) and m not in _assigned_in_init(cls)]
    assert not missing, f"{path} lacks {missing} of the Backbone protocol"


@pytest.mark.parametrize("lora_depth", [0, 1])
def test_the_llama_adapter_is_a_backbone_with_the_declared_types(lora_depth):
    bb = tiny_backbone(lora_depth=lora_depth)
    assert isinstance(bb, Backbone) and isinstance(bb.without_draft(), Backbone)
    hints = typing.get_type_hints(Backbone)
    simple = {
        int: int,
        str: str,
        torch.device: torch.device,
        torch.dtype: torch.dtype,
        torch.Tensor: torch.Tensor,
    }
    for name, hint in hints.items():
        if hint in simple:
            assert isinstance(getattr(bb, name), simple[hint]), (name, type(getattr(bb, name)))
    assert isinstance(bb.stop_token_ids, tuple) and (bb.draft_top is None) == (lora_depth == 0)
    assert bb.lm_head_weight.shape == (bb.vocab_size, bb.hidden_size)


def test_the_consumers_are_typed_with_the_protocol():
    """No `backbone: Any` (or bb / adapter) left in the library or the experiments."""
    pattern = re.compile(r"\b(backbone|bb|adapter)\s*:\s*Any\b")
    hits = [
        f"{p.relative_to(ROOT)}:{i}"
        for d in ("mtpc", "experiments")
        for p in sorted((ROOT / d).rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not hits, hits
