"""The training progress a user reads: lines that name the run, count its real optimizer steps and
give an ETA — in place of Lightning's bar.

Lightning's bar counts the batches of the epoch (`200/2556` for a run that `max_steps` ends at 200,
with that epoch's ETA), redraws one terminal line that every process of a sweep shares, and never
names the run. `StepProgress` prints, to stderr, one line per quarter of the run (and at least one
a minute):

    [train mtpc-demo/cp-r4-n4-k1] step 100/200 (50%) in 0:31, ETA 0:31

The total is `trainer.estimated_stepping_batches` (max_steps, or the epochs' optimizer steps,
whichever ends first); a resumed run counts from its checkpoint's step and times only what it ran
itself. The name is the MLflow run the trainer logs into (a sweep trial's parent run,
`<study>/<grid key>`), else the run's configured name. Plain lines, never carriage returns: they
stay readable when several workers share a terminal and in SLURM log files.
Leaves out: validation passes (short), the decoding evaluation's own progress (experiments/evaluation/decoding.py).
"""

from __future__ import annotations

import math
import sys
import time
from typing import IO, Any

from lightning.pytorch.callbacks.progress import ProgressBar

#: a line at every quarter of the run, and at least one every MAX_SILENCE_S seconds
FRACTIONS: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0)
MAX_SILENCE_S = 60.0


def clock(seconds: float) -> str:
    """`h:mm:ss` or `m:ss`."""
    s = max(0, round(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class StepProgress(ProgressBar):
    """Progress lines of one training run (see the module docstring)."""

    def __init__(
        self, name: str, stream: IO[str] | None = None, max_silence_s: float = MAX_SILENCE_S
    ) -> None:
        super().__init__()
        self.name, self.stream, self.max_silence_s = name, stream, max_silence_s
        self._enabled = True
        self.total: float = math.inf
        self._start_step = 0
        self._t0 = self._last_line = 0.0
        self._next = 0

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        logger = trainer.logger
        run_id = getattr(logger, "run_id", None)
        if run_id:  # the MLflow run the steps are logged to: the name the UI shows
            try:
                self.name = logger.experiment.get_run(run_id).info.run_name or self.name
            except Exception:  # noqa: BLE001 (a name is not worth failing a run over)
                pass
        self.total = trainer.estimated_stepping_batches
        self._start_step = trainer.global_step
        self._t0 = self._last_line = time.monotonic()
        done = self._fraction(trainer.global_step)
        self._next = next((i for i, f in enumerate(FRACTIONS) if f > done), len(FRACTIONS))

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step, now = trainer.global_step, time.monotonic()
        crossed = False
        while self._next < len(FRACTIONS) and self._fraction(step) >= FRACTIONS[self._next]:
            self._next += 1
            crossed = True
        if crossed or now - self._last_line >= self.max_silence_s:
            self._line(step, now)

    def _fraction(self, step: int) -> float:
        return step / self.total if math.isfinite(self.total) and self.total > 0 else 0.0

    def _line(self, step: int, now: float) -> None:
        self._last_line = now
        if not self._enabled:
            return
        elapsed = now - self._t0
        if math.isfinite(self.total):
            total = int(self.total)
            text = f"step {step}/{total} ({100 * step // max(total, 1)}%) in {clock(elapsed)}"
            ran = step - self._start_step
            if step < total and ran > 0:
                text += f", ETA {clock(elapsed / ran * (total - step))}"
        else:
            text = f"step {step} in {clock(elapsed)}"
        print(f"[train {self.name}] {text}", file=self.stream or sys.stderr, flush=True)
