"""The Optuna journal file after a crash: a torn line is found and repaired before the study opens.

Optuna appends each batch of operations as JSON lines and fsyncs. A write cut short (a full disk,
kill -9 mid-write) leaves a line without its end; Optuna skips it while it is the last line, but
the next append lands on the same line, and from then on every read fails with JSONDecodeError
(the sweep exits 70 forever, `--status` fails). An operation that was cut short was never
acknowledged to its writer, so repairing means dropping exactly the torn fragment:
- a torn last line (no newline): truncated;
- a torn fragment followed by a later operation on the same line: the fragment is dropped and the
  operation kept (the shortest suffix of the line that is one whole JSON operation).
Done under Optuna's own journal lock (`JournalFileSymlinkLock`); each repair is logged with the
line number and the bytes dropped. A line that cannot be repaired this way is reported with its
number and the exact command that drops it. Leaves out: opening the study (sweeps/study.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from mtpc.atomic import write_bytes


class JournalError(RuntimeError):
    """A journal line that is not a torn write: the message names the file, line and repair."""


def _operation(text: bytes) -> bool:
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(obj, dict) and "op_code" in obj


def _repair_line(line: bytes) -> tuple[bytes, int] | None:
    """(the whole operation at the end of a torn line, bytes dropped) or None."""
    for i in range(1, len(line)):
        if line[i : i + 1] == b"{" and _operation(line[i:]):
            return line[i:], i
    return None


def repair(path: str | os.PathLike) -> list[str]:
    """Repair torn writes in the journal at `path` in place; returns one message per repair.

    Raises JournalError for a line that is neither an operation nor a torn one.
    """
    from optuna.storages.journal import JournalFileSymlinkLock

    path = Path(path)
    if not path.is_file() or path.stat().st_size == 0:
        return []
    lock = JournalFileSymlinkLock(str(path))
    lock.acquire()
    try:
        data = path.read_bytes()
        lines = data.split(b"\n")
        tail = lines.pop()  # b"" when the file ends with a newline
        notes, out = [], []
        for number, line in enumerate(lines, 1):
            if not line.strip() or _operation(line):
                out.append(line)
                continue
            fixed = _repair_line(line)
            if fixed is None:
                raise JournalError(
                    f"{path}:{number}: not an Optuna journal operation; after a backup, drop that line with "
                    f"`sed -i '{number}d' {path}` (the trials it touched rerun on --resume)"
                )
            out.append(fixed[0])
            notes.append(
                f"{path}:{number}: dropped a torn write of {fixed[1]} bytes (an operation cut short "
                "by a crash or a full disk); the operation after it is kept"
            )
        if tail:
            notes.append(
                f"{path}:{len(lines) + 1}: dropped a torn last line of {len(tail)} bytes (an operation "
                "cut short by a crash or a full disk)"
            )
        if notes:
            write_bytes(path, b"".join(line + b"\n" for line in out))
        return notes
    finally:
        lock.release()
