"""The vocabulary (mtpc/names.py): one architecture check with the bounds and the ff rule, called at
every entry point, and no name tuple, bound or ff-rank rule restated elsewhere (AST scan)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from mtpc import MtpcModel
from mtpc.circuits import build_circuit
from mtpc.heads import HeadConfig
from mtpc.names import (
    CIRCUIT_KINDS,
    DECODE_MODES,
    EXTRA_TOKEN_OPTIONS,
    MAX_RANK,
    MAX_WINDOW,
    MIN_DECODE_WINDOW,
    ArchitectureError,
    check_architecture,
)
from tests.backbone_helpers import tiny_backbone
from tracking.schema import GRID_PARAMS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "args, kw, key",
    [
        (("mlp", 8, 8), {}, "circuit"),
        (("cp", 0, 8), {}, "window"),
        (("cp", 1, 8), {"decoding": True}, "window"),  # decoding drafts n - 1 bytes: n >= 2
        (("cp", MAX_WINDOW + 1, 8), {}, "window"),
        (("cp", 8, 0), {}, "rank"),
        (("cp", 8, MAX_RANK + 1), {}, "rank"),
        (("cp", 8, 8.0), {}, "rank"),
        (("cp", 8, True), {}, "rank"),
        (("ff", 8, 8), {}, "rank"),
        (("cp", 8, 8, -1), {}, "lora_depth"),
    ],
)
def test_check_architecture_names_where_and_key(args, kw, key):
    with pytest.raises(ArchitectureError) as e:
        check_architecture(*args, **kw, where="f.yaml: model.")
    assert (
        e.value.key == key and str(e.value).startswith(f"f.yaml: model.{key}: ") and "\n" not in str(e.value)
    )


def test_check_architecture_accepts_the_bounds():
    for kind in CIRCUIT_KINDS:
        check_architecture(kind, 1, 1, 0)
        check_architecture(kind, MAX_WINDOW, 1 if kind == "ff" else MAX_RANK, None, decoding=True)


def test_ff_with_rank_8_is_an_error_everywhere_in_the_library():
    """No entry point resets ff's rank silently (the training config and sweep spec: their tests)."""
    with pytest.raises(ValueError, match="rank"):
        check_architecture("ff", 8, 8)
    with pytest.raises(ValueError, match="^rank: ff has no latent states"):
        HeadConfig("ff", 8, 8, vocab=16, hidden=8)
    with pytest.raises(ValueError, match="^rank: ff has no latent states"):
        build_circuit("ff", window=8, rank=8, vocab=16)
    with pytest.raises(ValueError, match="^rank: ff has no latent states"):
        MtpcModel.from_components(tiny_backbone(), {"kind": "ff", "window": 4, "rank": 8})
    assert MtpcModel.from_components(tiny_backbone(), {"kind": "ff", "window": 4}).head.config.rank == 1


# --- nobody restates the vocabulary ---------------------------------------------------------------

SOURCE_LAYERS = ("mtpc/", "tracking/", "experiments/", "sweeps/", "analysis/", "bench/")
VOCAB_SETS = {
    "CIRCUIT_KINDS": set(CIRCUIT_KINDS),
    "DECODE_MODES": set(DECODE_MODES),
    "EXTRA_TOKEN_OPTIONS": set(EXTRA_TOKEN_OPTIONS),
    "GRID_PARAMS": set(GRID_PARAMS),
}
BOUNDS = {MAX_RANK, MAX_WINDOW, 4096}  # 4096: the looser rank bound the sweep spec and training once had


def _python_files(prefixes: tuple[str, ...]) -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    skip = {"mtpc/names.py", "tracking/schema.py", "tests/mtpc/test_names.py"}
    return [f for f in out.splitlines() if f.startswith(prefixes) and f not in skip and (ROOT / f).exists()]


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def restatements(path: str, text: str, *, source: bool) -> list[str]:
    """The circuit kinds spelled out anywhere; in `source` also the modes, extra-token options and grid
    params, a window/rank bound next to rank/window, and ff -> rank 1 outside `point_rank`."""
    tree = ast.parse(text, filename=path)
    parents, found = _parents(tree), []
    for node in ast.walk(tree):
        where = f"{path}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and node.elts:
            if all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
                vals = {e.value for e in node.elts}
                ordered = tuple(e.value for e in node.elts)
                for name, vocab in VOCAB_SETS.items():
                    if name != "CIRCUIT_KINDS" and not source:
                        continue  # tests may spell modes and params out as user input or as an oracle
                    if name == "GRID_PARAMS" and ordered != GRID_PARAMS:
                        continue  # another order of the params is another statement (a display order)
                    if vals == vocab or (name == "CIRCUIT_KINDS" and vocab <= vals):
                        found.append(f"{where}: {ast.unparse(node)} restates {name}")
        if not source:
            continue
        if isinstance(node, ast.IfExp) and '"ff"' in ast.unparse(node.test).replace("'", '"'):
            body = (
                node.body.elts[0]
                if isinstance(node.body, (ast.List, ast.Tuple)) and len(node.body.elts) == 1
                else node.body
            )
            if isinstance(body, ast.Constant) and body.value == 1:
                found.append(
                    f"{where}: {ast.unparse(node)} restates the ff rank rule (use point_rank/default_rank)"
                )
        if isinstance(node, ast.If) and '"ff"' in ast.unparse(node.test).replace("'", '"'):
            for stmt in node.body:
                if (
                    isinstance(stmt, ast.Assign)
                    and "rank" in ast.unparse(stmt.targets[0])
                    and ast.unparse(stmt.value) == "1"
                ):
                    found.append(
                        f"{where}: resets ff's rank to 1 (an error in a config, point_rank in a space)"
                    )
        if (
            isinstance(node, ast.Compare)
            and "window" in ast.unparse(node.left)
            and any(isinstance(c, ast.Constant) and c.value == MIN_DECODE_WINDOW for c in node.comparators)
        ):
            found.append(f"{where}: {ast.unparse(node)} restates MIN_DECODE_WINDOW")
        if isinstance(node, ast.Constant) and type(node.value) is int and node.value in BOUNDS:
            up, context = node, []
            while up in parents and not isinstance(up, (ast.FunctionDef, ast.ClassDef, ast.Module)):
                up = parents[up]
                if isinstance(up, ast.stmt) and not context:
                    context.append(ast.unparse(up))
                if isinstance(up, (ast.If, ast.While)):
                    context.append(ast.unparse(up.test))
            if any("rank" in c or "window" in c for c in context):
                found.append(f"{where}: bound {node.value} next to rank/window (use mtpc.names)")
    return found


def test_the_scan_finds_what_main_used_to_restate():
    old = """
CIRCUITS = ("ff", "cp", "hmm", "btree")
MODES = ["greedy", "sample"]
PARAMS = ("circuit", "rank", "window", "lora_depth")
def f(name, v, key, m, ctx):
    if name == "rank":
        return ctx.int_(v, key, 1, 4096)
    if not 1 <= m["rank"] <= 1024:
        pass
    rank = 1 if m["circuit"] == "ff" else m["rank"]
    if m["circuit"] == "ff":
        m["rank"] = 1
"""
    hits = restatements("old.py", old, source=True)
    assert len(hits) == 7, hits
    assert len(restatements("test_x.py", old, source=False)) == 1  # tests: only the circuit kinds
    assert (
        restatements("ok.py", "x = ('ff', 'cp')\nseq_len = 4096\nwindow = DEFAULT_WINDOW\n", source=True)
        == []
    )


def test_the_scan_finds_a_restated_decoding_window_bound():
    assert len(restatements("m.py", "if cfg.window < 2:\n    pass\n", source=True)) == 1
    assert restatements("m.py", "if cfg.window < MIN_DECODE_WINDOW:\n    pass\n", source=True) == []


def test_no_vocabulary_restated_outside_names():
    hits = []
    for rel in _python_files(SOURCE_LAYERS + ("tests/",)):
        hits += restatements(rel, (ROOT / rel).read_text(), source=rel.startswith(SOURCE_LAYERS))
    assert not hits, "import these from mtpc.names instead:\n" + "\n".join(hits)


def test_names_load_without_torch():
    """The analysis and sweep specs read the vocabulary without paying for torch."""
    code = "import sys, mtpc.names; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0
