"""What a pre-training run writes and reads back: the resumable snapshot `<run-dir>/state.pt` and
the output model folder (`--out`).

Both are written whole or not at all (`mtpc.atomic`: a temporary beside the target, fsync, rename);
a full disk is one OSError naming the path and "no space left", with no temporary left behind. A
snapshot that cannot be read (cut short, not a snapshot), of another run or of another thread count
is a ValueError naming the file. Leaves out: what goes into them (loop.py).
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import torch
from safetensors.torch import save as safetensors_bytes
from transformers import PreTrainedModel

from experiments.pretraining.config import PretrainConfig
from mtpc.atomic import atomic_open, commit_dir, disk_error, temp_name, write_bytes, write_json
from mtpc.tokenizer import ByteTokenizer

STATE_FILE = "state.pt"
"""The resumable snapshot inside a run directory: weights, optimiser, step, phase, curve, evaluations."""
METRICS_FILE = "pretrain_metrics.json"
"""The run's record beside the saved weights: held-out score, curves, hardware, command, config."""
SNAPSHOT_KEYS = ("model", "optimizer", "state", "config_key", "num_threads")


def config_key(cfg: PretrainConfig) -> dict:
    """The fields a resumed run must share with its snapshot (the budget and the cadences may change)."""
    free = {
        "max_steps",
        "max_minutes",
        "snapshot_minutes",
        "log_every",
        "eval_minutes",
        "stop_gain_per_hour",
        "heldout_data",
    }
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in free}


def save_snapshot(run_dir: Path, snapshot: dict) -> None:
    """Atomic on the run directory's filesystem (mtpc.atomic: temporary beside it, fsync, rename)."""
    with atomic_open(run_dir / STATE_FILE) as f:
        torch.save(snapshot, f)


def load_snapshot(run_dir: Path, cfg: PretrainConfig, device: torch.device) -> dict | None:
    """The snapshot in `run_dir` written by a run of `cfg` (None when there is none); ValueError in one
    line naming the file when it cannot be read, belongs to another run or to another thread count."""
    path = run_dir / STATE_FILE
    if not path.is_file():
        return None
    try:
        snap = torch.load(path, map_location=device, weights_only=True)
    except Exception as err:  # a cut zip, a pickle error, an EOF: all mean the file is not a whole snapshot
        why = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ValueError(
            f"{path}: not a readable pre-training snapshot ({why}); expected a whole state.pt: "
            f"remove it to start the run afresh, or restore it"
        ) from None
    if not isinstance(snap, dict) or any(k not in snap for k in SNAPSHOT_KEYS):
        raise ValueError(f"{path}: not a pre-training snapshot; expected the keys {list(SNAPSHOT_KEYS)}")
    want = config_key(cfg)
    if snap["config_key"] != want:
        diff = sorted(k for k in want if snap["config_key"].get(k) != want[k])
        raise ValueError(
            f"{path}: a snapshot of another run (differs in {diff}); use another run directory or the same config"
        )
    if snap["num_threads"] != torch.get_num_threads():
        raise ValueError(
            f"{path}: written with {snap['num_threads']} torch threads, now {torch.get_num_threads()}; "
            f"resume with the same num_threads"
        )
    return snap


def save_output(model: PreTrainedModel, out_dir: Path, metrics: dict) -> None:
    """`out_dir` as a `from_pretrained` folder (config, safetensors weights, byte tokenizer, the
    metrics), written whole in `<out>.tmp<pid>` and renamed over it; on a failed write the
    temporary is removed and the OSError names `out_dir` ("no space left" for a full disk)."""
    tmp = temp_name(out_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        # what save_pretrained writes, with the weights through mtpc.atomic (safetensors' own writer
        # reports a full disk as a SafetensorError, not an OSError)
        model.config.dtype = str(model.dtype).split(".")[1]
        model.config.architectures = [type(model).__name__]
        model.config.save_pretrained(tmp)
        if model.can_generate():
            model.generation_config.save_pretrained(tmp)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        write_bytes(tmp / "model.safetensors", safetensors_bytes(state, metadata={"format": "pt"}))
        ByteTokenizer().save_pretrained(tmp)
        write_json(tmp / METRICS_FILE, metrics, indent=2)
        shutil.rmtree(out_dir, ignore_errors=True)
        commit_dir(tmp, out_dir)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise disk_error(err, out_dir) from None
