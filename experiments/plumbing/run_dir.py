"""What a run directory holds and who may use it: one run's identity, its checkpoints, how to resume.

- Identity: `<run.dir>/run.json` = {"config_hash", "run_id", "config"}: the SHA-256 of the resolved
  config without the keys a resume may change (`RESUMABLE_KEYS`: the stop length, console and
  bookkeeping settings, the `run` section), and a random id kept across resumes. A run refuses a
  directory whose checkpoints belong to another config (naming the keys that differ), refuses to
  start afresh over its own checkpoints (resume with `--ckpt_path last`), and `--ckpt_path last`
  resumes only the same run. Every checkpoint also carries the identity (`mtpc_run`), so an
  explicit checkpoint file of another run is refused too.
- One live run per directory: `RunLock`, a `flock` on `<run.dir>/.lock` held by rank 0 from before
  the identity is read until the head is exported (the OS drops it when the holder dies, kill -9
  included), so a second start or a resume beside a live run is refused naming the holder's pid.
  The other ranks of a multi-process run neither take nor check it (their rank 0 holds it).
- A directory with checkpoints or a head export but no `run.json` is refused: whose they are is unknown.
- Resume paths: local files only (a URL is refused: Lightning would download and unpickle it),
  checked before anything loads; `last` with nothing to resume says so.
- `AtomicCheckpointIO`: Lightning's checkpoint I/O with atomic writes on the destination
  filesystem (`mtpc.atomic`) and loads with `weights_only=True`.
Leaves out: what is trained (experiments/training/fit.py), the stop-on-signal callback (experiments/training/callbacks.py).
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import uuid
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback

from mtpc.atomic import write_bytes, write_json

IDENTITY_FILE = "run.json"
LOCK_FILE = ".lock"
CHECKPOINT_KEY = "mtpc_run"
#: keys a resumed run may change without becoming another run
RESUMABLE_KEYS = (
    "trainer.max_steps",
    "trainer.max_epochs",
    "trainer.enable_progress_bar",
    "trainer.enable_model_summary",
    "trainer.log_every_n_steps",
)


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v and k != "backbone_kwargs":
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


#: options added after runs were stored, at the value that leaves a run as it was: a config at that value
#: hashes as one written before the option existed, so a stored study resumes and a pre-empted trial
#: accepts its own checkpoint after an upgrade (set to anything else, the option is part of the identity)
LATER_OPTIONS = {"model.known_byte": False}


def identity_config(config: dict[str, Any]) -> dict[str, Any]:
    """The flat resolved config that defines a run: without `run.*`, `RESUMABLE_KEYS` and the
    `LATER_OPTIONS` left at their neutral value."""
    return {
        k: v
        for k, v in _flat(config).items()
        if not k.startswith("run.")
        and k not in RESUMABLE_KEYS
        and not (k in LATER_OPTIONS and v == LATER_OPTIONS[k])
    }


def config_hash(config: dict[str, Any]) -> str:
    return hashlib.sha256(
        json.dumps(identity_config(config), sort_keys=True, default=str).encode()
    ).hexdigest()


def _differences(old: dict[str, Any], new: dict[str, Any]) -> str:
    a, b = identity_config(old), identity_config(new)
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    return ", ".join(f"{k} {a.get(k)!r} -> {b.get(k)!r}" for k in keys[:4]) + (
        ", ..." if len(keys) > 4 else ""
    )


def has_checkpoints(run_dir: Path) -> bool:
    d = Path(run_dir) / "checkpoints"
    return d.is_dir() and any(d.glob("*.ckpt"))


def check_ckpt_path(ckpt_path: str | Path | None, run_dir: Path) -> str | None:
    """The checkpoint to resume from (a local file), or None; ValueError in one line otherwise."""
    if ckpt_path is None:
        return None
    text = str(ckpt_path)
    if "://" in text:
        raise ValueError(
            f"--ckpt_path {text}: only local checkpoint files are accepted (a URL would be downloaded "
            "and unpickled); download it yourself and pass its path"
        )
    if text == "last":
        last = Path(run_dir) / "checkpoints" / "last.ckpt"
        if not last.is_file():
            raise ValueError(
                f"--ckpt_path last: nothing to resume, {last} does not exist "
                "(drop --ckpt_path to start a new run)"
            )
        return str(last)
    path = Path(text).expanduser()
    if not path.is_file():
        raise ValueError(f"--ckpt_path {text}: no such checkpoint file")
    return str(path)


def claim(
    run_dir: Path,
    config: dict[str, Any],
    ckpt_path: str | None,
    write: bool = True,
    export_dir: Path | None = None,
) -> dict[str, str]:
    """Record (or confirm) this run's identity in `run_dir`; returns {"config_hash", "run_id"}.
    write=False (a rank other than 0 of a multi-process run): the same checks, nothing written.

    Refuses (ValueError, one line) a directory whose checkpoints belong to another config, a fresh
    start over this run's own checkpoints, a checkpoint file recorded by another run, and a directory
    holding checkpoints or a head export (`<run_dir>/head`, or `export_dir` inside it) but no `run.json`.
    """
    run_dir = Path(run_dir)
    want = config_hash(config)
    path = run_dir / IDENTITY_FILE
    recorded = _read_identity(path)
    if recorded is None:
        found = _run_contents(run_dir, export_dir)
        if found:
            raise ValueError(
                f"{run_dir} holds {' and '.join(found)} but no {IDENTITY_FILE} (the record of the run they "
                f"belong to), so they may be another run's; use another --run.dir, or remove {run_dir} "
                "to start over there"
            )
    if recorded is not None and has_checkpoints(run_dir):
        if recorded.get("config_hash") != want:
            raise ValueError(
                f"{run_dir} holds another run (run id {recorded.get('run_id')}; its config differs: "
                f"{_differences(recorded.get('config', {}), config)}); use another --run.dir"
            )
        if ckpt_path is None:
            raise ValueError(
                f"{run_dir} already holds checkpoints of this run; resume with --ckpt_path last, "
                "or use another --run.dir to start over"
            )
    if ckpt_path is not None:
        _check_checkpoint_identity(Path(ckpt_path), want, config)
    same = recorded is not None and recorded.get("config_hash") == want and ckpt_path is not None
    identity = {"config_hash": want, "run_id": recorded["run_id"] if same else uuid.uuid4().hex}
    if not write:
        return identity
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json(path, {**identity, "config": config}, indent=1, sort_keys=True, default=str)
    return identity


def _run_contents(run_dir: Path, export_dir: Path | None) -> list[str]:
    """What of a run `run_dir` holds: its checkpoints, its head export."""
    found = []
    ckpts = (
        sorted(p.name for p in (run_dir / "checkpoints").glob("*.ckpt"))
        if (run_dir / "checkpoints").is_dir()
        else []
    )
    if ckpts:
        found.append(f"checkpoints ({', '.join(ckpts[:3])}{', ...' if len(ckpts) > 3 else ''})")
    heads = {run_dir / "head"}
    if export_dir is not None and Path(export_dir).resolve().is_relative_to(run_dir.resolve()):
        heads.add(Path(export_dir))
    for head in sorted(heads):
        if head.is_dir() and any(head.iterdir()):
            found.append(f"a head export ({head.name}/)")
    return found


class RunLock:
    """The run directory's lock, held by one process (rank 0) for a run's lifetime: `flock` on
    `<run_dir>/.lock` (the OS releases it when the holder exits or dies), the holder's pid inside.

    `acquire()` makes the directory if needed (`created` says so) and raises ValueError naming the
    directory and the holder's pid when another process holds it; `release(remove_dir)` unlinks the
    lock file while still holding it, and with remove_dir removes the directory if it made it and it
    is empty (a refused start leaves nothing behind)."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.created = False
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        self.created = not self.run_dir.exists()
        while True:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            except OSError as err:
                raise ValueError(
                    f"{self.path}: cannot open the run directory's lock ({err.strerror})"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
                os.close(fd)
                raise ValueError(
                    f"{self.run_dir} is in use by a live run (pid {holder} holds {self.path}); wait for "
                    "it to end (then resume with --ckpt_path last), or use another --run.dir"
                ) from None
            except OSError as err:  # a filesystem without locks
                os.close(fd)
                raise ValueError(
                    f"{self.path}: cannot lock the run directory ({err.strerror}); use a --run.dir on a "
                    "local filesystem"
                ) from None
            try:  # a holder that just released it unlinked the file we locked: lock the one at the path now
                same = os.fstat(fd).st_ino == os.stat(self.path, follow_symlinks=False).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self, remove_dir: bool = False) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # while held: a waiter's inode check then fails and it retries
        finally:
            os.close(self._fd)
            self._fd = None
        if remove_dir and self.created:
            try:
                self.run_dir.rmdir()
            except OSError:  # not empty: something else was written there
                pass


def _read_identity(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError(
            f"{path}: not valid JSON (the run directory's identity); use another --run.dir"
        ) from None
    return data if isinstance(data, dict) else None


def _check_checkpoint_identity(path: Path, want: str, config: dict[str, Any]) -> None:
    ckpt = load_checkpoint(path)
    got = ckpt.get(CHECKPOINT_KEY) if isinstance(ckpt, dict) else None
    if got is not None and got.get("config_hash") != want:
        raise ValueError(
            f"{path}: a checkpoint of another run (run id {got.get('run_id')}, another config); "
            "resume it with its own config or start a new run"
        )


def load_checkpoint(path: str | Path, map_location: Any = "cpu") -> Any:
    """torch.load of a local checkpoint with weights_only=True; ValueError naming the file if unreadable."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=True)
    except (RuntimeError, OSError, EOFError, ValueError) as err:
        raise ValueError(f"{path}: not a readable checkpoint ({' '.join(str(err).split())[:200]})") from None
    except Exception as err:  # pickle.UnpicklingError: a payload weights_only refuses to run
        raise ValueError(f"{path}: refused, not a plain-tensor checkpoint ({type(err).__name__})") from None


class RunIdentity(Callback):
    """Writes the run's identity into every checkpoint (`mtpc_run`)."""

    def __init__(self, identity: dict[str, str]):
        self.identity = dict(identity)

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        checkpoint[CHECKPOINT_KEY] = dict(self.identity)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Checkpoints written atomically beside their final path; loaded from local files, weights only."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        buf = io.BytesIO()
        torch.save(checkpoint, buf)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_bytes(path, buf.getbuffer())

    def load_checkpoint(
        self, path: Any, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if "://" in str(path):
            raise ValueError(f"{path}: only local checkpoint files are accepted")
        return load_checkpoint(path, map_location=map_location or "cpu")
