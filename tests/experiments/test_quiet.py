"""The console a user sees (experiments/plumbing/quiet.py): the training CLI's stderr holds no library noise,
and quiet() drops exactly the listed messages, no others."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

from experiments.plumbing.quiet import LOG_RECORDS, WARNINGS, quiet
from experiments.training.config import CONFIG_DIR

ROOT = Path(__file__).resolve().parents[2]


def test_training_cli_prints_only_its_own_lines(tmp_path):
    """The debug config with MLflow on (a fresh sqlite store): Lightning's banners and tips, MLflow's
    store set-up and Lightning's deprecation are gone; whatever else reached stderr is unlisted noise."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
    }
    env.pop("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", None)
    cmd = [
        sys.executable,
        "-m",
        "experiments.train",
        "fit",
        "--config",
        str(CONFIG_DIR / "debug.yaml"),
        "--run.dir",
        str(tmp_path / "run"),
        "--run.tracking",
        "true",
        "--trainer.max_steps",
        "2",
    ]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr == "", (
        f"unlisted messages (silence them in experiments/plumbing/quiet.py or print less):\n{out.stderr}"
    )
    assert out.stdout.startswith(f"head exported to {tmp_path / 'run' / 'head'}\n"), out.stdout


def test_quiet_drops_exactly_the_listed_messages():
    name, start = LOG_RECORDS[0]
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            quiet()
            quiet()  # a second call adds nothing
            category, _ = WARNINGS[0]
            warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use ...", category, stacklevel=1)
            warnings.warn(
                "Found 33 module(s) in eval mode at the start of training. This may ...",
                UserWarning,
                stacklevel=1,
            )
            warnings.warn("a warning that matters", UserWarning, stacklevel=1)
            warnings.warn(
                "`isinstance(treespec, LeafSpec)` is deprecated", RuntimeWarning, stacklevel=1
            )  # another category
            logger.info(start + "False, used: False")
            logger.info("Restoring states from the checkpoint path at last.ckpt")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert [str(w.message) for w in caught] == [
        "a warning that matters",
        "`isinstance(treespec, LeafSpec)` is deprecated",
    ]
    assert seen == ["Restoring states from the checkpoint path at last.ckpt"]
    assert sum(type(f).__name__ == "_DropListed" for f in logger.filters) == 1
