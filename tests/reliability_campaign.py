"""The reliability campaign as one command: every case of docs/reliability.md run through its tests.

    python -m tests.reliability_campaign            # every case, slow ones included (~15 min on 2 cores)
    python -m tests.reliability_campaign --fast     # leave out the tests marked slow
    python -m tests.reliability_campaign --list     # the cases and the tests that check them

docs/reliability.md's two tables ("Cases that hold", "Cases that failed, and their fixes") name, for
each case, the tests that reproduce it: a path `tests/<dir>/test_x.py::name`, a file name
`test_x.py::name` (found under tests/), `::name` (the cell's previous file) or "same test" (the row
above's). This runs all of them in one pytest process and prints a line per case: `holds`, `FAILS`
(naming the failing test) or `skipped` with pytest's reason (not root, no second user, no `sbatch`,
no GPU). Full disks are injected (tests/faults.py) where no mount is possible, and every wait in
those tests is bounded to seconds, so the next campaign starts from this one: add a row and its test.
Exit code: 0 when every case holds or is skipped, 1 when one fails, 2 when a row names no test.
`tests/test_repo.py` checks that every row resolves to tests that exist.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "reliability.md"
TABLES = ("## Cases that hold", "## Cases that failed, and their fixes")


def _test_files() -> dict[str, list[Path]]:
    by_name: dict[str, list[Path]] = {}
    for p in sorted((ROOT / "tests").rglob("test_*.py")):
        by_name.setdefault(p.name, []).append(p)
    return by_name


def cases(doc: Path = DOC) -> list[tuple[str, list[str]]]:
    """(case, pytest node ids relative to the repository) for every row of the two tables."""
    files = _test_files()
    out: list[tuple[str, list[str]]] = []
    section = None
    for line in doc.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            section = line if line in TABLES else None
            continue
        if (
            section is None
            or not line.startswith("| ")
            or line.startswith("| case")
            or line.startswith("|---")
        ):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        case, cell = cells[0], cells[-1]
        nodes: list[str] = []
        current: str | None = None
        for token in re.findall(r"`([^`]+)`", cell):
            if "::" not in token:
                if (
                    token.startswith("tests/")
                    and token.endswith(".py")
                    and Path(token).name.startswith("test_")
                ):
                    nodes.append(token)  # a whole test file
                continue
            path, _, name = token.partition("::")
            if path:
                if path.startswith("tests/"):
                    current = path
                else:
                    found = files.get(Path(path).name, [])
                    current = found[0].relative_to(ROOT).as_posix() if len(found) == 1 else path
            if current is not None and name:
                nodes.append(f"{current}::{name}")
        if not nodes and re.search(r"\bsame\b", cell) and out:
            nodes = list(out[-1][1])  # "same test": the row above's
        out.append((case, nodes))
    return out


def _results(junit: Path) -> dict[str, tuple[str, str]]:
    """{'file::name': (outcome, message)} from pytest's JUnit XML (parametrized ids folded: worst wins),
    and {'file': ...} for every file (the worst of its tests)."""
    order = {"passed": 0, "skipped": 1, "failed": 2}
    res: dict[str, tuple[str, str]] = {}
    for tc in ET.parse(junit).getroot().iter("testcase"):
        file = tc.get("file") or tc.get("classname", "").replace(".", "/") + ".py"
        name = re.sub(r"\[.*\]$", "", tc.get("name", ""))
        outcome, msg = "passed", ""
        for child in tc:
            if child.tag in ("failure", "error"):
                outcome, msg = "failed", (child.get("message") or "")[:200]
            elif child.tag == "skipped" and outcome != "failed":
                outcome, msg = "skipped", (child.get("message") or "")[:200]
        for key in (f"{file}::{name}", file):
            if key not in res or order[outcome] > order[res[key][0]]:
                res[key] = (outcome, msg)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tests.reliability_campaign", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--fast", action="store_true", help="leave out the tests marked slow")
    ap.add_argument("--list", action="store_true", help="print the cases and their tests, run nothing")
    a = ap.parse_args(argv)
    rows = cases()
    empty = [case for case, nodes in rows if not nodes]
    if a.list or empty:
        for case, nodes in rows:
            print(f"{case}: {', '.join(nodes) or 'NO TEST NAMED'}")
        return 2 if empty else 0
    nodes = sorted({n for _, ns in rows for n in ns})
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "junit_family=xunit1",
            f"--junitxml={junit}",
            "-m",
            "not slow" if a.fast else "",
            *nodes,
        ]
        subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        results = _results(junit) if junit.is_file() else {}
    failed = 0
    for case, ns in rows:
        outcomes = [(n, *results.get(n, ("deselected" if a.fast else "missing", ""))) for n in ns]
        bad = [o for o in outcomes if o[1] in ("failed", "missing")]
        skipped = [o for o in outcomes if o[1] in ("skipped", "deselected")]
        if bad:
            failed += 1
            verdict = f"FAILS: {bad[0][0]} ({bad[0][1]}: {bad[0][2]})"
        elif len(skipped) == len(outcomes):
            verdict = f"skipped: {skipped[0][2] or skipped[0][1]}"
        else:
            verdict = "holds"
        print(f"{verdict:<10.200} | {case}")
    print(f"{len(rows)} cases: {len(rows) - failed} hold or are skipped, {failed} fail")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
