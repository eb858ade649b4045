"""The one stop/checkpoint callback of a training run: stop on request with `last.ckpt` written.

`StopCheckpoint` writes `<run>/checkpoints/last.ckpt` and ends fit at the next optimizer-step
boundary once a stop is requested, and also at the final step of a max_steps run (so a later
`--ckpt_path last --trainer.max_steps <more>` continues from that exact state). It remembers the
step of the last validation pass, so the caller knows whether the final head was scored.

Who asks for the stop has exactly one owner of the signal:
- a sweep trial passes `should_stop` (its worker owns SIGUSR1/SIGTERM and sets the flag); the
  callback installs no handler;
- standalone (the CLI, `train_head` without `should_stop`) the callback owns SIGUSR1 during fit:
  SLURM's `--signal=USR1@<secs>` before a time limit or pre-emption.
Lightning's own handler is not used: under LightningEnvironment (which the suite passes so that a
one-task job is not taken for a multi-process or self-requeueing one) it installs none, and
SLURMEnvironment's would `scontrol requeue` the job behind the sweep's back.
Leaves out: ModelCheckpoint's periodic checkpoints (train.py adds it), requeueing.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback


class StopCheckpoint(Callback):
    """On a stop request: save `checkpoint` after the current optimizer step and stop (`stopped`)."""

    def __init__(self, checkpoint: Path, should_stop: Callable[[], bool] | None = None, signum: int = signal.SIGUSR1):
        self.checkpoint, self.should_stop, self.signum = Path(checkpoint), should_stop, signum
        self.requested = False
        self.stopped = False
        self.last_validation_step: int | None = None
        self._previous: Any = None

    def _stop_requested(self) -> bool:
        return self.requested or (self.should_stop is not None and self.should_stop())

    def _handler(self, signum: int, frame: Any) -> None:
        self.requested = True

    def on_fit_start(self, trainer: Trainer, pl_module: Any) -> None:
        if self.should_stop is None and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(self.signum, self._handler)

    def on_fit_end(self, trainer: Trainer, pl_module: Any) -> None:
        self._restore()

    def on_exception(self, trainer: Trainer, pl_module: Any, exception: BaseException) -> None:
        self._restore()

    def _restore(self) -> None:
        if self._previous is not None:
            signal.signal(self.signum, self._previous)
            self._previous = None

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.fit_loop._should_accumulate():
            return
        if self._stop_requested() and not self.stopped:
            self.checkpoint.parent.mkdir(parents=True, exist_ok=True)
            trainer.save_checkpoint(self.checkpoint)
            self.stopped = True
            trainer.should_stop = True
        elif 0 < trainer.max_steps <= trainer.global_step:
            # the last step of a max_steps run: ModelCheckpoint may not save here (mid-epoch)
            trainer.save_checkpoint(self.checkpoint)

    def on_validation_end(self, trainer: Trainer, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            self.last_validation_step = trainer.global_step
