"""The shipped default backbone: where its files live, its SHA-256 manifest, and its label.

The default byte Llama is committed to the repository under `mtpc/default_model/` as bf16
safetensors shards (each <= 16 MiB) with `config.json`, the tokenizer config, the training
metrics and `MANIFEST.json` ({"files": {name: sha256}}). `load_backbone("default")` loads exactly
these files after checking every one against the manifest, so a fresh machine never pre-trains.

The model is named `default@<sha8>` (the first 8 hex digits of the manifest's own SHA-256):
head exports and MLflow runs record that label, and `check_backbone_label` refuses a head made
on another default, which shares d and v with this one and would otherwise load silently.

Leaves out: training and evaluating the model (experiments/pretrain.py), the adapters.
"""

from __future__ import annotations

import json
from pathlib import Path

from mtpc.atomic import sha256_file

SHIPPED_DIR = Path(__file__).resolve().parents[1] / "default_model"
MANIFEST = "MANIFEST.json"
DEFAULT = "default"


def write_manifest(directory: str | Path) -> str:
    """Hash every file of `directory` (but the manifest) into MANIFEST.json; returns the label."""
    directory = Path(directory)
    files = {
        p.name: sha256_file(p) for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST
    }
    (directory / MANIFEST).write_text(json.dumps({"files": files}, indent=1, sort_keys=True) + "\n")
    return default_label(directory)


def default_label(directory: str | Path = SHIPPED_DIR) -> str:
    """`default@<sha8>` of the manifest in `directory`."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise ValueError(f"default backbone: {path} is missing (the shipped model's manifest)")
    return f"{DEFAULT}@{sha256_file(path)[:8]}"


def verify_shipped(directory: str | Path = SHIPPED_DIR) -> str:
    """Check that the folder holds exactly the manifest's files, each with its SHA-256; returns the label.

    Raises ValueError naming the first file that is missing, differs (a truncated clone, a Git
    LFS pointer, a local edit) or is not listed (a weight file saved into the folder would be
    loaded under the verified label).
    """
    directory = Path(directory)
    label = default_label(directory)
    try:
        files = json.loads((directory / MANIFEST).read_text())["files"]
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise ValueError(f"default backbone: {directory / MANIFEST} is not a manifest ({e})") from None
    if not (
        isinstance(files, dict) and all(isinstance(n, str) and isinstance(d, str) for n, d in files.items())
    ):
        raise ValueError(
            f'default backbone: {directory / MANIFEST}: "files" must map file names to SHA-256 '
            f"digests, got {type(files).__name__}; restore it with git checkout"
        )
    extra = sorted(
        p.name for p in directory.iterdir() if p.is_file() and p.name != MANIFEST and p.name not in files
    )
    if extra:
        raise ValueError(
            f"default backbone: {directory / extra[0]} is not listed in {MANIFEST} "
            f"(the folder must hold exactly the manifest's files; remove {', '.join(extra)})"
        )
    for name, digest in files.items():
        path = directory / name
        if not path.is_file():
            raise ValueError(f"default backbone: {path} is listed in {MANIFEST} but missing")
        if sha256_file(path) != digest:
            raise ValueError(
                f"default backbone: {path} does not match its SHA-256 in {MANIFEST} "
                "(corrupt or changed file; restore it with git checkout)"
            )
    return label


def check_backbone_label(head_backbone: str, backbone_name: str, where: str = "head") -> None:
    """Refuse a head recorded on one default (`default@X`) when the backbone is another default."""
    h, b = str(head_backbone or ""), str(backbone_name or "")
    if h.startswith(f"{DEFAULT}@") and b.split("@")[0] == DEFAULT and h != b:
        raise ValueError(
            f"{where}: trained on backbone {h}, but the default backbone here is {b}; "
            "retrain the head on this default (the two share d and v, so it would load but draft garbage)"
        )
