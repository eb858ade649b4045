"""The background pre-training and the things that time: who pauses whom.

A long `python -m experiments.pretrain --background` run registers itself in
`cache_dir()/pretrain.pid` (its pid and run directory; removed when it ends). Whatever times something
on this machine — the benchmarks under bench/, the latency phase of an evaluation — wraps the timed
part in `paused()`: if the file names a live pre-training process, it is stopped (SIGSTOP) for the
duration and continued (SIGCONT) afterwards. The pre-training counts only active time against its
budget (`experiments.pretrain._Clock`), so pauses cost it nothing but wall time.

`paused()` nests within a process, and across processes the stop/continue pair is serialised by a
lock file beside the pid file, so one timer's SIGCONT never lands while another timer still times.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path

from filelock import FileLock

from mtpc.paths import cache_dir

PID_FILE = "pretrain.pid"
_depth = threading.local()


def pid_file() -> Path:
    return cache_dir() / PID_FILE


@contextlib.contextmanager
def register(run_dir: str | os.PathLike | None):
    """Write this process into the pid file for the duration (atomically; removed on the way out)."""
    path = pid_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps({"pid": os.getpid(), "run_dir": None if run_dir is None else str(Path(run_dir).resolve())}) + "\n")
    os.replace(tmp, path)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError, ValueError, KeyError):
            if json.loads(path.read_text())["pid"] == os.getpid():
                path.unlink()


def live_pretraining() -> int | None:
    """The pid the file names if that process is alive and is `experiments.pretrain`, else None
    (a stale file from a killed run, or a pid reused by another program, is never signalled)."""
    try:
        pid = int(json.loads(pid_file().read_text())["pid"])
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return pid if pid != os.getpid() and b"experiments.pretrain" in cmdline else None


def _wait_stopped(pid: int, timeout: float = 2.0) -> None:
    """SIGSTOP is delivered asynchronously: wait (bounded) until the kernel reports the process stopped,
    so nothing is timed while it still runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "Tt":
                return
        except (OSError, IndexError):
            return
        time.sleep(0.001)


@contextlib.contextmanager
def paused():
    """Stop the background pre-training (if any) while the block runs; continue it afterwards."""
    depth = getattr(_depth, "n", 0)
    if depth:
        _depth.n = depth + 1
        try:
            yield
        finally:
            _depth.n -= 1
        return
    pid = live_pretraining()
    if pid is None:
        yield
        return
    lock = FileLock(str(pid_file().with_suffix(".pause.lock")))
    with lock:
        _depth.n = 1
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
            _wait_stopped(pid)
        try:
            yield
        finally:
            _depth.n = 0
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
