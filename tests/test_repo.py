"""Repository hygiene: the library stays pure, imports run down the layers with no circles among the
project's modules, every source file says what it holds, and the docs/FILES.md lists every file (so
the map cannot silently go stale)."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN_IN_LIBRARY = {
    "lightning",
    "pytorch_lightning",
    "optuna",
    "mlflow",
    "cirkit",
    "pandas",
    "matplotlib",
}
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
#: (experiments/training/trial.py once imported sweeps.tracking)
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
    assert not bad, (
        f"imports that run up the layers (tracking < experiments < sweeps; analysis reads tracking): {bad}"
    )


#: the project's packages whose modules may not import each other in a loop
PROJECT_PACKAGES = ("mtpc", "tracking", "experiments", "sweeps", "analysis")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(tree: ast.AST):
    """Every import statement that can run: at module level and inside functions alike, but not
    under `if TYPE_CHECKING:` (never executed)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (
                n
                for branch in node.orelse
                for n in _runtime_imports(ast.Module(body=[branch], type_ignores=[]))
            )
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _runtime_imports(node)


def project_import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (the most specific module a name resolves to:
    `from mtpc.backbones.common import X` is an edge to mtpc.backbones.common, `from mtpc.backbones
    import load_backbone` one to the package's __init__)."""
    files = {_module_name(p): p for pkg in PROJECT_PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        edges: set[str] = set()
        for node in _runtime_imports(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*up, base] if base else up)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for t in targets:
                while t and t not in files:
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    edges.add(t)
        graph[mod] = edges
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles_among_the_project_modules():
    """No two modules of mtpc/, tracking/, experiments/, sweeps/, analysis/ import each other, directly
    or through others. Read statically (ast); a function-level import counts like a top-level one (it
    only defers the cost: the two modules still need each other, and a lazy import is how the
    engine <-> llama and pretrain <-> ship_default circles hid); imports under `if TYPE_CHECKING:`
    do not (they never run)."""
    graph = project_import_graph()
    assert "mtpc.backbones.common" in graph["mtpc.backbones.llama"]  # the reader sees what it should
    assert "mtpc.backbones.llama" in graph["mtpc.backbones.engine"]  # a function-level import counts
    circles = import_circles(graph)
    assert not circles, f"import circles (break each by moving what both need below them): {circles}"


#: experiments/'s subpackages (its jobs) and the others each may import: the plumbing below every job, a
#: job beside another only where it uses it (a sweep trial evaluates the head it trained; shipping the
#: default scores it on pre-training's held-out slice). No subpackage imports a top-level CLI module
#: (experiments/train.py, evaluate.py, pretrain.py, background.py), which may import any of them.
EXPERIMENTS_LAYERS = {
    "plumbing": set(),
    "evaluation": {"plumbing"},
    "pretraining": {"plumbing"},
    "training": {"plumbing", "evaluation"},
    "shipping": {"plumbing", "pretraining"},
}


def test_experiments_subpackages_import_only_what_their_layer_allows():
    subpackages = {p.parent.name for p in (ROOT / "experiments").glob("*/__init__.py")}
    assert subpackages == set(EXPERIMENTS_LAYERS), (
        f"experiments/ has subpackages {sorted(subpackages)}; each needs its row in EXPERIMENTS_LAYERS"
    )
    bad = {}
    for mod, targets in project_import_graph().items():
        parts = mod.split(".")
        if parts[0] != "experiments" or len(parts) < 2 or parts[1] not in EXPERIMENTS_LAYERS:
            continue
        allowed = EXPERIMENTS_LAYERS[parts[1]] | {parts[1]}
        hit = sorted(t for t in targets if t.startswith("experiments.") and t.split(".")[1] not in allowed)
        if hit:
            bad[mod] = hit
    assert not bad, f"experiments/ imports across its layers (EXPERIMENTS_LAYERS): {bad}"


def test_the_circle_finder_finds_a_function_level_circle():
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    tree = ast.parse(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x\ndef f():\n    import y\n"
    )
    assert [a.name for n in _runtime_imports(tree) if isinstance(n, ast.Import) for a in n.names] == ["y"]


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


def test_every_reliability_case_names_tests_that_exist():
    """docs/reliability.md's cases are the campaign (`python -m tests.reliability_campaign`): each row
    names at least one test, and each named test is a function of the named file."""
    import ast

    from tests.reliability_campaign import cases

    rows = cases()
    assert len(rows) > 60
    missing = []
    for case, nodes in rows:
        if not nodes:
            missing.append(f"{case}: no test named")
        for node in nodes:
            path, _, name = node.partition("::")
            if not (ROOT / path).is_file():
                missing.append(f"{case}: {path} does not exist")
                continue
            if name:
                defined = {
                    n.name
                    for n in ast.walk(ast.parse((ROOT / path).read_text()))
                    if isinstance(n, ast.FunctionDef)
                }
                if name not in defined:
                    missing.append(f"{case}: {node} is not a test there")
    assert not missing, "\n".join(missing)
