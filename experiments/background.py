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

Heavy untimed work that cannot pause between steps — the offline acceptance decoding every prompt of
a set — runs inside `heavy()`: it holds the same lock shared (`fcntl.flock`, LOCK_SH), the timer holds
it exclusive. So heavy blocks and training run side by side (two sweep workers decode their prompt
sets at once, a third trains), a timer waits until every heavy block is done, and a heavy block
asked for while a timer waits or times waits for it (a gate file, `<lock>.gate`, held by the timer
while it waits, gives the timer precedence, so a stream of heavy blocks cannot starve it).
What a timer starts inside its timed block (a bench timing a training subprocess) inherits
`MTPC_TIMING_HELD_BY` and is part of the timing: it neither waits nor takes the lock again.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from mtpc.paths import cache_dir

PID_FILE = "pretrain.pid"
TIMING_LOCK_ENV = "MTPC_TIMING_LOCK"
TIMER_ENV = "MTPC_TIMING_HELD_BY"
"""Set (to the timer's pid) in the environment of everything a timer starts inside `timing()`: such a
child is part of what is timed, so it neither waits for the lock its parent holds nor takes it again."""
_depth = threading.local()
_heavy = threading.local()


def _flock(path: Path, how: int, wait: bool = True) -> int | None:
    """An fd of `path` (created, mode 0o666 so that any user's evaluation may take it next) locked with
    `how` (fcntl.LOCK_SH / LOCK_EX); None when `wait` is False and another process holds it against `how`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, how | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _unlock(fd: int) -> None:
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def _gate_path() -> Path:
    path = timing_lock_path()
    return path.with_name(path.name + ".gate")


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
    t0 = time.monotonic()
    fd = _flock(timing_lock_path(), fcntl.LOCK_SH)  # shared: heavy blocks do not hold training up, a timer does
    _unlock(fd)
    return time.monotonic() - t0


@contextlib.contextmanager
def heavy():
    """Hold the timing lock shared for heavy untimed work (the offline acceptance's decoding): no timer
    runs beside it, other heavy blocks and training do (module docstring). Waits while a timer times or
    waits. Inside `timing()`, or nested, it does nothing more."""
    if getattr(_depth, "n", 0) or getattr(_heavy, "n", 0) or os.environ.get(TIMER_ENV):
        _heavy.n = getattr(_heavy, "n", 0) + 1
        try:
            yield
        finally:
            _heavy.n -= 1
        return
    _unlock(_flock(_gate_path(), fcntl.LOCK_EX))  # a waiting timer holds the gate: it goes first
    fd = _flock(timing_lock_path(), fcntl.LOCK_SH)
    _heavy.n = 1
    try:
        yield
    finally:
        _heavy.n = 0
        _unlock(fd)


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
    if getattr(_heavy, "n", 0):
        raise RuntimeError("timing() inside heavy(): a timed block cannot start while this thread holds the lock shared")
    t0 = time.monotonic()
    fd = _flock(timing_lock_path(), fcntl.LOCK_EX, wait=False)
    if fd is None:
        if progress:
            print(f"waiting for the timing lock {timing_lock_path()} (something else is timing or decoding)",
                  file=sys.stderr, flush=True)  # fmt: skip
        gate = _flock(_gate_path(), fcntl.LOCK_EX)  # heavy blocks asked for from now on wait for this timer
        try:
            fd = _flock(timing_lock_path(), fcntl.LOCK_EX)
        finally:
            _unlock(gate)
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
        _unlock(fd)
