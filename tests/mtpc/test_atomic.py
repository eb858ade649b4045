"""Atomic writes: the previous file survives a full disk or an exception mid-write, the error names
the path and says "no space left", temporaries of dead processes are removed, live ones kept."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mtpc.atomic import atomic_open, remove_stale_temps, temp_name, write_bytes, write_json, write_text
from tests.faults import full_disk, small_tmpfs


def test_a_full_disk_keeps_the_previous_file_and_names_the_path(tmp_path, monkeypatch):
    target = tmp_path / "result.json"
    write_json(target, {"good": 1})
    full_disk(monkeypatch, tmp_path, after=5)  # a short write, then ENOSPC
    with pytest.raises(OSError, match=rf"{target}: no space left"):
        write_bytes(target, b"x" * 100_000)
    monkeypatch.undo()
    assert json.loads(target.read_text()) == {"good": 1}
    assert list(tmp_path.iterdir()) == [target]  # no temporary left behind


def test_on_a_real_full_tmpfs_the_previous_file_stays_readable():
    with small_tmpfs("1m") as d:
        target = d / "blob.bin"
        write_bytes(target, b"a" * 1000)
        with pytest.raises(OSError, match="no space left"):
            write_bytes(target, os.urandom(2 * 2**20))
        assert target.read_bytes() == b"a" * 1000
        assert [p.name for p in d.iterdir()] == ["blob.bin"]


def test_an_exception_inside_the_block_leaves_the_file_untouched(tmp_path):
    target = tmp_path / "a.txt"
    write_text(target, "old")
    with pytest.raises(RuntimeError), atomic_open(target, "w") as f:
        f.write("new, half")
        raise RuntimeError("killed")
    assert target.read_text() == "old" and not temp_name(target).exists()


def test_stale_temporaries_of_dead_processes_are_removed(tmp_path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    pid = int(dead.stdout)
    (tmp_path / f"sharegpt-v1.tmp{pid}").mkdir()
    (tmp_path / f"sharegpt-v1.tmp{pid}" / "train.jsonl").write_text("x")
    (tmp_path / f"sharegpt-v1.tmp{os.getpid()}").mkdir()  # a live build: kept
    (tmp_path / "other.tmp1").write_text("x")  # another name: kept
    removed = remove_stale_temps(tmp_path, "sharegpt-v1")
    assert [p.name for p in removed] == [f"sharegpt-v1.tmp{pid}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"sharegpt-v1.tmp{os.getpid()}", "other.tmp1"]
    )
