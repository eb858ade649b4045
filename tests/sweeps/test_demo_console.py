"""The demo's console (`python -m sweeps.demo`, plumbing objective): exit 0, the four steps, and on
stderr only the sweep's own `[sweeps ...]` lines — MLflow's store set-up and Optuna's study
creation are silenced (experiments/plumbing/quiet.py), every other message would show up here; a finished
trial's line gives its objective rounded, not a raw float dict; the last line times each step."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_fixture_demo_prints_only_its_own_lines(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "sweeps.demo", "--objective", "fixture", "--out", str(tmp_path / "demo")]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    foreign = [line for line in out.stderr.splitlines() if line.strip() and not line.startswith("[sweeps ")]
    assert not foreign, (
        "unlisted messages (silence them in experiments/plumbing/quiet.py or print less):\n"
        + "\n".join(foreign)
    )
    assert "COMPLETE" in out.stderr and "trials: {'COMPLETE': 5}" in out.stdout
    done = [line for line in out.stderr.splitlines() if " COMPLETE" in line]
    assert len(done) == 5 and all(
        re.search(r" COMPLETE, derived_throughput \d{1,4}(\.\d{1,3})?$", line) for line in done
    ), done
    for step in ("2/4 sweep", "3/4 python -m analysis", "4/4 where things are"):
        assert step in out.stdout
    assert re.search(r"demo took \d+ s \(2/4 \d+ s, 3/4 \d+ s, 4/4 \d+ s\); exit code 0", out.stdout), (
        out.stdout[-500:]
    )


def test_a_second_demo_on_the_same_folder_is_refused(tmp_path, capsys):
    """Two demos writing one folder analysed 4 of 5 points and exited 0; the second is refused now."""
    from filelock import FileLock

    from sweeps.demo import main

    out = tmp_path / "demo"
    out.mkdir()
    with FileLock(str(out / ".demo.lock")):  # what a running demo holds
        assert main(["--objective", "fixture", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{out} is in use by another demo" in err and len(err.splitlines()) == 1, err
    assert sorted(p.name for p in out.iterdir()) == [".demo.lock"]  # nothing written
