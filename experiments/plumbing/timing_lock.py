"""Who times, and who waits: one machine-wide timing lock, and the background work it pauses.

Everything in the suite that times something — the evaluation's latency phase
(experiments.evaluation.decoding), the benchmarks under bench/ — wraps the timed part in `timing()`:

- it takes the machine-wide timing lock (`$MTPC_TIMING_LOCK`, default `<tmp>/mtpc-timing.lock`), so
  one thing times at a time on this machine (trials still train side by side);
- every process that registered as pausable background work (a `--background` pre-training, a head
  training started by `python -m experiments.background run -- ...`) is stopped (SIGSTOP) for the
  duration and continued (SIGCONT) afterwards. The pre-training counts only active time against its
  budget (`experiments.pretraining.loop.Clock`), so the pauses cost it nothing but wall time.

The pause protocol. A registrant proves it is the suite's own by holding a lock the kernel keeps:
it writes `cache_dir()/pausable/<pid>.json` (pid and start time) under a temporary name, takes an
exclusive `flock` on it, and only then renames it into place; it holds that lock for its lifetime
(across `exec`, which keeps the pid and the lock). A timer signals a pid only if `/proc/locks` says
that very pid holds the lock on that very file and the pid's start time is the one recorded — never
because of what a command line or a file's text says. A file naming an unrelated process, a stale
file of a process that died (its lock died with it), a reused pid: none is signalled. Several
registrants may register at once. If the timer dies by SIGKILL, a guardian it started (`sh`, in a
session of its own, reading a pipe only the timer holds) continues what it stopped.

`timing()` nests within a process (only the outermost takes the lock and signals).

Work that shares the machine with a timer but must not disturb it — a sweep trial training while
another trial's latency is timed — calls `wait_while_timing()` between steps (training does, through
`experiments.training.callbacks.YieldToTimer`): it returns at once when nobody times, and otherwise waits
until the timer is done, so a timed figure does not depend on what the other workers happen to do.
While it waits it says once who holds the lock (pid, command, and whether that process is stopped),
and it leaves as soon as its `should_stop` says so (a SIGTERM / SIGUSR1 to the training).

Heavy untimed work that cannot pause between steps — the offline acceptance decoding every prompt of
a set — runs inside `heavy()`: it holds the same lock shared (`fcntl.flock`, LOCK_SH), the timer holds
it exclusive. So heavy blocks and training run side by side (two sweep workers decode their prompt
sets at once, a third trains), a timer waits until every heavy block is done, and a heavy block
asked for while a timer waits or times waits for it (a gate file, `<lock>.gate`, held by the timer
while it waits, gives the timer precedence, so a stream of heavy blocks cannot starve it).
What a timer starts inside its timed block (a bench timing a training subprocess) inherits
`MTPC_TIMING_HELD_BY` and is part of the timing: it neither waits nor takes the lock again.

The lock file is opened read-only without following links (`flock` needs no write access), created
by whoever comes first with an explicit `fchmod(0o666)`; a lock path that is a link, a folder or any
other non-regular file is refused with one line naming it (`TimingLockError`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from mtpc.paths import cache_dir

PAUSABLE_DIR = "pausable"
TIMING_LOCK_ENV = "MTPC_TIMING_LOCK"
TIMER_ENV = "MTPC_TIMING_HELD_BY"
"""Set (to the timer's pid) in the environment of everything a timer starts inside `timing()`: such a
child is part of what is timed, so it neither waits for the lock its parent holds nor takes it again."""
MAX_REGISTRANTS = 64
"""At most this many registry files are read per timed block (a flooded folder cannot stall a timer)."""
_REGISTRY_BYTES = 4096
_POLL_S = 0.05
_depth = threading.local()
_heavy = threading.local()


class TimingLockError(ValueError):
    """The timing lock's path cannot be used (a link, a folder, not a regular file, not openable)."""


def timing_lock_path() -> Path:
    """The machine-wide timing lock's file: $MTPC_TIMING_LOCK, else `<tmp>/mtpc-timing.lock`."""
    return Path(os.environ.get(TIMING_LOCK_ENV) or Path(tempfile.gettempdir()) / "mtpc-timing.lock")


def _open_lock(path: Path) -> int:
    """A read-only fd of the lock file `path`, created (mode 0o666, whatever the umask) if missing.
    Never follows a link; refuses anything but a regular file with one line naming it."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    for _ in range(3):
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o666)
            except FileExistsError:
                continue  # another process created it first: open theirs
            except OSError as e:
                raise TimingLockError(
                    f"timing lock {path}: cannot create it ({e.strerror}); "
                    f"set {TIMING_LOCK_ENV} to a writable file path"
                ) from None
            try:
                os.fchmod(fd, 0o666)  # the umask cut 0o666: any user's evaluation may take it next
            except OSError:
                pass
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise TimingLockError(
                    f"timing lock {path} is a symbolic link; expected a regular file "
                    f"(remove it, or set {TIMING_LOCK_ENV} to another path)"
                ) from None
            raise TimingLockError(
                f"timing lock {path}: cannot open it ({e.strerror}); expected a regular "
                f"file any user can read (or set {TIMING_LOCK_ENV})"
            ) from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            kind = "a folder" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            raise TimingLockError(
                f"timing lock {path} is {kind}; expected a regular file "
                f"(set {TIMING_LOCK_ENV} to a file path)"
            )
        return fd
    raise TimingLockError(
        f"timing lock {path}: created and removed under us three times; expected a stable file"
    )


def check_timing_lock() -> Path:
    """Fail now, in one line, if the timing lock cannot be used (CLIs call it before any long work)."""
    path = timing_lock_path()
    os.close(_open_lock(path))
    os.close(_open_lock(_gate_path()))
    return path


def _flock(path: Path, how: int, wait: bool = True) -> int | None:
    """An fd of the lock file `path` locked with `how` (fcntl.LOCK_SH / LOCK_EX); None when `wait` is
    False and another process holds it against `how`."""
    fd = _open_lock(path)
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


# ---- who holds a lock: the kernel's word (/proc/locks), not a file's --------------------------------


def _flock_holders(fd_or_path: int | Path) -> list[tuple[int, str]]:
    """(pid, 'READ'/'WRITE') of every process holding a flock on the file (by device and inode)."""
    try:
        st = (
            os.fstat(fd_or_path)
            if isinstance(fd_or_path, int)
            else os.stat(fd_or_path, follow_symlinks=False)
        )
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return []
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    out = []
    for line in lines:
        f = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 00:2f:5678 0 EOF" (a blocked waiter's line has "->" after the id)
        if "->" in f or len(f) < 6 or f[1] != "FLOCK":
            continue
        if f[5] == key:
            with contextlib.suppress(ValueError):
                out.append((int(f[4]), f[3]))
    return out


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22), None if gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def describe(pid: int) -> str:
    """'pid 123 (python -m experiments.evaluate …), stopped' — for messages about who holds what."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        cmd = "?"
    cmd = cmd if len(cmd) <= 80 else cmd[:77] + "..."
    stopped = ", stopped (kill -CONT it or end it)" if _state(pid) in "Tt" else ""
    return f"pid {pid} ({cmd}){stopped}"


def lock_holders() -> list[int]:
    """The pids holding the timing lock now (empty if none, or if /proc/locks cannot be read)."""
    path = timing_lock_path()
    return [pid for pid, _ in _flock_holders(path)] if path.is_file() else []


# ---- the pause protocol ----------------------------------------------------------------------------


def pausable_dir() -> Path:
    return cache_dir() / PAUSABLE_DIR


@contextlib.contextmanager
def register(run_dir: str | os.PathLike | None = None, what: str = "background work") -> Iterator[Path]:
    """Register this process as pausable background work for the duration (module docstring): a file
    `pausable_dir()/<pid>.json` this process holds an exclusive flock on; removed on the way out."""
    fd, path = _register(run_dir, what, inheritable=False)
    try:
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            if os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino:
                path.unlink()
        _unlock(fd)


def _register(run_dir: str | os.PathLike | None, what: str, inheritable: bool) -> tuple[int, Path]:
    folder = pausable_dir()
    folder.mkdir(parents=True, exist_ok=True)
    pid = os.getpid()
    path = folder / f"{pid}.json"
    tmp = folder / f".{pid}.json.tmp"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(
        tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | (0 if inheritable else os.O_CLOEXEC), 0o644
    )
    try:
        if inheritable:
            os.set_inheritable(fd, True)
        fcntl.flock(fd, fcntl.LOCK_EX)  # locked before it is in place: a file in place and unlocked is stale
        record = {
            "pid": pid,
            "start_time": _start_time(pid),
            "what": what,
            "run_dir": None if run_dir is None else str(Path(run_dir).resolve()),
        }
        os.write(fd, (json.dumps(record) + "\n").encode())
        os.replace(tmp, path)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    return fd, path


def registered() -> list[int]:
    """The pids of live registrants that prove they are the suite's own (module docstring); stale files
    (nobody holds their lock) are removed on the way."""
    folder = pausable_dir()
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".json") and not n.startswith("."))
    except OSError:
        return []
    me, pids = os.getpid(), []
    for name in names[:MAX_REGISTRANTS]:
        path = folder / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            record = json.loads(os.read(fd, _REGISTRY_BYTES))
            pid, start = int(record["pid"]), record["start_time"]
            holders = [p for p, how in _flock_holders(fd) if how == "WRITE"]
            if not holders:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if somebody holds it after all
                with contextlib.suppress(OSError):
                    path.unlink()  # nobody holds it: a stale file of a process that is gone
                continue
            if holders == [pid] and pid != me and start is not None and _start_time(pid) == int(start):
                pids.append(pid)
        except (OSError, ValueError, KeyError, TypeError):
            continue
        finally:
            os.close(fd)
    return pids


def _wait_stopped(pid: int, timeout: float = 2.0) -> None:
    """SIGSTOP is delivered asynchronously: wait (bounded) until the kernel reports the process stopped,
    so nothing is timed while it still runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _state(pid) in "Tt?":
            return
        time.sleep(0.001)


def _guardian(pids: list[int]) -> subprocess.Popen:
    """A process in a session of its own that continues `pids` when its stdin closes: when the timer
    closes it, or when the kernel does because the timer died (SIGKILL included)."""
    script = "read _ ; kill -CONT " + " ".join(str(p) for p in pids) + " 2>/dev/null"
    return subprocess.Popen(
        ["/bin/sh", "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )


# ---- the three holds ---------------------------------------------------------------------------------


def wait_while_timing(should_stop: Callable[[], bool] | None = None, say: bool = True) -> float:
    """Block while another process holds the timing lock; return the seconds waited (0.0 at once
    when nobody times, or when this thread is the timer itself). Says once on stderr who holds it
    when the wait is not short; returns early once `should_stop()` is true."""
    if getattr(_depth, "n", 0) or os.environ.get(TIMER_ENV):
        return 0.0  # the timer itself, or a process its timed block started
    t0 = time.monotonic()
    fd = _open_lock(timing_lock_path())
    told = False
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # shared: heavy blocks do not hold training up
                break
            except BlockingIOError:
                pass
            if should_stop is not None and should_stop():
                break
            if say and not told and time.monotonic() - t0 > 5.0:
                who = [describe(p) for p, how in _flock_holders(fd) if how == "WRITE"] or ["another process"]
                print(
                    f"waiting for the timing lock {timing_lock_path()}, held by {'; '.join(who)}",
                    file=sys.stderr,
                    flush=True,
                )
                told = True
            time.sleep(_POLL_S)
    finally:
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
    """Hold the machine-wide timing lock and keep the registered background work stopped while the
    block runs; yields the seconds waited for the lock. With `progress`, says on stderr when it has to
    wait, and who holds the lock."""
    depth = getattr(_depth, "n", 0) or (1 if os.environ.get(TIMER_ENV) else 0)  # started by a timer: nested
    if depth:
        _depth.n = depth + 1
        try:
            yield 0.0
        finally:
            _depth.n -= 1
        return
    if getattr(_heavy, "n", 0):
        raise RuntimeError(
            "timing() inside heavy(): a timed block cannot start while this thread holds the lock shared"
        )
    t0 = time.monotonic()
    fd = _flock(timing_lock_path(), fcntl.LOCK_EX, wait=False)
    if fd is None:
        if progress:
            who = [describe(p) for p in lock_holders() if p != os.getpid()] or ["another process"]
            print(f"waiting for the timing lock {timing_lock_path()}, held by {'; '.join(who)}",
                  file=sys.stderr, flush=True)  # fmt: skip
        gate = _flock(_gate_path(), fcntl.LOCK_EX)  # heavy blocks asked for from now on wait for this timer
        try:
            fd = _flock(timing_lock_path(), fcntl.LOCK_EX)
        finally:
            _unlock(gate)
    waited = time.monotonic() - t0
    pids = registered()
    _depth.n = 1
    os.environ[TIMER_ENV] = str(os.getpid())
    # SIGTERM's default action (a `timeout`, a `kill`) ends the process without running the finally below:
    # while background work is held, SIGTERM raises SystemExit instead (SIGINT already raises); SIGKILL
    # cannot be caught: the guardian continues them then.
    held_term = None
    if (
        pids
        and threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None)
    ):
        held_term = signal.signal(signal.SIGTERM, _exit_on_signal)
    guardian = None
    try:
        if pids:
            guardian = _guardian(pids)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGSTOP)
            for pid in pids:
                _wait_stopped(pid)
        yield waited
    finally:
        _depth.n = 0
        os.environ.pop(TIMER_ENV, None)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGCONT)
        if guardian is not None:
            with contextlib.suppress(OSError):
                guardian.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                guardian.wait(timeout=5)
        if held_term is not None:
            signal.signal(signal.SIGTERM, held_term)
        _unlock(fd)


# ---- `python -m experiments.background run -- CMD ...`: pausable background work ------------------


def run_registered(argv: list[str], what: str | None = None, nice: int = 19) -> None:
    """Register this process (the lock inherited across exec), lower its priority, and become `argv`."""
    fd, _ = _register(None, what or " ".join(argv)[:200], inheritable=True)
    if nice:
        os.nice(nice)
    try:
        os.execvp(argv[0], argv)
    except OSError as e:
        os.close(fd)
        raise SystemExit(f"experiments.background: cannot run {argv[0]!r}: {e.strerror}") from None
