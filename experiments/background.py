"""Who times, and who waits: one machine-wide timing lock, and the background pre-training it pauses.

Everything in the suite that times something — the evaluation's latency phase
(experiments.evaluate), the benchmarks under bench/ — wraps the timed part in `timing()`:

- it takes the machine-wide timing lock (`$MTPC_TIMING_LOCK`, default `<tmp>/mtpc-timing.lock`), so
  one thing times at a time on this machine (trials still train side by side);
- if `cache_dir()/pretrain.pid` names a live `python -m experiments.pretrain --background` process,
  that process is stopped (SIGSTOP) for the duration and continued (SIGCONT) afterwards. The
  pre-training counts only active time against its budget (`experiments.pretrain._Clock`), so the
  pauses cost it nothing but wall time.

`timing()` nests within a process (only the outermost takes the lock and signals).

Work that shares the machine with a timer but must not disturb it — a sweep trial training while
another trial's latency is timed — calls `wait_while_timing()` between steps (training does, through
`experiments.callbacks.YieldToTimer`): it returns at once when nobody times, and otherwise waits
until the timer is done, so a timed figure does not depend on what the other workers happen to do.
What a timer starts inside its timed block (a bench timing a training subprocess) inherits
`MTPC_TIMING_HELD_BY` and is part of the timing: it neither waits nor takes the lock again.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from filelock import FileLock, Timeout

from mtpc.paths import cache_dir

PID_FILE = "pretrain.pid"
TIMING_LOCK_ENV = "MTPC_TIMING_LOCK"
TIMER_ENV = "MTPC_TIMING_HELD_BY"
"""Set (to the timer's pid) in the environment of everything a timer starts inside `timing()`: such a
child is part of what is timed, so it neither waits for the lock its parent holds nor takes it again."""
_depth = threading.local()


def timing_lock_path() -> Path:
    """The machine-wide timing lock's file: $MTPC_TIMING_LOCK, else `<tmp>/mtpc-timing.lock`."""
    return Path(os.environ.get(TIMING_LOCK_ENV) or Path(tempfile.gettempdir()) / "mtpc-timing.lock")


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


def wait_while_timing() -> float:
    """Block while another process holds the timing lock; return the seconds waited (0.0 at once
    when nobody times, or when this thread is the timer itself)."""
    if getattr(_depth, "n", 0) or os.environ.get(TIMER_ENV):
        return 0.0  # the timer itself, or a process its timed block started
    lock = FileLock(str(timing_lock_path()), mode=0o666)
    t0 = time.monotonic()
    try:
        lock.acquire(timeout=0)
    except Timeout:
        lock.acquire()  # the timer is done when it releases
    lock.release()
    return time.monotonic() - t0


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def timing(progress: bool = False):
    """Hold the machine-wide timing lock and keep the background pre-training (if any) stopped while
    the block runs; yields the seconds waited for the lock. With `progress`, says on stderr when it
    has to wait."""
    depth = getattr(_depth, "n", 0) or (1 if os.environ.get(TIMER_ENV) else 0)  # started by a timer: nested
    if depth:
        _depth.n = depth + 1
        try:
            yield 0.0
        finally:
            _depth.n -= 1
        return
    lock = FileLock(str(timing_lock_path()), mode=0o666)  # any user's evaluation may take it next
    t0 = time.monotonic()
    try:
        lock.acquire(timeout=0)
    except Timeout:
        if progress:
            print(f"waiting for the timing lock {timing_lock_path()} (something else is timing)", file=sys.stderr, flush=True)
        lock.acquire()
    waited = time.monotonic() - t0
    pid = live_pretraining()
    _depth.n = 1
    os.environ[TIMER_ENV] = str(os.getpid())
    # SIGTERM's default action (a `timeout`, a `kill`) ends the process without running the finally below,
    # which would leave the pre-training stopped for good: while a pre-training is held, SIGTERM raises
    # SystemExit instead (SIGINT already raises; SIGKILL cannot be caught: `kill -CONT <pid>` then).
    held_term = None
    if pid is not None and threading.current_thread() is threading.main_thread() \
            and signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        held_term = signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                _wait_stopped(pid)
        yield waited
    finally:
        _depth.n = 0
        os.environ.pop(TIMER_ENV, None)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        if held_term is not None:
            signal.signal(signal.SIGTERM, held_term)
        lock.release()
