"""The README and docs/*.md as a user reads them: they describe the product and its measured state,
never the history of how it was made (no "this session", issue numbers, run times of day), and the
README's "Use it" Python snippets run as written after `make demo`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: phrases of a lab notebook or a work log, not of a product page (case-insensitive)
SESSION_NOTES = {
    "this session": r"\bthis session\b",
    "last session": r"\blast session\b",
    "was lent / no GPU lent": r"\blent\b",
    "an issue number": r"\bissues? #?\d+",
    "the issue": r"\bthe issue\b",
    "a time of day in UTC": r"\b\d\d:\d\d(:\d\d)? UTC\b",
}


def _doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def session_notes(paths: list[Path]) -> list[str]:
    """`file:line: phrase: text` for every line that carries a session-style note."""
    found = []
    for path in paths:
        for no, line in enumerate(path.read_text().splitlines(), 1):
            for what, pattern in SESSION_NOTES.items():
                if re.search(pattern, line, re.IGNORECASE):
                    name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                    found.append(f"{name}:{no}: {what}: {line.strip()[:100]}")
    return found


def test_docs_carry_no_session_notes():
    found = session_notes(_doc_files())
    assert not found, (
        "session-style notes in the docs (describe the product, not its history):\n" + "\n".join(found)
    )


def test_session_note_check_catches_each_phrase(tmp_path):
    lines = [
        "No GPU was lent this session.",
        "see issue 13",
        "run at 01:41 UTC",
        "as the last session found",
        "the issue's targets",
        "a product sentence",
    ]
    doc = tmp_path / "notes.md"
    doc.write_text("\n".join(lines) + "\n")
    found = session_notes([doc])
    assert {f.split(":")[1] for f in found} == {"1", "2", "3", "4", "5"}
    assert all(f.startswith(f"{doc}:") for f in found)


def test_readme_is_a_short_product_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    for command in ("make demo", "make test"):
        assert command in text


def use_it_snippets(readme: str) -> list[str]:
    """The fenced ```python blocks of the README's "## Use it" section."""
    m = re.search(r"^## Use it\s*$(.*?)(?=^## )", readme, re.MULTILINE | re.DOTALL)
    assert m, 'README.md has no "## Use it" section'
    return [
        textwrap.dedent(b) for b in re.findall(r"^```python\n(.*?)^```", m.group(1), re.MULTILINE | re.DOTALL)
    ]


def _demo_spec(out: Path):
    from sweeps.demo import SMOKE, demo_overrides
    from sweeps.spec import load_spec

    return load_spec(SMOKE, overrides=demo_overrides(out, "trial"))


def test_readme_loads_the_head_the_demo_prints(monkeypatch):
    """`make demo` (from the repository root, `--out runs/demo`) prints this path; the snippet uses it."""
    from sweeps.demo import _shown, example_head

    monkeypatch.chdir(ROOT)
    shown = _shown(example_head(_demo_spec(ROOT / "runs" / "demo")))
    assert shown == "runs/demo/checkpoints/mtpc-demo/cp-r4-n4-k1/head"
    assert f'MtpcModel.from_pretrained("{shown}")' in use_it_snippets((ROOT / "README.md").read_text())[0]


@pytest.mark.slow
def test_readme_use_it_snippets_run_after_the_demo(tmp_path, monkeypatch):
    """The snippets load a head where `make demo` (run from the repository root, `--out runs/demo`)
    leaves it; the test trains that head the way the demo's trial does (the demo's spec, config and
    grid point; 2 steps on generated chats instead of 200 on ShareGPT) into the same relative path
    under a temporary working directory (and cache), then runs every snippet there in a fresh
    interpreter."""
    from experiments.training.fit import train_head
    from experiments.training.trial import trial_config
    from sweeps.demo import example_head
    from tracking.schema import grid_key

    snippets = use_it_snippets((ROOT / "README.md").read_text())
    assert snippets, 'README.md: no ```python block under "## Use it"'
    monkeypatch.setenv("MTPC_CACHE_DIR", str(tmp_path / "cache"))
    spec = _demo_spec(tmp_path / "runs" / "demo")
    head_dir = example_head(spec)
    rel = head_dir.relative_to(tmp_path).as_posix()
    assert rel in snippets[0], f"the first snippet should load the demo's head {rel!r}"
    point = next(p for p in spec.grid if spec.trial_dir(grid_key(p)) == head_dir.parent)
    cfg = trial_config(spec.train, point, run_dir=head_dir.parent)
    train_head(
        cfg,
        {
            "run.tracking": False,
            "trainer.max_steps": 2,
            "trainer.enable_progress_bar": False,
            "data.source": "debug",
            "data.seq_len": 64,
            "trainer.limit_val_batches": 1,
        },
    )
    assert (head_dir / "config.json").is_file()
    # each block in its own namespace, in one interpreter (one import of torch for all)
    runner = "import sys\nfor path in sys.argv[1:]:\n    exec(compile(open(path).read(), path, 'exec'), {'__name__': '__main__'})\n"
    paths = []
    for i, code in enumerate(snippets):
        p = tmp_path / f"use_it_{i}.py"
        p.write_text(code)
        paths.append(str(p))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [sys.executable, "-c", runner, *paths],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, f"a README snippet failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
