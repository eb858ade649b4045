"""Fault injection for the reliability tests: a full disk at the write(2) call, a small tmpfs.

`full_disk(monkeypatch, under, after=N)`: os.write on any file below `under` writes at most the
remaining `after` bytes, then fails with ENOSPC — what write(2) does on a full filesystem (a
short write, then ENOSPC), for every writer that goes through os.write (mtpc.atomic does).
`small_tmpfs(size)`: a real tmpfs of `size` mounted for the test (needs root; skips otherwise,
the injected ENOSPC tests cover the same paths without it).
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import tempfile
from pathlib import Path

import pytest


def full_disk(monkeypatch, under: Path, after: int = 0) -> None:
    real_write = os.write
    left = [after]
    under = str(Path(under).resolve())

    def write(fd: int, data) -> int:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if not target.startswith(under):
            return real_write(fd, data)
        if left[0] <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = real_write(fd, bytes(memoryview(data)[: left[0]]))
        left[0] -= n
        return n

    monkeypatch.setattr(os, "write", write)


@contextlib.contextmanager
def small_tmpfs(size: str = "2m"):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (the injected-ENOSPC tests cover the same writes)")
    d = Path(tempfile.mkdtemp(prefix="mtpc-tmpfs-"))
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)], capture_output=True, text=True
    )
    if r.returncode != 0:
        d.rmdir()
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()})")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)
        d.rmdir()


def fill(directory: Path, leave: int = 0) -> None:
    """Fill the filesystem of `directory` with a filler file until at most `leave` bytes are free."""
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    with open(Path(directory) / "filler", "wb") as f:
        try:
            f.write(b"\0" * max(0, free - leave))
            f.flush()
        except OSError:
            pass
