"""`python tests/ddp_run.py fit ...`: `python -m experiments.train` with test-only hooks, for the DDP tests.

Lightning's standalone DDP starts the other local ranks by running this same command again, so the
hooks act in every rank. Set by environment variables (tests/experiments/test_ddp.py):
- MTPC_TEST_RECORD=<file>: rank 0 appends one JSON line per optimizer step {"step", "train_loss"};
- MTPC_TEST_MUTATE=drop|double: rank 1's loss (hence its gradient) is multiplied by 0 or 2 (the
  mutation the equivalence test must catch);
- MTPC_TEST_STEP_SLEEP=<seconds>: every rank sleeps after each optimizer step (so a kill lands mid-run);
- MTPC_TEST_STEP_FILE=<file>: rank 0 writes the global step there after each optimizer step.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning.pytorch.callbacks import Callback  # noqa: E402

import experiments.train as train  # noqa: E402
from experiments.training.module import MtpcTrainModule  # noqa: E402


class Hooks(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.fit_loop._should_accumulate():
            return
        if trainer.global_rank == 0:
            if os.environ.get("MTPC_TEST_RECORD"):
                with open(os.environ["MTPC_TEST_RECORD"], "a") as f:
                    loss = float(trainer.callback_metrics["train_loss"])
                    f.write(json.dumps({"step": trainer.global_step, "train_loss": loss}) + "\n")
            if os.environ.get("MTPC_TEST_STEP_FILE"):
                Path(os.environ["MTPC_TEST_STEP_FILE"]).write_text(str(trainer.global_step))
        if os.environ.get("MTPC_TEST_STEP_SLEEP"):
            time.sleep(float(os.environ["MTPC_TEST_STEP_SLEEP"]))


def _mutate(factor: float):
    step = MtpcTrainModule.training_step

    @functools.wraps(step)
    def training_step(self, batch, batch_idx):
        loss = step(self, batch, batch_idx)
        return loss * factor if self.trainer.global_rank == 1 else loss

    MtpcTrainModule.training_step = training_step


if __name__ == "__main__":
    mutation = os.environ.get("MTPC_TEST_MUTATE")
    if mutation:
        _mutate({"drop": 0.0, "double": 2.0}[mutation])
    train.train_head = functools.partial(train.train_head, callbacks=[Hooks()])
    sys.exit(train.main(sys.argv[1:]))
