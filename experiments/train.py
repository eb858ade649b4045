"""Train one MtPC head: the LightningCLI entry and the programmatic `train_head` the sweep trial calls.

    python -m experiments.train fit --config experiments/configs/debug.yaml [--model.circuit hmm] [--ckpt_path last]

A config has the LightningCLI sections `model` (MtpcTrainModule), `data` (ChatDataModule),
`trainer`, `seed_everything`, plus `run` (RunConfig: run directory, checkpoints, export, MLflow).
Every config is validated (`validate_config`) before the backbone or the data are loaded; errors
name the key and the file. The trainer always gets `plugins=[LightningEnvironment()]` (a one-task
SLURM job must not be taken for a multi-process or self-requeueing one), a ModelCheckpoint in
`<run.dir>/checkpoints` (so `--ckpt_path last` finds `last.ckpt`) and an MLflow logger.
At the end the head (+ LoRA) is exported with `mtpc.heads.save_head` to `run.export_dir`.
Leaves out: the module and data (module.py, datamodule.py), evaluation and sweeps.
"""

from __future__ import annotations

import copy
import importlib.metadata
import json
import os
import re
import resource
import signal
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.plugins.environments import LightningEnvironment

from experiments.datamodule import ChatDataModule, source_problem
from experiments.module import INITS, MtpcTrainModule, backbone_num_layers
from mtpc.names import check_architecture

PROJECT_DIR = Path(__file__).resolve().parents[1]
CONFIG_DIR = Path(__file__).resolve().parent / "configs"
TRAIN_CONFIGS = ("debug", "default", "llama_byte", "evabyte")  # shipped in CONFIG_DIR (pretrain_*.yaml are not ours)
RUN_ID_FILE = "mlflow_run_id.txt"
PACKAGES = ("torch", "lightning", "transformers", "peft", "mlflow", "jsonargparse", "safetensors", "numpy", "mtpc")


@dataclass
class RunConfig:
    """Where a run lives and how it is tracked.

    Args:
        dir: run directory (checkpoints, exported head, resolved config); default `runs/<name>`.
        name: run name (MLflow run name too); default `<backbone>-<circuit>-n<window>-r<rank>-k<lora_depth>`.
        export_dir: where the trained head (+ LoRA) is saved; default `<dir>/head`.
        checkpoint_every_n_steps: also checkpoint every this many optimizer steps (0: epoch ends only).
        tracking: log to MLflow.
        tracking_uri: MLflow tracking URI; `MLFLOW_TRACKING_URI` overrides it; default sqlite in the project dir.
        experiment: MLflow experiment name (created if missing).
    """

    dir: str | None = None
    name: str | None = None
    export_dir: str | None = None
    checkpoint_every_n_steps: int = 0
    tracking: bool = True
    tracking_uri: str | None = None
    experiment: str = "mtpc-train"
    cpu_threads: int | None = None
    """torch CPU threads (1 is fastest for tiny models on a shared machine); None: torch's default"""


@dataclass
class TrainResult:
    """What `train_head` returns: where the head and checkpoints are, and the final metrics."""

    head_dir: Path
    metrics: dict[str, float]
    checkpoint_dir: Path
    run_dir: Path
    mlflow_run_id: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    preempted: bool = False
    """stopped early on SIGUSR1 after writing checkpoints/last.ckpt (nothing exported); resume with ckpt_path last"""
    model: Any = field(default=None, repr=False)
    """the trained MtpcTrainModule (backbone + head), so a caller can evaluate without reloading"""


# ---------------------------------------------------------------------------------------------------
# validation: plain checks on the resolved config dict, before anything heavy happens
# ---------------------------------------------------------------------------------------------------

def validate_config(cfg: dict[str, Any], source: str = "<config>") -> None:
    """Raise ValueError naming the key (and `source`, the file) for the first problem found in `cfg`.

    Checks circuit kind, window, rank, lora_depth against the backbone's layer count, the backbone
    and data sources, lengths and the optimiser/schedule settings. Needs no weights and no data.
    """

    def fail(key: str, msg: str) -> None:
        raise ValueError(f"{source}: {key}: {msg}")

    m, d, t, r = (cfg.get(k) or {} for k in ("model", "data", "trainer", "run"))
    n, k = m.get("window"), m.get("lora_depth", 0)
    check_architecture(m.get("circuit"), m.get("window"), m.get("rank"), k, decoding=True, where=f"{source}: model.")
    bb = m.get("backbone")
    if not isinstance(bb, str) or not bb:
        fail("model.backbone", f"got {bb!r}; expected `default`, `tiny`, a local model directory or a hub name")
    p = Path(bb).expanduser()
    if bb.startswith((".", "/", "~")) and not (p / "config.json").exists():
        fail("model.backbone", f"no model at {str(p)!r} (expected a directory with config.json)")
    layers = backbone_num_layers(bb)
    if layers is None and bb not in ("default", "tiny") and "/" not in bb:
        fail("model.backbone", f"unknown backbone {bb!r}: not `default`, `tiny`, a local directory or an org/name hub id")
    if layers is not None and k > layers:
        fail("model.lora_depth", f"k = {k} exceeds the {layers} layers of backbone {bb!r}")
    if m.get("init", "lm_head") not in INITS:
        fail("model.init", f"got {m.get('init')!r}; expected one of {list(INITS)}")
    lr = m.get("lr", 3e-4)
    if not isinstance(lr, (int, float)) or not lr > 0:
        fail("model.lr", f"got {lr!r}; expected a positive number")
    gamma = m.get("gamma")
    if gamma is not None and not (isinstance(gamma, (int, float)) and 0 < gamma <= 1):
        fail("model.gamma", f"got {gamma!r}; expected null or 0 < gamma <= 1")
    cs = m.get("chunk_size", 256)
    if not isinstance(cs, int) or cs < 1:
        fail("model.chunk_size", f"got {cs!r}; expected a positive integer")
    beta = m.get("kl_beta", 0.0)
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta <= 1:
        fail("model.kl_beta", f"got {beta!r}; expected a number in [0, 1] (weight of the distillation term; 0: CE only)")
    kl_t = m.get("kl_temperature", 1.0)
    if isinstance(kl_t, bool) or not isinstance(kl_t, (int, float)) or not 0 < kl_t < float("inf"):
        fail("model.kl_temperature", f"got {kl_t!r}; expected a finite number > 0 (temperature of the teacher)")
    lse = m.get("lora_start_epoch", 1)
    if not isinstance(lse, int) or lse < 0:
        fail("model.lora_start_epoch", f"got {lse!r}; expected an integer >= 0")
    max_epochs = t.get("max_epochs")
    if k > 0 and isinstance(max_epochs, int) and max_epochs >= 0 and lse >= max_epochs and not t.get("max_steps", -1) > 0:
        fail("model.lora_start_epoch", f"LoRA (lora_depth={k}) would start at epoch {lse} but trainer.max_epochs = "
             f"{max_epochs}; expected lora_start_epoch < max_epochs")
    src = d.get("source")
    if not isinstance(src, str) or not src:
        fail("data.source", f"got {src!r}; expected `sharegpt`, `debug`, a .json/.jsonl file or a HF dataset name")
    problem = source_problem(src)
    if problem:
        fail("data.source", problem)
    extra = d.get("extra_train_source")
    if extra is not None and (not isinstance(extra, str) or not Path(extra).expanduser().is_file()):
        fail("data.extra_train_source", f"got {extra!r}; expected an existing .json/.jsonl messages file "
             "(e.g. from python -m experiments.selfdistill)")
    seq_len = d.get("seq_len")
    if not isinstance(seq_len, int) or seq_len < n + 1:
        fail("data.seq_len", f"got {seq_len!r}; expected an integer >= window + 1 = {n + 1}")
    bs = d.get("batch_size", 1)
    if not isinstance(bs, int) or bs < 1:
        fail("data.batch_size", f"got {bs!r}; expected a positive integer")
    vf = d.get("val_fraction", 0.02)
    if not isinstance(vf, (int, float)) or not 0 <= vf < 1:
        fail("data.val_fraction", f"got {vf!r}; expected 0 <= val_fraction < 1")
    ce = r.get("checkpoint_every_n_steps", 0)
    if not isinstance(ce, int) or ce < 0:
        fail("run.checkpoint_every_n_steps", f"got {ce!r}; expected an integer >= 0")


# ---------------------------------------------------------------------------------------------------
# tracking helpers
# ---------------------------------------------------------------------------------------------------

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


def peak_memory_bytes() -> int:
    """Peak CUDA memory allocated if on GPU, else the process's peak resident set size."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class PreemptionCheckpoint(Callback):
    """Writes `last.ckpt` at the final max_steps step, and on SIGUSR1 (SLURM's `--signal=USR1@<secs>` before a time limit or pre-emption): write
    `last.ckpt` after the current optimizer step and stop, so `ckpt_path="last"` resumes exactly.

    Lightning's own handler is not used: under LightningEnvironment (which we pass so a one-task
    job is not taken for a multi-process or self-requeueing one) it does not install one, and
    SLURMEnvironment's would `scontrol requeue` the job behind the sweep's back.
    """

    def __init__(self, checkpoint: Path, signum: int = signal.SIGUSR1):
        self.checkpoint, self.signum = Path(checkpoint), signum
        self.requested = False
        self.saved = False
        self._previous: Any = None

    def _handler(self, signum: int, frame: Any) -> None:
        self.requested = True

    def on_fit_start(self, trainer: Trainer, pl_module: Any) -> None:
        if threading.current_thread() is threading.main_thread():
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
        if self.requested and not self.saved:
            trainer.save_checkpoint(self.checkpoint)
            self.saved = True
            trainer.should_stop = True
        elif 0 < trainer.max_steps <= trainer.global_step:
            # the last step of a max_steps run: ModelCheckpoint may not save here (mid-epoch), but a
            # later `--ckpt_path last --trainer.max_steps <more>` must continue from this exact state
            trainer.save_checkpoint(self.checkpoint)


class _LastValidation(Callback):
    """Remembers the global step of the last completed validation pass (see _finish)."""

    step: int | None = None

    def on_validation_end(self, trainer: Trainer, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            self.step = trainer.global_step


class _Logger(MLFlowLogger):
    """MLFlowLogger that leaves a run it did not create (e.g. the sweep's trial run) open at the end."""

    def __init__(self, *args: Any, owns_run: bool = True, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._owns_run = owns_run

    def finalize(self, status: str = "success") -> None:
        if self._owns_run:
            super().finalize(status)


def training_params(cfg: dict[str, Any]) -> dict[str, Any]:
    """MLflow params: DESIGN section 3 names (backbone, circuit, window, rank, lora_depth, seed) + settings."""
    m, d, t = cfg["model"], cfg["data"], cfg.get("trainer") or {}
    return {
        "backbone": m["backbone"], "circuit": m["circuit"], "window": m["window"],
        "rank": m["rank"], "lora_depth": m.get("lora_depth", 0),
        "seed": cfg.get("seed_everything"), "lora_start_epoch": m.get("lora_start_epoch"), "lr": m.get("lr"),
        "gamma": m.get("gamma"), "init": m.get("init"), "chunk_size": m.get("chunk_size"),
        "kl_beta": m.get("kl_beta", 0.0), "kl_temperature": m.get("kl_temperature", 1.0),
        "train_seed": cfg.get("seed_everything"),
        "data_source": d["source"], "extra_train_source": d.get("extra_train_source"), "seq_len": d["seq_len"], "batch_size": d.get("batch_size"),
        "accumulate_grad_batches": t.get("accumulate_grad_batches", 1), "max_epochs": t.get("max_epochs"),
        "max_steps": t.get("max_steps"), "precision": t.get("precision"),
        "bytes_per_step": d["seq_len"] * d.get("batch_size", 1) * (t.get("accumulate_grad_batches") or 1),
    }


def default_run_name(cfg: dict[str, Any]) -> str:
    m = cfg["model"]
    bb = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(m["backbone"]).name)
    return f"{bb}-{m['circuit']}-n{m['window']}-r{m['rank']}-k{m.get('lora_depth', 0)}"


# ---------------------------------------------------------------------------------------------------
# the CLI
# ---------------------------------------------------------------------------------------------------

class TrainCLI(LightningCLI):
    """LightningCLI + a `run` section, validation before instantiation, and the run's trainer wiring."""

    config_source: str = "<config>"
    mlflow_run_id: str | None = None
    extra_callbacks: list[Callback] = []
    resuming: bool = False
    validate_only: bool = False

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_class_arguments(RunConfig, "run")

    def _section(self) -> Any:
        return self.config[self.subcommand] if self.subcommand else self.config

    def before_instantiate_classes(self) -> None:
        cfg = self._section()
        files = cfg.get("config") or []
        if files:
            self.config_source = ", ".join(str(f) for f in files)
        self.resolved = _namespace_to_dict(cfg)
        validate_config(self.resolved, self.config_source)
        run = self.resolved["run"]
        run["name"] = run.get("name") or default_run_name(self.resolved)
        run["dir"] = str(Path(run.get("dir") or Path("runs") / run["name"]).resolve())
        run["export_dir"] = str(Path(run.get("export_dir") or Path(run["dir"]) / "head").resolve())
        if run.get("cpu_threads"):
            torch.set_num_threads(int(run["cpu_threads"]))
        if self.subcommand == "fit" and cfg.get("ckpt_path"):
            self.resuming = True

    def instantiate_classes(self) -> None:
        if not self.validate_only:
            super().instantiate_classes()

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        run = self.resolved["run"]
        run_dir = Path(run["dir"])
        run_dir.mkdir(parents=True, exist_ok=True)
        ckpt = ModelCheckpoint(dirpath=run_dir / "checkpoints", save_last=True, save_top_k=0,
                               every_n_train_steps=run["checkpoint_every_n_steps"] or None)
        self.preemption = PreemptionCheckpoint(run_dir / "checkpoints" / "last.ckpt")
        self.last_validation = _LastValidation()
        trainer_cfg = self._get(self.config_init, "trainer", default={})
        callbacks = list(trainer_cfg.get("callbacks") or []) + [ckpt, self.preemption, self.last_validation] + list(
            self.extra_callbacks)
        kwargs.setdefault("callbacks", callbacks)
        kwargs.setdefault("plugins", trainer_cfg.get("plugins") or [LightningEnvironment()])
        kwargs.setdefault("default_root_dir", str(run_dir))
        kwargs.setdefault("logger", self._make_logger(run, run_dir) if run["tracking"] else False)
        return super().instantiate_trainer(**kwargs)

    def _make_logger(self, run: dict[str, Any], run_dir: Path) -> MLFlowLogger:
        uri = tracking_uri(run.get("tracking_uri"))
        exp_id = ensure_experiment(uri, run["experiment"])
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        id_file = run_dir / RUN_ID_FILE
        owns = self.mlflow_run_id is None
        run_id = self.mlflow_run_id
        if run_id is None and self.resuming and id_file.exists():
            run_id = id_file.read_text().strip()
        if run_id is None:
            run_id = client.create_run(exp_id, run_name=run["name"]).info.run_id
        id_file.write_text(run_id + "\n")
        exp_name = client.get_experiment(client.get_run(run_id).info.experiment_id).name
        logger = _Logger(experiment_name=exp_name, tracking_uri=uri, run_id=run_id, owns_run=owns)
        _log_run_description(client, run_id, self.resolved, run_dir)
        return logger


def _namespace_to_dict(ns: Any) -> dict[str, Any]:
    d = ns.as_dict() if hasattr(ns, "as_dict") else dict(ns)
    d.pop("config", None)
    return json.loads(json.dumps(d, default=str))


def _log_run_description(client: Any, run_id: str, cfg: dict[str, Any], run_dir: Path) -> None:
    """Params (DESIGN 3 names + settings), and the resolved config, git SHA and versions as artifacts."""
    from mlflow.entities import Param

    existing = client.get_run(run_id).data.params
    params = {k: str(v) for k, v in training_params(cfg).items() if k not in existing}
    if params:
        client.log_batch(run_id, params=[Param(k, v) for k, v in params.items()])
    sha = git_sha()
    client.set_tag(run_id, "git_sha", sha)
    desc = run_dir / "description"
    desc.mkdir(exist_ok=True)
    (desc / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    (desc / "git_sha.txt").write_text(sha + "\n")
    (desc / "package_versions.json").write_text(json.dumps(package_versions(), indent=2))
    client.log_artifacts(run_id, str(desc), artifact_path="run")


def _export(cli: TrainCLI) -> Path:
    from mtpc.heads import save_head

    model: MtpcTrainModule = cli.model
    out = Path(cli.resolved["run"]["export_dir"])
    lora = model.backbone.lora_state_dict() if model.hparams.lora_depth > 0 else None
    save_head(out, model.head, lora_state=lora)
    return out


def _final_metrics(trainer: Trainer) -> dict[str, float]:
    out = {}
    for k, v in trainer.callback_metrics.items():
        out[k] = float(v.item() if torch.is_tensor(v) else v)
    out["peak_mem_bytes"] = float(peak_memory_bytes())
    out["global_step"] = float(trainer.global_step)
    return out


def _finish(cli: TrainCLI, started: float) -> TrainResult:
    trainer = cli.trainer
    run = cli.resolved["run"]
    if cli.preemption.saved:
        return TrainResult(head_dir=Path(run["export_dir"]), metrics=_final_metrics(trainer),
                           checkpoint_dir=Path(run["dir"]) / "checkpoints", run_dir=Path(run["dir"]),
                           mlflow_run_id=getattr(trainer.logger, "run_id", None), config=cli.resolved,
                           preempted=True, model=cli.model)
    metrics = _final_metrics(trainer)
    if cli.last_validation.step != trainer.global_step and trainer.limit_val_batches:
        # stopped by max_steps (or mid-epoch): score the held-out set once more on the final head
        trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)
        metrics.update(_final_metrics(trainer))
    head_dir = _export(cli)
    metrics["train_seconds"] = time.perf_counter() - started
    run_id = None
    logger = trainer.logger
    if isinstance(logger, MLFlowLogger):
        run_id = logger.run_id
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=logger._tracking_uri)
        client.log_metric(run_id, "peak_mem_bytes", metrics["peak_mem_bytes"], step=trainer.global_step)
        client.log_metric(run_id, "train_seconds", metrics["train_seconds"], step=trainer.global_step)
        client.set_tag(run_id, "head_dir", str(head_dir))
        client.log_artifact(run_id, str(head_dir / "config.json"), artifact_path="head")
    (Path(run["dir"]) / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return TrainResult(head_dir=head_dir, metrics=metrics, checkpoint_dir=Path(run["dir"]) / "checkpoints",
                       run_dir=Path(run["dir"]), mlflow_run_id=run_id, config=cli.resolved, model=cli.model)


def _deep_merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`overrides` may be nested or use dotted keys ("model.rank": 8)."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        parts = key.split(".")
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        if isinstance(value, dict) and isinstance(node.get(parts[-1]), dict):
            node[parts[-1]] = _deep_merge(node[parts[-1]], value)
        else:
            node[parts[-1]] = copy.deepcopy(value)
    return out


def load_config(config: dict[str, Any] | str | Path) -> tuple[dict[str, Any], str]:
    """(config dict, source name). A bare name like `debug` means experiments/configs/debug.yaml."""
    if isinstance(config, dict):
        return copy.deepcopy(config), "<dict config>"
    p = Path(config)
    if not p.exists() and not p.suffix and (CONFIG_DIR / f"{p}.yaml").exists():
        p = CONFIG_DIR / f"{p}.yaml"
    if not p.exists():
        raise ValueError(f"config: no such file {str(p)!r}")
    return yaml.safe_load(p.read_text()) or {}, str(p)


def make_cli(args: dict[str, Any] | list[str] | None, *, run: bool, source: str | None = None,
             mlflow_run_id: str | None = None, callbacks: list[Callback] | None = None,
             resuming: bool = False, validate_only: bool = False) -> TrainCLI:
    attrs = {"mlflow_run_id": mlflow_run_id, "extra_callbacks": list(callbacks or []), "resuming": resuming,
             "validate_only": validate_only}
    if source:
        attrs["config_source"] = source
    cls = type("TrainCLI", (TrainCLI,), attrs)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*args parameter is intended to run from within Python.*")
        warnings.filterwarnings("ignore", message=".*srun. command is available.*")
        return cls(MtpcTrainModule, ChatDataModule, args=args, run=run, save_config_callback=None,
                   seed_everything_default=0, parser_kwargs={"exit_on_error": False} if not run else None)


def _parse(config: dict[str, Any] | str | Path, overrides: dict[str, Any] | None, **kw: Any) -> TrainCLI:
    cfg, source = load_config(config)
    cfg = _deep_merge(cfg, overrides or {})
    try:
        return make_cli(cfg, run=False, source=source, **kw)
    except Exception as err:  # jsonargparse type errors name the key; say which file too
        if isinstance(err, ValueError) and str(err).startswith(source):
            raise
        raise ValueError(f"{source}: {err}") from err


def check_config(config: dict[str, Any] | str | Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Parse (types) and validate a config without loading weights or data; returns the resolved dict.

    Raises ValueError naming the key and the file. The sweep runner can check every grid point with it.
    """
    return _parse(config, overrides, validate_only=True).resolved


def train_head(config: dict[str, Any] | str | Path, overrides: dict[str, Any] | None = None, *,
               mlflow_run_id: str | None = None, ckpt_path: str | Path | None = None,
               run_dir: str | Path | None = None, export_dir: str | Path | None = None,
               callbacks: list[Callback] | None = None) -> TrainResult:
    """Train one head from a config (dict, YAML path or shipped name) and export it.

    overrides: nested or dotted keys applied on top of the config ({"model.circuit": "hmm"}).
    mlflow_run_id: log into this existing run (e.g. the sweep's trial run; it is left open).
    ckpt_path: resume exactly from this checkpoint, or "last" for `<run_dir>/checkpoints/last.ckpt`.
    run_dir / export_dir: override `run.dir` / `run.export_dir`.
    callbacks: extra Lightning callbacks (tests use them to record or interrupt).
    """
    overrides = dict(overrides or {})
    if run_dir is not None:
        overrides["run.dir"] = str(run_dir)
    if export_dir is not None:
        overrides["run.export_dir"] = str(export_dir)
    started = time.perf_counter()
    cli = _parse(config, overrides, mlflow_run_id=mlflow_run_id, callbacks=callbacks, resuming=ckpt_path is not None)
    if ckpt_path == "last":
        last = Path(cli.resolved["run"]["dir"]) / "checkpoints" / "last.ckpt"
        ckpt_path = str(last) if last.exists() else None
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=str(ckpt_path) if ckpt_path else None)
    return _finish(cli, started)


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    try:
        cli = make_cli(argv, run=True)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if cli.subcommand == "fit" and not cli.trainer.interrupted:
        result = _finish(cli, started)
        if result.preempted:
            print(f"pre-empted: checkpoint in {result.checkpoint_dir}; resume with --ckpt_path last")
            return 3
        print(f"head exported to {result.head_dir}")
        print(json.dumps({k: round(v, 5) for k, v in result.metrics.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
