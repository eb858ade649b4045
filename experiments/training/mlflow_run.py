"""MLflow for one training run: the run it logs into, its description, its end — through the one
tracking module (`tracking/`: the URI rule, `ensure_experiment`, `describe_run`).

- URI: the tracking-URI rule (`tracking.resolve_uri`): `MLFLOW_TRACKING_URI` if set, else
  `run.tracking_uri`, else `sqlite:///<cwd>/mlflow.db`.
- The run: the one given (a sweep trial's parent run, left open), else the id stored in
  `<run dir>/mlflow_run_id.txt` when resuming, else a new run created by id (never
  `set_experiment` by name, which MLflow 3 sends to Default when racing).
- Description (`tracking.describe_run`): `TrainConfig.params()` as params, the git SHA as tags
  `git_sha` and `mlflow.source.git.commit`, artifacts `run/config.yaml`, `run/git_sha.txt`,
  `run/package_versions.json`; at the end `peak_mem_bytes`, `train_seconds`, tag `head_dir` and
  the artifact `head/config.json`.
- A resumed run logs each metric step once: the steps an earlier attempt logged after its last
  checkpoint are replayed by the resume (with the same values) and not logged again.
Leaves out: what is trained (fit.py), the metrics Lightning logs during fit (the logger does).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import MLFlowLogger

import tracking
from experiments.training.config import TrainConfig
from mtpc.atomic import write_text

PROJECT_DIR = Path(__file__).resolve().parents[2]
RUN_ID_FILE = "mlflow_run_id.txt"


class _Logger(MLFlowLogger):
    """MLFlowLogger that leaves a run it did not create (e.g. the sweep's trial run) open at the end,
    and that leaves the process's tracking URI as it found it: Lightning's first `experiment` access
    calls `mlflow.set_tracking_uri`, which also exports MLFLOW_TRACKING_URI — and that variable
    outranks every configured URI in the tracking rule, so every later train / evaluate / sweep in
    the process (and its subprocesses) would have logged into this run's store."""

    def __init__(self, *args: Any, owns_run: bool = True, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._owns_run = owns_run

    @property
    def experiment(self) -> Any:
        if self._initialized:
            return super().experiment
        import mlflow

        before = os.environ.get(tracking.TRACKING_ENV)
        try:
            return super().experiment  # the client is bound to this run's URI; the global is not needed
        finally:
            mlflow.set_tracking_uri(before)  # None: MLflow's own default and no exported variable

    #: per metric key, the last step an earlier attempt of this run logged (set on resume)
    logged_upto: dict[str, int] = {}

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        # a resumed run replays the steps between its checkpoint and the crash: the earlier
        # attempt logged them already (the same values: resumes are exact), so each is logged once
        if step is not None and self.logged_upto:
            metrics = {k: v for k, v in metrics.items() if step > self.logged_upto.get(k, -1)}
            if not metrics:
                return
        super().log_metrics(metrics, step)

    def finalize(self, status: str = "success") -> None:
        if self._owns_run:
            super().finalize(status)


def make_logger(cfg: TrainConfig, *, run_id: str | None, resuming: bool) -> MLFlowLogger:
    """The Lightning logger of run `run_id` (a run created here if None), with the run's description logged."""
    run, run_dir = cfg.run, Path(cfg.run.dir)
    uri = tracking.resolve_uri(run.tracking_uri, configured_source="run.tracking_uri").uri
    exp_id = tracking.ensure_experiment(uri, run.experiment)
    client = tracking.client(uri)
    id_file = run_dir / RUN_ID_FILE
    owns = run_id is None
    if run_id is None and resuming and id_file.exists():
        run_id = id_file.read_text().strip()
    if run_id is None:
        run_id = client.create_run(exp_id, run_name=run.name).info.run_id
    write_text(id_file, run_id + "\n")
    exp_name = client.get_experiment(client.get_run(run_id).info.experiment_id).name
    logger = _Logger(experiment_name=exp_name, tracking_uri=uri, run_id=run_id, owns_run=owns)
    if resuming:
        logger.logged_upto = {
            key: max((m.step for m in client.get_metric_history(run_id, key)), default=-1)
            for key in client.get_run(run_id).data.metrics
        }
    tracking.describe_run(uri, run_id, cfg.to_dict(), run_dir, params=cfg.params())
    return logger


def log_end(logger: MLFlowLogger, metrics: dict[str, float], step: int, head_dir: Path) -> None:
    """The end of a finished run: resource metrics, where the head is, the head's config."""
    client = tracking.client(logger._tracking_uri)
    for key in ("peak_mem_bytes", "train_seconds", "data_skipped_records"):
        if key in metrics:
            client.log_metric(logger.run_id, key, metrics[key], step=step)
    client.set_tag(logger.run_id, "head_dir", str(head_dir))
    client.log_artifact(logger.run_id, str(head_dir / "config.json"), artifact_path="head")
