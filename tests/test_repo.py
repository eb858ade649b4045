"""Repository hygiene: the library stays pure, every source file says what it holds, and the
docs/FILES.md lists every file (so the map cannot silently go stale)."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN_IN_LIBRARY = {"lightning", "pytorch_lightning", "optuna", "mlflow", "cirkit", "pandas", "matplotlib"}
MAPPED_DIRS = ("mtpc", "tracking", "experiments", "sweeps", "slurm", "analysis", "bench", "tests")


def _tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [f for f in out.splitlines() if (ROOT / f).exists()]


def _imported_top_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    mods = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods.add(node.module.split(".")[0])
    return mods


#: the layers above mtpc/ and what each may not import: imports run down the layers, never up
#: (experiments/trial.py once imported sweeps.tracking)
UPWARD = {
    "tracking": {"experiments", "sweeps", "analysis"},
    "experiments": {"sweeps", "analysis"},
    "analysis": {"experiments", "sweeps"},
}


def test_imports_run_down_the_layers():
    bad = {}
    for layer, above in UPWARD.items():
        for path in sorted((ROOT / layer).rglob("*.py")):
            hit = _imported_top_modules(path) & above
            if hit:
                bad[str(path.relative_to(ROOT))] = sorted(hit)
    assert not bad, f"imports that run up the layers (tracking < experiments < sweeps; analysis reads tracking): {bad}"


def test_library_imports_only_allowed_packages():
    bad = {}
    for path in sorted((ROOT / "mtpc").rglob("*.py")):
        hit = _imported_top_modules(path) & FORBIDDEN_IN_LIBRARY
        if hit:
            bad[str(path.relative_to(ROOT))] = sorted(hit)
    assert not bad, f"mtpc/ must stay a pure library (torch, transformers, peft, safetensors); found {bad}"


def test_every_python_file_opens_with_a_docstring():
    missing = []
    for rel in _tracked_files():
        if not rel.endswith(".py") or not rel.startswith(MAPPED_DIRS):
            continue
        text = (ROOT / rel).read_text()
        if not text.strip():  # an empty __init__.py is fine
            continue
        if ast.get_docstring(ast.parse(text)) is None:
            missing.append(rel)
    assert not missing, f"files without an opening docstring: {missing}"


def test_file_map_lists_every_file():
    readme = (ROOT / "docs" / "FILES.md").read_text()
    mapped = set(re.findall(r"`([\w./-]+)`", readme))
    missing = []
    for rel in _tracked_files():
        if not rel.startswith(MAPPED_DIRS) or rel.endswith("__init__.py") or "/results/" in rel:
            continue
        if rel not in mapped:
            missing.append(rel)
    assert not missing, f"docs/FILES.md lacks: {missing}"
