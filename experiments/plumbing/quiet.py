"""What the suite's command lines do not show: library messages silenced by their exact text, all listed here.

A user of `python -m experiments.train`, `experiments.evaluate`, `experiments.pretrain` and
`make demo` reads the suite's own progress and results. Lightning's tips and hardware banners,
MLflow's store set-up lines, a deprecation inside Lightning, and transformers' per-file weight
loading bars say nothing they can act on, so `quiet()` drops exactly the messages below (by logger
and message start, warning category and message pattern, or progress-bar title) and nothing
else: every other warning and log line still shows. Each CLI calls `quiet()` once at start
(`experiments/train.py`, `experiments/evaluate.py`, `experiments/pretrain.py`,
`experiments/training/nll_table.py`, the sweep trial, `python -m sweeps.run` and `python -m sweeps.demo`);
importing this module changes nothing. tests/experiments/test_quiet.py runs the debug training
CLI and fails on any stderr line that is not the suite's own.
Leaves out: the suite's own output, the training progress lines (experiments/plumbing/progress.py).
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

#: log records dropped: (logger name, the message's start)
LOG_RECORDS: tuple[tuple[str, str], ...] = (
    ("lightning.pytorch.utilities.rank_zero", "GPU available: "),
    ("lightning.pytorch.utilities.rank_zero", "TPU available: "),
    ("lightning.pytorch.utilities.rank_zero", "HPU available: "),
    ("lightning.pytorch.utilities.rank_zero", "💡 Tip: "),  # litlogger / litmodels advertisements
    ("lightning.pytorch.utilities.rank_zero", "`Trainer.fit` stopped: "),  # the CLI prints its own result
    ("lightning.pytorch.trainer.connectors.checkpoint_connector", "`weights_only` was not set"),
    ("lightning.pytorch.accelerators.cuda", "LOCAL_RANK: "),  # "LOCAL_RANK: 0 - CUDA_VISIBLE_DEVICES: [0]"
    ("mlflow.store.db.utils", "Creating initial MLflow database tables"),
    ("mlflow.store.db.utils", "Updating database tables"),
    # a sweep's study creation: the runner logs its own "created study ..." line
    ("optuna.storages.journal._storage", "A new study created in "),
    ("optuna.storages._rdb.storage", "A new study created in "),
)
#: warnings ignored: (category, regular expression matched at the message's start)
WARNINGS: tuple[tuple[type[Warning], str], ...] = (
    (
        FutureWarning,
        r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    ),  # inside lightning's _pytree, not ours
    # the frozen backbone is in eval mode on purpose (no dropout); only head + LoRA train
    (UserWarning, r"Found \d+ module\(s\) in eval mode at the start of training"),
    # the suite picks LightningEnvironment itself (one task per trial; see experiments/training/callbacks.py)
    (UserWarning, r"The `srun` command is available on your system but is not used"),
)
#: transformers progress bars switched off, by title (one bar per checkpoint file read or written)
PROGRESS_BARS: tuple[str, ...] = ("Loading weights", "Writing model shards")
#: environment set unless already set: MLflow's "🏃 View run <name> at: <url>" / "🧪 View experiment at: <url>" lines
ENVIRONMENT: tuple[tuple[str, str], ...] = (("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true"),)


class _DropListed(logging.Filter):
    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


def _bar(factory: Any, args: tuple, kwargs: dict) -> Any:
    if kwargs.get("desc") in PROGRESS_BARS:
        kwargs = {**kwargs, "disable": True}
    return factory(*args, **kwargs)


def quiet() -> None:
    """Silence exactly the listed messages for the rest of the process (calling it again adds nothing)."""
    by_logger: dict[str, tuple[str, ...]] = {}
    for name, start in LOG_RECORDS:
        by_logger[name] = by_logger.get(name, ()) + (start,)
    for name, starts in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropListed) for f in logger.filters):
            logger.addFilter(_DropListed(starts))
    for category, pattern in WARNINGS:  # filterwarnings replaces an identical filter rather than adding one
        warnings.filterwarnings("ignore", message=pattern, category=category)
    for key, value in ENVIRONMENT:
        os.environ.setdefault(key, value)
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - transformers is a dependency of the library
        return
    set_hook = getattr(hf_logging, "set_tqdm_hook", None)  # transformers 5 (4.x draws no weight-loading bar)
    if set_hook is not None:
        set_hook(_bar)
