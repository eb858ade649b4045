"""MLflow for one training run: the run it logs into, its description (params, config, git SHA, versions), its end.

- URI: `MLFLOW_TRACKING_URI` if set, else `run.tracking_uri`, else sqlite in the project directory.
- The run: the one given (a sweep trial's parent run, left open), else the id stored in
  `<run dir>/mlflow_run_id.txt` when resuming, else a new run created by id (never
  `set_experiment` by name, which MLflow 3 sends to Default when racing).
- Description: `TrainConfig.params()` as params, tag `git_sha`, artifacts `run/config.yaml`,
  `run/git_sha.txt`, `run/package_versions.json`; at the end `peak_mem_bytes`, `train_seconds`,
  tag `head_dir` and the artifact `head/config.json`.
Leaves out: what is trained (train.py), the metrics Lightning logs during fit (the logger does).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from lightning.pytorch.loggers import MLFlowLogger

from experiments.config import TrainConfig

PROJECT_DIR = Path(__file__).resolve().parents[1]
RUN_ID_FILE = "mlflow_run_id.txt"
PACKAGES = ("torch", "lightning", "transformers", "peft", "mlflow", "jsonargparse", "safetensors", "numpy", "mtpc")


def tracking_uri(configured: str | None) -> str:
    """`MLFLOW_TRACKING_URI` if set, else the configured URI, else sqlite in the project directory."""
    return os.environ.get("MLFLOW_TRACKING_URI") or configured or f"sqlite:///{PROJECT_DIR / 'mlflow.db'}"


def ensure_experiment(uri: str, name: str) -> str:
    """Id of MLflow experiment `name`, created if missing (a lost creation race falls back to lookup)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    try:
        return client.create_experiment(name)
    except Exception:
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def git_sha() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=PROJECT_DIR, capture_output=True, text=True, timeout=10)
        sha = out.stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=PROJECT_DIR,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (sha + ("-dirty" if dirty else "")) if sha else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def package_versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


class _Logger(MLFlowLogger):
    """MLFlowLogger that leaves a run it did not create (e.g. the sweep's trial run) open at the end."""

    def __init__(self, *args: Any, owns_run: bool = True, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._owns_run = owns_run

    def finalize(self, status: str = "success") -> None:
        if self._owns_run:
            super().finalize(status)


def make_logger(cfg: TrainConfig, *, run_id: str | None, resuming: bool) -> MLFlowLogger:
    """The Lightning logger of run `run_id` (a run created here if None), with the run's description logged."""
    from mlflow.tracking import MlflowClient

    run, run_dir = cfg.run, Path(cfg.run.dir)
    uri = tracking_uri(run.tracking_uri)
    exp_id = ensure_experiment(uri, run.experiment)
    client = MlflowClient(tracking_uri=uri)
    id_file = run_dir / RUN_ID_FILE
    owns = run_id is None
    if run_id is None and resuming and id_file.exists():
        run_id = id_file.read_text().strip()
    if run_id is None:
        run_id = client.create_run(exp_id, run_name=run.name).info.run_id
    id_file.write_text(run_id + "\n")
    exp_name = client.get_experiment(client.get_run(run_id).info.experiment_id).name
    logger = _Logger(experiment_name=exp_name, tracking_uri=uri, run_id=run_id, owns_run=owns)
    _log_description(client, run_id, cfg, run_dir)
    return logger


def _log_description(client: Any, run_id: str, cfg: TrainConfig, run_dir: Path) -> None:
    from mlflow.entities import Param

    existing = client.get_run(run_id).data.params
    params = {k: str(v) for k, v in cfg.params().items() if k not in existing}
    if params:
        client.log_batch(run_id, params=[Param(k, v) for k, v in params.items()])
    sha = git_sha()
    client.set_tag(run_id, "git_sha", sha)
    desc = run_dir / "description"
    desc.mkdir(exist_ok=True)
    (desc / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    (desc / "git_sha.txt").write_text(sha + "\n")
    (desc / "package_versions.json").write_text(json.dumps(package_versions(), indent=2))
    client.log_artifacts(run_id, str(desc), artifact_path="run")


def log_end(logger: MLFlowLogger, metrics: dict[str, float], step: int, head_dir: Path) -> None:
    """The end of a finished run: resource metrics, where the head is, the head's config."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=logger._tracking_uri)
    for key in ("peak_mem_bytes", "train_seconds", "data_skipped_records"):
        if key in metrics:
            client.log_metric(logger.run_id, key, metrics[key], step=step)
    client.set_tag(logger.run_id, "head_dir", str(head_dir))
    client.log_artifact(logger.run_id, str(head_dir / "config.json"), artifact_path="head")
