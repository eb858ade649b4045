"""The one stop/checkpoint callback of a training run: stop on request with `last.ckpt` written.

`StopCheckpoint` writes `<run>/checkpoints/last.ckpt` and ends fit at the next optimizer-step
boundary once a stop is requested, and also at the final step of a max_steps run (so a later
`--ckpt_path last --trainer.max_steps <more>` continues from that exact state). It remembers the
step of the last validation pass, so the caller knows whether the final head was scored.

Who asks for the stop has exactly one owner of the signal:
- a sweep trial passes `should_stop` (its worker owns SIGUSR1/SIGTERM and sets the flag); the
  callback installs no handler;
- standalone (the CLI, `train_head` without `should_stop`) the callback owns SIGUSR1 (SLURM's
  `--signal=USR1@<secs>` before a time limit or pre-emption), SIGTERM (`scancel`, and SLURM before
  a requeue) and SIGINT (Ctrl-C) during training: each stops with one checkpoint (`signum` says
  which); a second SIGINT interrupts at once. A stop signal after the run's last optimizer step
  (during the final validation or the head export) does not stop it: the run finishes, exports
  its head and exits 0; one line says so at once (`late_signum` keeps the signal), and a second
  Ctrl-C interrupts. The handlers stay installed until the caller's `release()` (after the export).
Lightning's own handlers are not used (fit.py switches its signal connector off for a run that
owns its signals): its SIGTERM handler (installed at every fit and validate) ends fit, or a
validation, with no checkpoint, no head and exit code 0, and its teardown would reinstate the
handlers of before the fit over ours;
under LightningEnvironment (which the suite passes so that a one-task job is not taken for a
multi-process or self-requeueing one) it installs no SIGUSR1 handler, and SLURMEnvironment's would
`scontrol requeue` the job behind the sweep's back.
`YieldToTimer` makes training wait before each batch while another process times something
(experiments.plumbing.timing_lock.wait_while_timing), so trials trained side by side do not disturb a
trial's timed latency phase.
Under DDP the request is reduced across ranks after every optimizer step (any rank asked: all stop
at that step), and the checkpoint is written once (Lightning's rank 0) after all ranks reach it.
Leaves out: ModelCheckpoint's periodic checkpoints (fit.py adds it), requeueing.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)


class StopCheckpoint(Callback):
    """On a stop request: save `checkpoint` after the current optimizer step and stop (`stopped`)."""

    def __init__(
        self,
        checkpoint: Path,
        should_stop: Callable[[], bool] | None = None,
        signums: tuple[int, ...] = STOP_SIGNALS,
    ):
        self.checkpoint, self.should_stop, self.signums = Path(checkpoint), should_stop, tuple(signums)
        self.requested = False
        self.stopped = False
        self.signum: int | None = None
        """the signal that asked for the stop (None: `should_stop`, or no stop)"""
        self.last_validation_step: int | None = None
        self.finishing = False
        """past the run's last optimizer step (final validation, export): a stop signal no longer stops"""
        self.late_signum: int | None = None
        """a stop signal that arrived after the last optimizer step (the run finished anyway)"""
        self._previous: dict[int, Any] = {}

    def stop_requested(self) -> bool:
        return self.requested or (self.should_stop is not None and self.should_stop())

    def _handler(self, signum: int, frame: Any) -> None:
        if (self.requested or self.late_signum is not None) and signum == signal.SIGINT:
            raise KeyboardInterrupt  # Ctrl-C twice: do not wait for the step (or the export) to end
        if self.finishing and not self.stopped:
            if self.late_signum is None:
                self.late_signum = signum
                os.write(
                    2,
                    f"{signal.Signals(signum).name} after the last training step: finishing the final "
                    "validation and the head export (Ctrl-C to interrupt)\n".encode(),
                )
            return
        if not self.requested:
            self.signum = signum
        self.requested = True

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        if self.should_stop is None and threading.current_thread() is threading.main_thread():
            for signum in self.signums:
                self._previous[signum] = signal.signal(signum, self._handler)

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        self.finishing = True

    def on_exception(self, trainer: Trainer, pl_module: Any, exception: BaseException) -> None:
        self.release()

    def release(self) -> None:
        """Give the signals back to the handlers of before `on_train_start` (after the export)."""
        self._restore()

    def _restore(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.fit_loop._should_accumulate():
            return
        requested = self.stop_requested()
        if trainer.world_size > 1:  # a signal may reach one rank only: all stop at this step if any was asked
            requested = trainer.strategy.reduce_boolean_decision(requested, all=False)
        if requested and not self.stopped:
            self._save(trainer)
            self.stopped = True
            trainer.should_stop = True
        elif 0 < trainer.max_steps <= trainer.global_step:
            # the last step of a max_steps run: ModelCheckpoint may not save here (mid-epoch)
            self._save(trainer)
            self.finishing = True
        elif _last_epoch(trainer) and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            self.finishing = True  # the last step of a max_epochs run: its final validation follows

    def _save(self, trainer: Trainer) -> None:
        """Write the checkpoint once: ModelCheckpoint is told this step's last.ckpt is written, so its
        end-of-training save_last neither writes it again (time a SIGTERM grace period lacks) nor
        writes a second `last-v1.ckpt` beside it."""
        self.checkpoint.parent.mkdir(parents=True, exist_ok=True)
        trainer.save_checkpoint(self.checkpoint)
        for cb in trainer.checkpoint_callbacks:
            if isinstance(cb, ModelCheckpoint) and cb.dirpath and Path(cb.dirpath) == self.checkpoint.parent:
                cb._last_global_step_saved = trainer.global_step
                cb._last_checkpoint_saved = cb.last_model_path = str(self.checkpoint)

    def on_validation_end(self, trainer: Trainer, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            self.last_validation_step = trainer.global_step


def _last_epoch(trainer: Trainer) -> bool:
    return (
        trainer.max_epochs is not None
        and trainer.max_epochs > 0
        and trainer.current_epoch + 1 >= trainer.max_epochs
    )


class YieldToTimer(Callback):
    """Before each training batch, wait while another process holds the machine-wide timing lock;
    leave the wait as soon as `should_stop()` is true (the run's stop request: a SIGTERM or SIGUSR1
    sent while it waits ends the wait, and the stop callback checkpoints at the end of that step)."""

    def __init__(self, should_stop: Callable[[], bool] | None = None):
        self.waited = 0.0
        self.should_stop = should_stop

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        from experiments.plumbing.timing_lock import wait_while_timing

        self.waited += wait_while_timing(self.should_stop)
