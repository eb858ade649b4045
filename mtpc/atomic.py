"""Atomic file writes: a file is either its previous complete version or the new complete one.

Every write goes to a temporary file `<name>.tmp<pid>` in the destination's own directory (so the
final rename never crosses a filesystem), is flushed and fsynced, then renamed over the target and
the directory fsynced. A failed write (a full disk, a signal, a crash) leaves the previous file
untouched; a full disk is reported as an OSError naming the path and saying "no space left".
Temporaries of processes that died (kill -9) are removed by `remove_stale_temps`.

`sha256_file` is the checksum the manifests (shipped model, head exports, corpus cache) record.

Leaves out: what is written (callers serialise: torch.save into bytes, json.dumps, ...).
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

__all__ = [
    "atomic_open",
    "check_writable",
    "commit_dir",
    "disk_error",
    "fsync_dir",
    "remove_stale_temps",
    "sha256_file",
    "temp_name",
    "write_bytes",
    "write_json",
    "write_text",
]

_FULL = (errno.ENOSPC, errno.EDQUOT)


def temp_name(path: str | os.PathLike) -> Path:
    """The temporary sibling of `path` this process writes before renaming: `<name>.tmp<pid>`."""
    path = Path(path)
    return path.with_name(f"{path.name}.tmp{os.getpid()}")


def disk_error(err: OSError, path: str | os.PathLike) -> OSError:
    """`err` as an OSError naming `path`; a full disk (ENOSPC, EDQUOT) says "no space left"."""
    if err.errno in _FULL:
        return OSError(
            err.errno,
            f"{path}: no space left on device; free space and retry "
            f"(the previous {Path(path).name}, if any, is unchanged)",
        )
    return OSError(err.errno, f"{path}: {err.strerror or err}")


class _FdWriter(io.RawIOBase):
    """A raw writer on a file descriptor that writes with os.write (write(2)), nothing else."""

    def __init__(self, fd: int):
        super().__init__()
        self.fd = fd

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        return os.write(self.fd, b)

    def fileno(self) -> int:
        return self.fd


def fsync_dir(directory: str | os.PathLike) -> None:
    """fsync a directory so a rename in it survives a power loss (no-op where unsupported)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb", encoding: str = "utf-8") -> Iterator[IO]:
    """`with atomic_open(path, "w") as f: f.write(...)`: `path` is replaced only when the block ends
    without an exception, after flush + fsync; otherwise the temporary is removed and `path` is
    as it was. Modes: "wb" or "w" (text, `encoding`)."""
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_open: mode must be 'wb' or 'w', got {mode!r}")
    path = Path(path)
    tmp = temp_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    except OSError as err:
        raise disk_error(err, path) from None
    buffered = io.BufferedWriter(_FdWriter(fd), buffer_size=1 << 20)
    f: IO = buffered if mode == "wb" else io.TextIOWrapper(buffered, encoding=encoding, newline="")
    try:
        yield f
        f.flush()
        os.fsync(fd)
        f.close()
        os.replace(tmp, path)
    except BaseException as err:
        try:
            f.close()
        except OSError:
            pass
        tmp.unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise disk_error(err, path) from None
        raise
    fsync_dir(path.parent)


def check_writable(path: str | os.PathLike, what: str = "output") -> Path:
    """Check, before any work, that a file can be written at `path`: not a directory, and its folder
    (or the nearest existing one above it) writable. ValueError in one line naming `what` and the path."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise ValueError(f"{what} {path}: is a directory; give a file path")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{what} {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{what} {path}: {parent} is not writable")
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{what} {path}: not writable")
    return path


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Replace `path` by `data` atomically."""
    with atomic_open(path, "wb") as f:
        f.write(data)


def write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> None:
    """Replace `path` by `text` atomically."""
    with atomic_open(path, "w", encoding=encoding) as f:
        f.write(text)


def write_json(path: str | os.PathLike, obj: Any, **dumps_kw: Any) -> None:
    """Replace `path` by `json.dumps(obj, **dumps_kw)` + newline atomically."""
    write_text(path, json.dumps(obj, **dumps_kw) + "\n")


def commit_dir(tmp_dir: str | os.PathLike, target: str | os.PathLike) -> None:
    """Rename a fully written directory `tmp_dir` (a sibling of `target`) to `target`, after
    fsyncing each file in it; `target` must not exist. The directory appears complete or not at all."""
    tmp_dir, target = Path(tmp_dir), Path(target)
    for p in tmp_dir.iterdir():
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fsync_dir(tmp_dir)
    os.rename(tmp_dir, target)
    fsync_dir(target.parent)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """The hex SHA-256 of a file's bytes (the checksum manifests record)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def remove_stale_temps(directory: str | os.PathLike, name: str | None = None) -> list[Path]:
    """Remove `<name>.tmp<pid>` files and folders in `directory` whose process is gone (a kill -9
    mid-write); `name` None matches any name. Returns what was removed. Temporaries of live
    processes (this one included) are kept."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    pattern = re.compile(rf"^{re.escape(name) if name is not None else '.+'}\.tmp(\d+)$")
    removed = []
    for p in directory.iterdir():
        m = pattern.match(p.name)
        if not m or _pid_alive(int(m.group(1))):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p)
    return removed
