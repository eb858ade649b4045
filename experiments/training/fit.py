"""Train one MtPC head: `train_head` (what the training CLI and a sweep trial call) and its checks.

A run: parse the config (`experiments.training.config`, types checked), check it once (`TrainConfig.check`:
errors name the file and key, before the backbone or the data are loaded), seed, build
`MtpcTrainModule(cfg.model)`, `ChatDataModule(cfg.data)` and a Trainer with `cfg.trainer` plus the
suite's own cluster environment (`cluster_environment`: SLURM's under `srun` with more than one
task, torchrun's under torchrun, else Lightning's, so a one-task SLURM job is not taken for a
multi-process or self-requeueing one) and `use_distributed_sampler=False` (the loader shards by
rank itself), a ModelCheckpoint in `<run.dir>/checkpoints` (so
`--ckpt_path last` finds `last.ckpt`), the `StopCheckpoint` callback, the progress lines (`StepProgress`, unless
`trainer.enable_progress_bar` is false) and the MLflow logger; fit;
score the final head if the last step was not validated; export it with `mtpc.heads.save_head` to
`run.export_dir`. Several devices or nodes (`trainer.devices`, `trainer.num_nodes`,
`trainer.strategy: ddp`) run Lightning's DDP: standalone Lightning starts the other local ranks by
running the same command again; under `srun` (one task per device) or `torchrun` every rank is
started by the launcher. Only global rank 0 writes `run.json`, logs to MLflow (its logger is made
once the rank is known), prints progress, writes checkpoints (Lightning) and exports the head. Before anything loads, the trainer settings are checked, the resume path
(`run_dir.check_ckpt_path`: a local file; `last` must exist) and the run directory's identity
(`run_dir.claim`: one run per directory, under rank 0's `run_dir.RunLock`, held until the export:
one live run per directory); a start refused there or by its data leaves no `run.json` behind;
checkpoints are written atomically and loaded weights-only (`run_dir.AtomicCheckpointIO`). A stop
signal after the last optimizer step lets the validation and export finish (`TrainResult.late_signal`).
`mlflow_run_id` logs into an existing run and leaves it open (a multi-rank sweep trial's
parent run, made by the worker: experiments/training/launch.py).
Leaves out: the command line and its exit codes (experiments/train.py), the config (config.py), the
module and data (module.py, datamodule.py), MLflow (mlflow_run.py), the stop callback (callbacks.py),
progress and the run directory's rules (experiments/plumbing/), evaluation and sweeps.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

from experiments.plumbing.run_dir import check_ckpt_path
from experiments.training.config import TrainConfig, load_config
from mtpc.atomic import write_json
from mtpc.speculative.stats import peak_memory_bytes

__all__ = [
    "TrainResult",
    "check_config",
    "check_trainer",
    "cluster_environment",
    "train_head",
    "trainer_arguments",
]


@dataclass
class TrainResult:
    """What `train_head` returns: where the head and checkpoints are, and the final metrics."""

    head_dir: Path
    metrics: dict[str, float]
    checkpoint_dir: Path
    run_dir: Path
    mlflow_run_id: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    """the resolved config (`TrainConfig.to_dict()`: the YAML layout)"""
    preempted: bool = False
    """stopped on request (SIGUSR1/SIGTERM/SIGINT, or `should_stop`) after writing checkpoints/last.ckpt (nothing exported); resume with ckpt_path last"""
    stop_signal: int | None = None
    """the signal that stopped the run (None: not stopped by a signal)"""
    late_signal: int | None = None
    """a stop signal that arrived after the last optimizer step: the run finished and exported anyway"""
    model: Any = field(default=None, repr=False)
    """the trained MtpcTrainModule (backbone + head), so a caller can evaluate without reloading"""


def check_config(
    config: TrainConfig | dict[str, Any] | str | Path, overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Parse and check a config without loading weights or data; returns the resolved config dict.

    Raises ValueError naming the file and the key. The sweep runner checks every grid point with it.
    """
    return load_config(config, overrides).check().resolved().to_dict()


def train_head(
    config: TrainConfig | dict[str, Any] | str | Path,
    overrides: dict[str, Any] | None = None,
    *,
    mlflow_run_id: str | None = None,
    ckpt_path: str | Path | None = None,
    run_dir: str | Path | None = None,
    export_dir: str | Path | None = None,
    callbacks: list[Callback] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> TrainResult:
    """Train one head from a config (a TrainConfig, a dict, a YAML path or a shipped name) and export it.

    overrides: nested or dotted keys applied on top of the config ({"model.circuit": "hmm"}).
    mlflow_run_id: log into this existing run (e.g. the sweep's trial run; it is left open).
    ckpt_path: resume exactly from this local checkpoint of the same run, or "last" for
        `<run_dir>/checkpoints/last.ckpt` (ValueError when there is nothing to resume).
    run_dir / export_dir: override `run.dir` / `run.export_dir`.
    callbacks: extra Lightning callbacks (tests use them to record or interrupt).
    should_stop: polled after every optimizer step; true -> checkpoint and stop (`preempted`). When
        given, the caller owns the signals; otherwise SIGUSR1, SIGTERM or SIGINT during fit does the same.
    """
    started = time.perf_counter()
    cfg = load_config(config, overrides)
    if run_dir is not None or export_dir is not None:
        run = replace(
            cfg.run,
            dir=str(run_dir) if run_dir is not None else cfg.run.dir,
            export_dir=str(export_dir) if export_dir is not None else cfg.run.export_dir,
        )
        cfg = replace(cfg, run=run)
    cfg = cfg.check().resolved()
    check_trainer(cfg)
    ckpt_path = check_ckpt_path(ckpt_path, Path(cfg.run.dir))
    return _fit(
        cfg,
        started,
        mlflow_run_id=mlflow_run_id,
        ckpt_path=ckpt_path,
        callbacks=list(callbacks or []),
        should_stop=should_stop,
    )


def cluster_environment() -> Any:
    """Lightning's cluster environment for this process: TorchElasticEnvironment under torchrun;
    SLURMEnvironment (without its auto-requeue: `StopCheckpoint` owns SIGUSR1) inside an `srun` step of
    more than one task (every rank started by srun, ranks from SLURM_PROCID); else
    LightningEnvironment (one process, or Lightning starting the other local ranks itself): a batch
    script or a one-task step is one process, not a rank of a multi-process job."""
    import os

    from lightning.fabric.plugins.environments import (
        LightningEnvironment,
        SLURMEnvironment,
        TorchElasticEnvironment,
    )

    if TorchElasticEnvironment.detect():
        return TorchElasticEnvironment()
    if int(os.environ.get("SLURM_STEP_NUM_TASKS", "1")) > 1 and "SLURM_PROCID" in os.environ:
        return SLURMEnvironment(auto_requeue=False)
    return LightningEnvironment()


def trainer_arguments(cfg: TrainConfig) -> dict[str, Any]:
    """`cfg.trainer` plus what the suite sets: no DistributedSampler, and DDP told about unused
    parameters when LoRA starts later (its parameters get no gradient before lora_start_epoch)."""
    args = {**cfg.trainer, "use_distributed_sampler": False}
    late_lora = cfg.model.lora_depth > 0 and cfg.model.lora_start_epoch > 0
    if late_lora and args.get("strategy") == "ddp":
        args["strategy"] = "ddp_find_unused_parameters_true"
    return args


def check_trainer(cfg: TrainConfig) -> None:
    """Build the Trainer once without side effects, so a bad trainer value is a one-line error before work."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException
    from lightning.pytorch import Trainer

    try:
        Trainer(
            **{
                **trainer_arguments(cfg),
                "logger": False,
                "enable_checkpointing": False,
                "enable_progress_bar": False,
                "enable_model_summary": False,
            },
            plugins=[cluster_environment()],
        )
    except (MisconfigurationException, ValueError, TypeError) as err:
        named = re.search(r"`(\w+)`", str(err))
        key = f"trainer.{named.group(1)}" if named and named.group(1) in cfg.trainer else "trainer"
        raise ValueError(f"{cfg.source}: {key}: {' '.join(str(err).split())}") from None


def _fit(
    cfg: TrainConfig,
    started: float,
    *,
    mlflow_run_id: str | None,
    ckpt_path: str | Path | None,
    callbacks: list[Callback],
    should_stop: Callable[[], bool] | None,
) -> TrainResult:
    import lightning as L
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from experiments.plumbing.progress import StepProgress
    from experiments.plumbing.run_dir import (
        IDENTITY_FILE,
        AtomicCheckpointIO,
        RunIdentity,
        RunLock,
        claim,
        has_checkpoints,
    )
    from experiments.training.callbacks import StopCheckpoint, YieldToTimer
    from experiments.training.datamodule import ChatDataModule
    from experiments.training.mlflow_run import make_logger

    run_dir = Path(cfg.run.dir)
    if cfg.run.cpu_threads:
        torch.set_num_threads(int(cfg.run.cpu_threads))
    stopper = StopCheckpoint(run_dir / "checkpoints" / "last.ckpt", should_stop)
    periodic = ModelCheckpoint(
        dirpath=run_dir / "checkpoints",
        save_last=True,
        save_top_k=0,
        every_n_train_steps=cfg.run.checkpoint_every_n_steps or None,
    )
    identity = RunIdentity({})
    # the suite's progress lines instead of Lightning's bar: given to the constructor, or Lightning adds its
    # own bar beside them; Lightning's ProgressBar.setup disables it on every rank but 0
    progress = [StepProgress(cfg.run.name)] if cfg.trainer.get("enable_progress_bar", True) else []
    trainer = Trainer(
        **trainer_arguments(cfg),
        callbacks=[periodic, stopper, identity, YieldToTimer(stopper.stop_requested), *progress, *callbacks],
        plugins=[cluster_environment(), AtomicCheckpointIO()],
        default_root_dir=str(run_dir),
        logger=False,
    )
    if should_stop is None:
        # the run owns its signals (StopCheckpoint): Lightning's connector would end a validation on SIGTERM
        # with SystemExit(0) (no head) and put back, after fit, the handlers of before it over ours
        trainer._signal_connector.register_signal_handlers = lambda: None
    rank_zero = trainer.global_rank == 0  # known from the cluster environment before any rank starts
    # rank 0 holds the run directory's lock for the whole run (a second start or resume beside it is
    # refused); the other ranks of a multi-process run are started by, or beside, that rank 0
    lock = RunLock(run_dir).acquire() if rank_zero else None
    fresh = not (run_dir / IDENTITY_FILE).exists()
    try:
        # every rank checks the run directory; rank 0 alone records it (the others would each draw a run id)
        identity.identity = claim(
            run_dir,
            cfg.to_dict(),
            None if ckpt_path is None else str(ckpt_path),
            write=rank_zero,
            export_dir=Path(cfg.run.export_dir),
        )
        L.seed_everything(cfg.seed_everything, verbose=False)
        module, data = _build_module(cfg), ChatDataModule(cfg.data)
        if cfg.run.hidden_cache and cfg.model.lora_depth == 0:
            from experiments.training.hidden_cache import HiddenCache
            from mtpc.paths import cache_dir

            folder = cache_dir() / "hidden" if cfg.run.hidden_cache == "auto" else Path(cfg.run.hidden_cache)
            module.hidden_cache = HiddenCache(folder, module.backbone)
        resuming = ckpt_path is not None
        if cfg.run.tracking and rank_zero:
            trainer.logger = make_logger(cfg, run_id=mlflow_run_id, resuming=resuming)
        trainer.fit(module, datamodule=data, ckpt_path=str(ckpt_path) if ckpt_path else None)
        return _finish(cfg, trainer, module, data, stopper, started)
    except BaseException:
        refused = fresh and trainer.global_step == 0 and not has_checkpoints(run_dir)
        if rank_zero and refused:  # a refused start (bad data, backbone arguments): leave nothing behind
            (run_dir / IDENTITY_FILE).unlink(missing_ok=True)
            for empty in (run_dir / "checkpoints",):
                if empty.is_dir() and not any(empty.iterdir()):
                    empty.rmdir()
        if lock is not None:
            lock.release(remove_dir=refused)
            lock = None
        raise
    finally:
        stopper.release()
        if lock is not None:
            lock.release()


def _build_module(cfg: TrainConfig) -> Any:
    """`MtpcTrainModule(cfg.model)`; a keyword argument the backbone's loader does not take (which
    `ModelConfig.check` could not rule out) is a one-line error naming model.backbone_kwargs."""
    from experiments.training.module import MtpcTrainModule

    try:
        return MtpcTrainModule(cfg.model)
    except TypeError as err:
        if "keyword argument" not in str(err) or not cfg.model.backbone_kwargs:
            raise
        raise ValueError(f"{cfg.source}: model.backbone_kwargs: {' '.join(str(err).split())}") from None


def _finish(
    cfg: TrainConfig, trainer: Any, module: Any, data: Any, stopper: Any, started: float
) -> TrainResult:
    from lightning.pytorch.loggers import MLFlowLogger

    from experiments.training.mlflow_run import log_end

    run_dir = Path(cfg.run.dir)
    rank_zero = trainer.global_rank == 0
    logger = trainer.logger if isinstance(trainer.logger, MLFlowLogger) else None
    common = {
        "checkpoint_dir": run_dir / "checkpoints",
        "run_dir": run_dir,
        "config": cfg.to_dict(),
        "model": module,
        "mlflow_run_id": logger.run_id if logger else None,
    }
    metrics = _final_metrics(trainer)
    if stopper.stopped:
        return TrainResult(
            head_dir=Path(cfg.run.export_dir),
            metrics=metrics,
            preempted=True,
            stop_signal=stopper.signum,
            **common,
        )
    if stopper.last_validation_step != trainer.global_step and trainer.limit_val_batches:
        # stopped by max_steps (or mid-epoch): score the held-out set once more on the final head
        trainer.validate(module, datamodule=data, verbose=False)
        metrics.update(_final_metrics(trainer))
    if cfg.data.on_error == "skip":
        metrics["data_skipped_records"] = float(data.skipped_records)
    metrics["train_seconds"] = time.perf_counter() - started
    if getattr(module, "hidden_cache", None) is not None:  # the fill is reported apart from the reuse
        metrics.update(module.hidden_cache.stats())
    if not rank_zero:  # rank 0 exports, logs and writes metrics.json
        return TrainResult(head_dir=Path(cfg.run.export_dir), metrics=metrics, **common)
    head_dir = _export(cfg, module)
    if logger:
        log_end(logger, metrics, trainer.global_step, head_dir)
    write_json(run_dir / "metrics.json", metrics, indent=2)
    return TrainResult(head_dir=head_dir, metrics=metrics, late_signal=stopper.late_signum, **common)


def _export(cfg: TrainConfig, module: Any) -> Path:
    from mtpc.heads import save_head

    lora = module.backbone.lora_state_dict() if cfg.model.lora_depth > 0 else None
    return save_head(Path(cfg.run.export_dir), module.head, lora_state=lora)


def _final_metrics(trainer: Any) -> dict[str, float]:
    out = {k: float(v.item() if torch.is_tensor(v) else v) for k, v in trainer.callback_metrics.items()}
    out["peak_mem_bytes"] = float(peak_memory_bytes())
    out["global_step"] = float(trainer.global_step)
    return out
