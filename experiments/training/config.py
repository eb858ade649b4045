"""The typed training config: one dataclass per section, read from YAML and the command line, checked once.

    TrainConfig(model=ModelConfig, data=DataConfig, trainer={lightning.Trainer arguments}, run=RunConfig,
                seed_everything=0)

Every field carries its docstring, which jsonargparse turns into `--help` text (`--model.window`,
`--data.on_error`, ...). `load_config(name | path | dict, overrides)` parses a YAML file or dict
(types checked by the parser); `TrainConfig.check()` is the one validation of the values (bounds,
the architecture via `mtpc.names.check_architecture`, the keys of `model.backbone_kwargs` against the
loader's signature, files that must exist and folders that must not be files, cross-field rules),
with no weights or data loaded; every message is `<file>: <section>.<key>: what; expected`.
A sweep trial sets its grid point on a loaded config with `apply_point` (`dataclasses.replace`);
nothing else copies its values.

The parsing pieces every settings type shares (bounded YAML, `Fail`, `parse_section`, the override
rule, the class allow-list) are in `experiments.plumbing.parsing`.

Adding a setting is one field with its docstring in the dataclass of its section (plus one line in
that section's `check` if it has bounds): it becomes a YAML key, a CLI flag, an MLflow param and
an attribute the component reads (`MtpcTrainModule.config.<field>`, `ChatDataModule.config.<field>`).
Leaves out: one evaluation's settings (`experiments.evaluation.config.EvalConfig`), building the module,
data and trainer from it (fit.py), the components themselves.
"""

from __future__ import annotations

import copy
import functools
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from experiments.plumbing.parsing import (
    CONFIG_DIR,
    Fail,
    apply_overrides,
    check_class_paths,
    docstring_settings,
    is_integer,
    is_number,
    one_line,
    read_yaml,
)
from mtpc import names
from tracking import axes, schema

TRAIN_CONFIGS = (
    "debug",
    "default",
    "llama_byte",
    "evabyte",
)  # shipped in CONFIG_DIR (pretrain_*.yaml are not ours)
INITS = ("lm_head", "mtp", "random")
ON_ERROR = ("raise", "skip")
#: the `tiny` debug backbone: a random Llama built in-process (seeded; experiments/training/module.py), vocab 320 like the byte models
TINY_BACKBONE = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)
#: seeds are uint32 (numpy's range, what Lightning's seed_everything accepts; larger ones it replaces by a random seed)
MAX_SEED = 2**32 - 1
#: bytes per packed row (the paper: 8192; no backbone here has a context of a million bytes)
MAX_SEQ_LEN = 1 << 20
#: rows per device per step
MAX_ROWS = 1 << 20
#: the only classes a config may name (`class_path`, or a dotted name where Lightning takes an object):
#: Trainer arguments the suite sets itself (a YAML `trainer:` section cannot set them)
TRAINER_OWNED = (
    "callbacks",
    "logger",
    "plugins",
    "default_root_dir",
    "enable_checkpointing",
    "use_distributed_sampler",
)


@dataclass
class ModelConfig:
    """model: the frozen backbone, the head, its initialisation, the loss and the optimiser."""

    backbone: str = "default"
    """`default` (the shipped byte Llama), `tiny` (a seeded random Llama built in-process), a local HF directory or a hub id"""
    circuit: str = "cp"
    """circuit kind: ff | cp | hmm | btree"""
    window: int = names.DEFAULT_WINDOW
    """n, bytes predicted per context position (bounds: mtpc.names)"""
    rank: int = names.DEFAULT_RANK
    """r, latent states per sum unit (ff: must be 1)"""
    lora_depth: int = 0
    """k, top backbone layers the draft runs with LoRA adapters (0: none)"""
    lora_start_epoch: int = 1
    """epochs of head-only training before the LoRA adapters train too"""
    lr: float = 3e-4
    """Adam learning rate (the paper: 3e-4)"""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas"""
    weight_decay: float = 0.0
    """Adam weight decay"""
    gamma: float | None = None
    """loss discount per window position (null: 0.8 for n <= 8, else 0.9)"""
    chunk_size: int = 256
    """context positions per chunk of the loss (bounds peak memory)"""
    kl_beta: float = 0.0
    """weight of the distillation term: each target scores kl_beta KL(p_j || q_j) + (1 - kl_beta) NLL, p_j the frozen backbone's next-byte distribution (its STP logits from the same forward); 0: cross-entropy only (validation still logs the KL)"""
    kl_temperature: float = 1.0
    """temperature of the teacher p_j in the KL term"""
    init: str = "lm_head"
    """head initialisation: lm_head (copy the STP unembedding), mtp (the backbone's own MTP heads where it has them, e.g. EvaByte; else lm_head) or random"""
    init_noise: float = 1e-2
    """noise that breaks the symmetry between copied components"""
    transition_bias: float | None = None
    """diagonal bias of hmm/btree transitions at init (null: ln(r-1) + 4, near identity)"""
    leaf_delta_rank: int = 0
    """0: a full unembedding per (position, component); k > 0: a shared per-position unembedding plus rank-k deltas (paper App. G)"""
    known_byte: bool = False
    """condition the head on the window's first byte c, known in the keep cycle (reads e_t + E[c], E from the backbone's input embedding); trained and scored on positions 2..n; such heads cannot decode with extra_token=drop (docs/heads.md)"""
    backbone_dtype: str | None = None
    """torch dtype name for the backbone weights (e.g. bfloat16); null: as stored"""
    backbone_kwargs: dict[str, Any] = field(default_factory=dict)
    """extra keyword arguments for mtpc.backbones.load_backbone (e.g. lora_rank)"""
    tiny_seed: int = 0
    """seed of the `tiny` debug backbone"""
    trust_remote_code: bool = False
    """run the Python modelling code the backbone's checkpoint ships (consent; a hub id must also pin `revision`)"""
    revision: str | None = None
    """the 40-hex commit hash of a hub backbone to load (required with trust_remote_code)"""

    def check(self, fail: Fail, trainer: dict[str, Any]) -> None:
        from mtpc.backbones import check_remote_code
        from mtpc.backbones.facts import backbone_config_dict, backbone_num_layers

        k = self.lora_depth
        names.check_architecture(
            self.circuit, self.window, self.rank, k, decoding=True, where=f"{fail.source}: model."
        )
        bb = self.backbone
        if not isinstance(bb, str) or not bb:
            fail(
                "model.backbone",
                f"got {bb!r}; expected `default`, `tiny`, a local model directory or a hub name",
            )
        p = Path(bb).expanduser()
        if bb.startswith((".", "/", "~")) and not (p / "config.json").exists():
            fail("model.backbone", f"no model at {str(p)!r} (expected a directory with config.json)")
        layers = (
            TINY_BACKBONE["num_hidden_layers"]
            if bb == "tiny"
            else backbone_num_layers(bb, revision=self.revision)
        )
        if layers is None and bb not in ("default", "tiny") and "/" not in bb:
            fail(
                "model.backbone",
                f"unknown backbone {bb!r}: not `default`, `tiny`, a local directory or an org/name hub id",
            )
        if layers is not None and k > layers:
            fail("model.lora_depth", f"k = {k} exceeds the {layers} layers of backbone {bb!r}")
        if bb != "tiny":  # the library's rule, on the config.json when it is on this machine (read as JSON)
            try:
                check_remote_code(
                    bb, self.trust_remote_code, self.revision, backbone_config_dict(bb, self.revision)
                )
            except ValueError as err:
                fail("model.revision" if self.trust_remote_code else "model.trust_remote_code", str(err))
        if not isinstance(self.known_byte, bool):
            fail("model.known_byte", f"got {self.known_byte!r}; expected true or false")
        if self.init not in INITS:
            fail("model.init", f"got {self.init!r}; expected one of {list(INITS)}")
        check_value("model.lr", self.lr, fail)
        if self.gamma is not None and not (is_number(self.gamma) and 0 < self.gamma <= 1):
            fail("model.gamma", f"got {self.gamma!r}; expected null or 0 < gamma <= 1")
        if not is_integer(self.chunk_size) or self.chunk_size < 1:
            fail("model.chunk_size", f"got {self.chunk_size!r}; expected a positive integer")
        fail.integer("model.tiny_seed", self.tiny_seed, 0, MAX_SEED)
        if not isinstance(self.backbone_kwargs, dict):
            fail("model.backbone_kwargs", f"got {self.backbone_kwargs!r}; expected a mapping")
        accepted = backbone_kwarg_names(bb)
        for key in self.backbone_kwargs:
            if key not in accepted:
                fail(
                    f"model.backbone_kwargs.{key}",
                    f"not an argument backbone {bb!r} takes (unknown key {key!r}); "
                    f"expected one of {sorted(accepted)}",
                )
        check_value("model.kl_beta", self.kl_beta, fail)
        check_value("model.kl_temperature", self.kl_temperature, fail)
        lse = self.lora_start_epoch
        if not is_integer(lse) or lse < 0:
            fail("model.lora_start_epoch", f"got {lse!r}; expected an integer >= 0")
        max_epochs, max_steps = trainer.get("max_epochs"), trainer.get("max_steps") or -1
        if k > 0 and is_integer(max_epochs) and 0 <= max_epochs <= lse and not max_steps > 0:
            fail(
                "model.lora_start_epoch",
                f"LoRA (lora_depth={k}) would start at epoch {lse} but trainer.max_epochs = "
                f"{max_epochs}; expected lora_start_epoch < max_epochs",
            )


@dataclass
class DataConfig:
    """data: chat conversations packed into fixed-length rows, with a held-out split."""

    source: str = "sharegpt"
    """sharegpt (the bundled corpus), debug (generated, no download), a local .json/.jsonl file of {"id", "messages"} records, or a HF datasets name"""
    seq_len: int = 8192
    """bytes (tokens) per packed row (the paper: 8192)"""
    batch_size: int = 1
    """rows per step on each device; the global batch is devices x num_nodes x batch_size x trainer.accumulate_grad_batches"""
    global_batch_size: int | None = None
    """rows per optimizer step over all devices and nodes. null: devices x num_nodes x batch_size x accumulate_grad_batches (the resolved config states it); set: trainer.accumulate_grad_batches is derived from it, so the step keeps its size at any device count (it must divide evenly)"""
    val_fraction: float = 0.02
    """share of conversations held out (by a hash of the chat id); sharegpt uses the corpus's own held-out chats"""
    max_train_conversations: int | None = None
    """keep at most this many training conversations (null: all)"""
    max_val_conversations: int | None = 200
    """keep at most this many held-out conversations (null: all)"""
    max_val_rows: int | None = None
    """keep at most this many packed held-out rows (null: all)"""
    seed: int = 0
    """seeds the per-epoch shuffle"""
    on_error: str = "raise"
    """a malformed record of a .json/.jsonl/HF source: raise (stop, naming file and line) or skip (drop it; the count is reported)"""
    extra_train_source: str | None = None
    """a messages .json/.jsonl file added to the training split only (e.g. self-distillation answers from `python -m experiments.training.selfdistill`), after max_train_conversations; validation stays on `source`"""

    def check(self, fail: Fail, window: int) -> None:
        from mtpc.data import source_problem

        if not isinstance(self.source, str) or not self.source:
            fail(
                "data.source",
                f"got {self.source!r}; expected `sharegpt`, `debug`, a .json/.jsonl file or a HF dataset name",
            )
        problem = source_problem(self.source)
        if problem:
            fail("data.source", problem)
        if not is_integer(self.seq_len) or not window + 1 <= self.seq_len <= MAX_SEQ_LEN:
            fail(
                "data.seq_len",
                f"got {self.seq_len!r}; expected an integer in window + 1 = {window + 1} .. {MAX_SEQ_LEN}",
            )
        if not is_integer(self.batch_size) or not 1 <= self.batch_size <= MAX_ROWS:
            fail("data.batch_size", f"got {self.batch_size!r}; expected an integer in 1 .. {MAX_ROWS}")
        fail.integer("data.seed", self.seed, 0, MAX_SEED)
        if not is_number(self.val_fraction) or not 0 <= self.val_fraction < 1:
            fail("data.val_fraction", f"got {self.val_fraction!r}; expected 0 <= val_fraction < 1")
        if self.on_error not in ON_ERROR:
            fail("data.on_error", f"got {self.on_error!r}; expected one of {list(ON_ERROR)}")
        extra = self.extra_train_source
        if extra is not None and (not isinstance(extra, str) or not Path(extra).expanduser().is_file()):
            fail(
                "data.extra_train_source",
                f"got {extra!r}; expected an existing .json/.jsonl messages file "
                "(e.g. from python -m experiments.training.selfdistill)",
            )


@dataclass
class RunConfig:
    """run: where a run lives and how it is tracked."""

    dir: str | None = None
    """run directory (checkpoints, exported head, description); null: runs/<name>"""
    name: str | None = None
    """run name (the MLflow run name too); null: <backbone>-<grid key>, e.g. tiny-cp-r4-n4-k0 (the sweep's key of the same head)"""
    export_dir: str | None = None
    """where the trained head (+ LoRA) is saved; null: <dir>/head"""
    checkpoint_every_n_steps: int = 0
    """also checkpoint every this many optimizer steps (0: at epoch ends only)"""
    tracking: bool = True
    """log to MLflow"""
    tracking_uri: str | None = None
    """MLflow tracking URI; MLFLOW_TRACKING_URI overrides it; null: sqlite:///<cwd>/mlflow.db (tracking/store.py)"""
    experiment: str = "mtpc-train"
    """MLflow experiment name (created if missing)"""
    cpu_threads: int | None = None
    """torch CPU threads (1 is fastest for tiny models on a shared machine); null: torch's default"""
    hidden_cache: str | None = None
    """a folder where the frozen backbone's hidden states of every training and validation batch are kept
    and reused by later heads and trials on the same rows (k = 0 only; experiments/training/hidden_cache.py;
    `auto`: <cache dir>/hidden); null: none. Results are unchanged: it only skips the trunk's forward"""

    def check(self, fail: Fail) -> None:
        ce = self.checkpoint_every_n_steps
        if not is_integer(ce) or ce < 0:
            fail("run.checkpoint_every_n_steps", f"got {ce!r}; expected an integer >= 0")
        if self.cpu_threads is not None and not (
            is_integer(self.cpu_threads) and 1 <= self.cpu_threads <= 4096
        ):
            fail(
                "run.cpu_threads",
                f"got {self.cpu_threads!r}; expected null (torch's default) or an integer in 1 .. 4096",
            )
        for key in ("dir", "export_dir"):
            problem = _folder_problem(getattr(self, key))
            if problem:
                fail(f"run.{key}", problem)


def _folder_problem(value: str | None) -> str | None:
    """Why a folder the run writes to cannot be one (an existing file at or above it), or None."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        return f"got {value!r}; expected a folder path"
    p = Path(value).expanduser()
    for q in (p, *p.parents):
        if q.exists():
            if q.is_dir():
                return None
            what = "is" if q == p else f"lies under {str(q)!r}, which is"
            return f"{str(p)!r} {what} an existing file; expected a folder (or a path where one can be made)"
    return None


@dataclass
class TrainConfig:
    """A training run: model, data, trainer, run, seed_everything (the YAML sections)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: dict[str, Any] = field(default_factory=dict)
    """lightning.Trainer arguments that differ from its defaults (max_epochs, max_steps, precision, ...)"""
    run: RunConfig = field(default_factory=RunConfig)
    seed_everything: int = 0
    """global seed (Python, numpy, torch), set before the head is built; the MLflow `seed` param"""
    source: str = field(default="<config>", compare=False)
    """where the values came from (file names), for error messages; not a YAML key"""

    def check(self) -> TrainConfig:
        """Raise ValueError `<source>: <key>: ...` for the first bad value; returns self. Loads nothing heavy."""
        fail = Fail(self.source)
        check_value("seed_everything", self.seed_everything, fail)
        self.model.check(fail, self.trainer)
        _check_trainer(fail, self.trainer)
        self.data.check(fail, self.model.window)
        self.run.check(fail)
        fail.integer("seed_everything", self.seed_everything, 0, MAX_SEED)
        self.accumulation(fail)
        return self

    def accumulation(self, fail: Fail | None = None) -> int:
        """accumulate_grad_batches: derived from data.global_batch_size when that is set (which must
        then be devices x num_nodes x batch_size x an integer, and agree with a configured
        accumulate_grad_batches), else the trainer's (default 1)."""
        fail = fail or Fail(self.source)
        configured = self.trainer.get("accumulate_grad_batches")
        total = self.data.global_batch_size
        if total is None:
            return configured or 1
        if not is_integer(total) or total < 1:
            fail("data.global_batch_size", f"got {total!r}; expected a positive integer or null")
        per_step = world_size(self.trainer) * self.data.batch_size
        if total % per_step:
            fail(
                "data.global_batch_size",
                f"{total} rows is not a multiple of devices x num_nodes x data.batch_size = {per_step}",
            )
        derived = total // per_step
        if configured not in (None, derived):
            fail(
                "trainer.accumulate_grad_batches",
                f"{configured} disagrees with data.global_batch_size {total} = "
                f"{per_step} rows per step x {derived}; set one of them",
            )
        return derived

    def resolved(self) -> TrainConfig:
        """With the run's defaults filled in: name, absolute dir and export_dir; the global batch
        (data.global_batch_size) and the accumulation it implies (trainer.accumulate_grad_batches)."""
        name = self.run.name or default_run_name(self)
        run_dir = Path(self.run.dir or Path("runs") / name).resolve()
        export = Path(self.run.export_dir or run_dir / "head").resolve()
        accumulate = self.accumulation()
        trainer = dict(self.trainer)
        if accumulate != 1 or "accumulate_grad_batches" in trainer:
            trainer["accumulate_grad_batches"] = accumulate
        total = world_size(trainer) * self.data.batch_size * accumulate
        return replace(
            self,
            run=replace(self.run, name=name, dir=str(run_dir), export_dir=str(export)),
            data=replace(self.data, global_batch_size=total),
            trainer=trainer,
        )

    def to_dict(self) -> dict[str, Any]:
        """The YAML layout (what `load_config` reads back), plain types only."""
        d = asdict(self)
        d.pop("source")
        d["model"]["betas"] = list(d["model"]["betas"])
        return d

    def params(self) -> dict[str, Any]:
        """MLflow params: every model field (backbone, circuit, window, rank, lora_depth, revision, ...),
        the seed, every sweep axis under its param name (`point_of`: train_seed = seed_everything), the data and trainer settings a comparison needs, and the bytes per optimizer step."""
        d, t = self.data, self.trainer
        accumulate = self.accumulation()
        world = world_size(t)
        return {
            **asdict(self.model), "seed": self.seed_everything, **point_of(self),
            "data_source": d.source, "extra_train_source": d.extra_train_source, "seq_len": d.seq_len,
            "batch_size": d.batch_size, "on_error": d.on_error,
            "accumulate_grad_batches": accumulate, "max_epochs": t.get("max_epochs"),
            "max_steps": t.get("max_steps"), "precision": t.get("precision"),
            "devices": t.get("devices", "auto"), "num_nodes": t.get("num_nodes", 1), "strategy": t.get("strategy", "auto"),
            "world_size": world, "global_batch_size": world * d.batch_size * accumulate,
            "bytes_per_step": d.seq_len * world * d.batch_size * accumulate,
        }  # fmt: skip


def backbone_kwarg_names(backbone: str) -> set[str]:
    """The keys `model.backbone_kwargs` may hold for `backbone`: the keyword arguments of
    `mtpc.backbones.load_backbone` and of the adapters it builds (`tiny`: the Llama adapter's), less
    those the model section sets itself (lora_depth, dtype, trust_remote_code, revision)."""
    import inspect

    from mtpc.backbones import load_backbone
    from mtpc.backbones.evabyte import EvaByteAdapter
    from mtpc.backbones.hf_llama import BackboneAdapter

    def named(fn: Any) -> set[str]:
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        return {n for n, p in inspect.signature(fn).parameters.items() if p.kind in kinds}

    adapters = named(BackboneAdapter.__init__) | (
        set() if backbone == "tiny" else named(EvaByteAdapter.__init__)
    )
    loader = set() if backbone == "tiny" else named(load_backbone)
    own = {
        "self",
        "model",
        "name",
        "tokenizer",
        "name_or_path",
        "lora_depth",
        "dtype",
        "trust_remote_code",
        "revision",
    }
    return (adapters | loader) - own


def world_size(trainer: dict[str, Any]) -> int:
    """Processes of a run: devices x num_nodes from the trainer section (`devices` an int, a list or a
    "0,1" string of device ids; -1 or "auto": every GPU of the node when the accelerator is not the
    CPU, 1 on the CPU)."""
    devices, nodes = trainer.get("devices", "auto"), trainer.get("num_nodes", 1) or 1
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        devices = int(devices)
    elif isinstance(devices, str) and "," in devices:
        devices = [d for d in devices.split(",") if d.strip()]
    if isinstance(devices, (list, tuple)):
        n = len(devices)
    elif is_integer(devices) and devices > 0:
        n = devices
    elif trainer.get("accelerator", "auto") == "cpu":
        n = 1
    else:
        import torch

        n = torch.cuda.device_count() or 1
    return int(n) * int(nodes)


#: the rules of single TrainConfig fields, each checked on its value alone: the sections' checks call
#: them, and a sweep spec checks a training axis's values with them where no TrainConfig is built
#: (`check_value`). path -> rule(value) -> what was expected (None: the value is valid)
VALUE_RULES: dict[str, Any] = {
    "model.lr": lambda v: None if is_number(v) and v > 0 else "expected a positive number",
    "model.kl_beta": lambda v: (
        None if is_number(v) and 0 <= v <= 1 else "expected a number in [0, 1] (0: cross-entropy only)"
    ),
    "model.kl_temperature": lambda v: (
        None
        if is_number(v) and 0 < v < float("inf")
        else "expected a finite number > 0 (temperature of the teacher)"
    ),
    "seed_everything": lambda v: (
        None if is_integer(v) and 0 <= v < 2**32 else "expected an integer in [0, 2**32)"
    ),
}


def check_value(path: str, value: Any, fail: Fail) -> None:
    """`fail(path, "got <value>; <expected>")` unless `value` passes the rule of field `path` (VALUE_RULES;
    a field without one passes)."""
    rule = VALUE_RULES.get(path)
    problem = rule(value) if rule else None
    if problem:
        fail(path, f"got {value!r}; {problem}")


def config_value(cfg: TrainConfig, path: str) -> Any:
    """The value of the field at dotted `path` (`model.rank`, `seed_everything`)."""
    return functools.reduce(getattr, path.split("."), cfg)


def point_of(cfg: TrainConfig) -> dict[str, Any]:
    """Every sweep axis's value in `cfg`, under its param name (`tracking.axes`), as the axis's type."""
    return {a.name: a.value(config_value(cfg, a.path)) for a in axes.axes()}


def apply_point(cfg: TrainConfig, point: dict[str, Any]) -> TrainConfig:
    """`cfg` with a sweep point set: each axis's value on the config path its row names
    (`tracking.axes`; train_seed -> seed_everything), through the one override rule
    (`experiments.plumbing.parsing.apply_overrides`, types checked by the parser); axes the point leaves out keep
    the config's values. UnknownAxis (a ValueError, one line) for a key that is no axis. The values
    are checked by `cfg.check()`."""
    axes.check_names(point)
    if not point:
        return cfg
    overrides = {axes.axis(name).path: value for name, value in point.items()}
    return load_config(cfg, overrides, trainer_types=False)


def default_run_name(cfg: TrainConfig) -> str:
    """`<backbone>-<grid key>`, e.g. `tiny-cp-r4-n4-k0` (`-kl0.5-s1` for kl_beta 0.5, seed 1): the
    sweep's name of the same head (`tracking.schema.grid_key` of every axis's value) after the backbone's."""
    bb = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(cfg.model.backbone).name)
    return f"{bb}-{schema.grid_key(point_of(cfg))}"


# ---------------------------------------------------------------------------------------------------
# parsing: jsonargparse reads the dataclasses (types + attribute docstrings) and Trainer's signature
# ---------------------------------------------------------------------------------------------------


@functools.cache
def fit_parser(trainer_types: bool = True) -> Any:
    """The parser `load_config` uses (built once per process); `trainer_types=False` takes the trainer
    section as a plain mapping (no Lightning import: what a sweep spec uses at load time;
    `TrainConfig.check` checks it against Trainer's signature)."""
    return build_fit_parser(trainer_types)


def build_fit_parser(trainer_types: bool = True) -> Any:
    """The `fit` arguments: --config, --seed_everything, --model.*, --data.*, --trainer.*, --run.*, --ckpt_path,
    --mlflow_run_id."""
    from jsonargparse import ActionConfigFile, ArgumentParser

    docstring_settings()
    p = ArgumentParser(exit_on_error=False, description="Train one MtPC head (docs/training.md).")
    p.add_argument(
        "-c", "--config", action=ActionConfigFile, help="a YAML config (experiments/configs/*.yaml)"
    )
    p.add_argument("--seed_everything", type=int, default=0, help="global seed, set before the head is built")
    p.add_class_arguments(ModelConfig, "model")
    p.add_class_arguments(DataConfig, "data")
    if trainer_types:
        from lightning.pytorch import Trainer

        p.add_class_arguments(Trainer, "trainer", skip=set(TRAINER_OWNED))
    else:
        p.add_argument("--trainer", type=dict[str, Any], default={}, help="lightning.Trainer arguments")
    p.add_class_arguments(RunConfig, "run")
    p.add_argument(
        "--ckpt_path",
        type=str | None,
        default=None,
        help="resume from this checkpoint; `last`: <run.dir>/checkpoints/last.ckpt",
    )
    p.add_argument(
        "--mlflow_run_id",
        type=str | None,
        default=None,
        help="log into this existing MLflow run and leave it open (a sweep trial's parent run); rank 0 only",
    )
    return p


def from_namespace(ns: Any, source: str, trainer_types: bool = True) -> TrainConfig:
    """A parsed `fit_parser` namespace -> TrainConfig (Trainer arguments kept only where they differ from its defaults)."""
    trainer = ns.trainer if isinstance(ns.trainer, dict) else ns.trainer.as_dict()
    if trainer_types:
        defaults = fit_parser().get_defaults().trainer.as_dict()
        trainer = {k: v for k, v in trainer.items() if v != defaults.get(k)}
    return TrainConfig(
        model=ModelConfig(**ns.model.as_dict()),
        data=DataConfig(**ns.data.as_dict()),
        trainer=dict(trainer),
        run=RunConfig(**ns.run.as_dict()),
        seed_everything=ns.seed_everything,
        source=source,
    )


def _check_trainer(fail: Fail, trainer: dict[str, Any]) -> None:
    """The trainer section against lightning.Trainer's signature (a config read with trainer_types=False)."""
    try:
        fit_parser().parse_object({"trainer": trainer})
    except Exception as err:  # noqa: BLE001 (jsonargparse's ArgumentError names the key)
        fail("trainer", one_line(err))


def load_config(
    config: TrainConfig | dict[str, Any] | str | Path,
    overrides: dict[str, Any] | None = None,
    *,
    trainer_types: bool = True,
) -> TrainConfig:
    """Parse a config (a TrainConfig, a dict, a YAML path or a shipped name like `debug`) with
    overrides on top (`apply_overrides`: {"model.rank": 8} or {"model": {"rank": 8}}). Types are
    checked here (ValueError naming the file and key); values are checked by `TrainConfig.check`.
    trainer_types=False: the trainer section is kept as a mapping (no Lightning import)."""
    if isinstance(config, TrainConfig):
        if not overrides:
            return config
        raw, source = config.to_dict(), config.source
    elif isinstance(config, dict):
        raw, source = copy.deepcopy(config), "<dict config>"
    else:
        p = Path(config)
        if not p.exists() and not p.suffix and (CONFIG_DIR / f"{p}.yaml").exists():
            p = CONFIG_DIR / f"{p}.yaml"
        if not p.is_file():
            raise ValueError(f"config: no such file {str(p)!r}")
        raw = read_yaml(p)
        if raw is None:
            raise ValueError(
                f"{p}: the config is empty; expected a mapping of sections (model, data, trainer, run)"
            )
        source = str(p)
    if not isinstance(raw, dict):
        raise ValueError(
            f"{source}: expected a mapping of sections (model, data, trainer, run), got {type(raw).__name__}"
        )
    raw = apply_overrides(raw, overrides or {})
    raw.pop("ckpt_path", None)
    raw.pop("mlflow_run_id", None)
    check_class_paths(raw, Fail(source))
    try:
        ns = fit_parser(trainer_types).parse_object(raw)
    except Exception as err:  # jsonargparse's ArgumentError names the key; add the file
        raise ValueError(f"{source}: {one_line(err)}") from None
    return from_namespace(ns, source, trainer_types)
