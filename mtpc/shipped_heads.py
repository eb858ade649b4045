"""Heads shipped with the default backbone: `mtpc/default_heads/`, each checked before it loads.

    MtpcModel.from_pretrained("default")               # the default backbone with its default head
    MtpcModel.from_pretrained("shipped:<name>")        # another shipped head, by its name
    MtpcModel.from_pretrained("./default")             # a local head export that happens to be called so

Layout: `mtpc/default_heads/<name>/` holds one `save_head` export (config.json, head.safetensors in
bf16 *storage* — loaded to the backbone's dtype, float32 on the CPU, so the loop and the offline pass
compute in the same arithmetic) and its model card `MODEL_CARD.md`; `mtpc/default_heads/INDEX.json`
lists every head with the SHA-256 of each of its files, its decoding defaults (`decode`:
`draft_len`, the bytes a cycle feeds, chosen on development prompts), which head `"default"` means,
and the backbone label the heads were trained on. The heads sit beside the backbone, outside its manifest:
the label `default@<sha8>` is the SHA-256 of `mtpc/default_model/MANIFEST.json`, which every head
records, so listing heads there would change the label they must record.

At load, a shipped head is refused (one line naming the file) unless its folder holds exactly the
files the index lists with those digests, and the index's backbone label is the shipped backbone's.

How a name is read: `"default"` and `"shipped:<name>"` are always shipped heads; anything else is a
path. A local folder literally named `default` is given as a path (`./default`, or absolute).
Leaves out: writing a shipped head (`experiments/shipping/ship_head.py`), the export format (mtpc/heads.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from mtpc.atomic import sha256_file

HEADS_DIR = Path(__file__).resolve().parent / "default_heads"
INDEX_FILE = "INDEX.json"
CARD_FILE = "MODEL_CARD.md"
DEFAULT = "default"
PREFIX = "shipped:"
MAX_HEAD_BYTES = 8 * 1024 * 1024
"""A shipped head's files together stay under 8 MiB (the repository carries them)."""
NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")


def is_shipped_name(name_or_path: Any) -> bool:
    """True for `"default"` and `"shipped:<name>"`: the names `resolve_head` reads as shipped heads."""
    return isinstance(name_or_path, str) and (name_or_path == DEFAULT or name_or_path.startswith(PREFIX))


def read_index(heads_dir: Path | None = None) -> dict[str, Any]:
    """The shipped heads' index, its shape checked (ValueError naming the file)."""
    path = (heads_dir or HEADS_DIR) / INDEX_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no shipped heads in this installation (the index is missing)")
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    heads = index.get("heads") if isinstance(index, dict) else None
    if (
        not isinstance(heads, dict)
        or not isinstance(index.get("backbone"), str)
        or not isinstance(index.get(DEFAULT), str)
    ):
        raise ValueError(
            f"{path}: expected an object with 'backbone' (a label), 'default' (a head name) and 'heads' "
            "({name: {'files': {file: sha256}}})"
        )
    for name, entry in heads.items():
        files = entry.get("files") if isinstance(entry, dict) else None
        if (
            not NAME.match(str(name))
            or not isinstance(files, dict)
            or not files
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items())
        ):
            raise ValueError(
                f"{path}: heads.{name}: expected a lower-case name and {{'files': {{file: sha256}}}}"
            )
        decode = entry.get("decode", {})
        m = decode.get("draft_len") if isinstance(decode, dict) else None
        if (
            not isinstance(decode, dict)
            or set(decode) - {"draft_len"}
            or ("draft_len" in decode and (isinstance(m, bool) or not isinstance(m, int) or m < 2))
        ):
            raise ValueError(f"{path}: heads.{name}.decode: expected {{'draft_len': an integer >= 2}}")
    if index[DEFAULT] not in heads:
        raise ValueError(f"{path}: default head {index[DEFAULT]!r} is not one of {sorted(heads)}")
    return index


def decode_defaults(name_or_path: Any, heads_dir: Path | None = None) -> dict[str, Any]:
    """The decoding defaults the index records for a shipped head (`{"draft_len": m}` or {}); {} for
    a path. Read by `MtpcModel.from_pretrained` where the caller leaves them unset."""
    if not is_shipped_name(name_or_path):
        return {}
    index = read_index(heads_dir)
    return dict(index["heads"].get(_index_name(name_or_path, index), {}).get("decode", {}))


def _index_name(name_or_path: Any, index: dict[str, Any]) -> str:
    """The index's name for a shipped name: "default" and "shipped:default" are the index's default."""
    name = str(name_or_path).removeprefix(PREFIX)
    return index[DEFAULT] if name == DEFAULT else name


def shipped_head_names(heads_dir: Path | None = None) -> list[str]:
    """The names of the shipped heads (empty when none ships)."""
    try:
        return sorted(read_index(heads_dir)["heads"])
    except FileNotFoundError:
        return []


def resolve_head(name_or_path: str | Path, heads_dir: Path | None = None) -> Path:
    """A head export's directory: a shipped head (checked against the index, `verify_head`) for
    `"default"` / `"shipped:<name>"`, else the path as given (load_head checks it)."""
    if not is_shipped_name(name_or_path):
        return Path(name_or_path).expanduser()
    heads_dir = heads_dir or HEADS_DIR
    index = read_index(heads_dir)
    name = _index_name(name_or_path, index)
    if name not in index["heads"]:
        raise ValueError(
            f"head {name_or_path!r}: no shipped head of that name; shipped: {sorted(index['heads'])} "
            f"(a local folder is given as a path, e.g. ./{name})"
        )
    verify_head(name, index, heads_dir)
    return heads_dir / name


def verify_head(name: str, index: dict[str, Any], heads_dir: Path | None = None) -> None:
    """The shipped head `name` holds exactly the files the index lists, with their SHA-256, and was
    trained on the backbone that ships now."""
    from mtpc.backbones.shipped import SHIPPED_DIR, verify_shipped

    heads_dir = heads_dir or HEADS_DIR
    folder = heads_dir / name
    listed = index["heads"][name]["files"]
    present = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    extra, missing = sorted(set(present) - set(listed)), sorted(set(listed) - set(present))
    if extra or missing:
        raise ValueError(
            f"{folder}: shipped head files differ from {heads_dir / INDEX_FILE} "
            f"(not listed: {extra}, missing: {missing})"
        )
    for file, digest in sorted(listed.items()):
        if sha256_file(folder / file) != digest:
            raise ValueError(
                f"{folder / file}: SHA-256 differs from {heads_dir / INDEX_FILE}; the shipped head "
                "was modified (restore it from the repository)"
            )
    label = verify_shipped(SHIPPED_DIR)
    if index["backbone"] != label:
        raise ValueError(
            f"{heads_dir / INDEX_FILE}: the shipped heads were trained on {index['backbone']}, "
            f"but the shipped backbone is {label}; retrain and re-ship them"
        )
