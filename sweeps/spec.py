"""Sweep specs: load a YAML file, validate every key before any work starts, expand the grid.

A spec names the study, the objective implementation (`trial` = train + evaluate, `fixture` = a
fast deterministic stand-in for tests), the base training config, the space (grid slices, or an
Optuna sampler with bounds), the objectives and their directions, the Optuna storage, the MLflow
tracking URI and experiment, the evaluation settings and sbatch resources. See docs/sweeps.md for
the schema. The sections are typed when the spec loads: each is a dataclass read by
`experiments.plumbing.parsing.parse_section` (jsonargparse: unknown and missing keys, types) and checked by its
own `check` (bounds); `train` becomes a `TrainConfig` (the base config with the section's
overrides; its trainer section is held to Lightning's signature by `TrainConfig.check`), `eval` an
`EvalConfig`. Errors are `SpecError` (a `ValueError`) naming the file and the dotted key.

Environment overrides (they win over the spec): `MTPC_OPTUNA_STORAGE`, and `MLFLOW_TRACKING_URI`
by the one tracking-URI rule (`tracking.store.resolve_uri`: environment > `mlflow.tracking_uri` >
`sqlite:///<cwd>/mlflow.db`). Leaves out: talking to Optuna or MLflow (sweeps/study.py, tracking/).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from experiments.evaluation.config import EvalConfig
from experiments.plumbing import parsing
from experiments.plumbing.parsing import Fail, apply_overrides, check_class_paths, parse_section, read_yaml
from experiments.training import config
from experiments.training.config import TrainConfig
from mtpc.names import DECODE_MODES, ArchitectureError, check_axis, point_rank
from tracking import axes
from tracking.schema import EVAL_METRICS, grid_key
from tracking.store import resolve_uri

OBJECTIVE_KINDS = ("trial", "fixture")
DIRECTIONS = ("maximize", "minimize")
SAMPLERS = ("tpe", "random")
STORAGE_ENV = "MTPC_OPTUNA_STORAGE"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class SpecError(ValueError):
    """A sweep spec is invalid: the message names the file, the key and what was expected."""


class _SpecFail(Fail):
    """The spec's message layout: `<file>: key '<dotted key>': <what>`."""

    def __call__(self, key: str, msg: str) -> None:
        raise SpecError(f"{self.source}: key '{key}': {msg}")

    def err(self, key: str, msg: str) -> SpecError:
        return SpecError(f"{self.source}: key '{key}': {msg}")


@dataclass(frozen=True)
class SpecFile:
    """The top level of a spec file (the sections are read by their own dataclasses)."""

    study: str
    """Optuna study name (and the default MLflow experiment)"""
    space: dict[str, Any]
    """grid slices, or an Optuna sampler with bounds"""
    objectives: Any
    """a list of {metric, direction[, mode]}"""
    objective: str = "trial"
    """trial (train + evaluate) | fixture (a deterministic stand-in, for tests)"""
    output_dir: str | None = None
    """journal and checkpoints (null: runs/<study>, relative to the cwd)"""
    storage: str | None = None
    """Optuna storage: a journal path or an RDB URL (null: <output_dir>/optuna.journal)"""
    mlflow: Any = None
    """{tracking_uri, experiment}"""
    train: Any = None
    """`config:` a shipped training config name or YAML path (default debug), plus nested overrides"""
    n_trials: Any = None
    """trials of a sampler space (a grid runs every point once)"""
    eval: Any = None
    """the evaluation of every trial (experiments.evaluation.config.EvalConfig)"""
    slurm: Any = None
    """sbatch resources of --submit and the devices of one trial"""
    fixture: Any = None
    """the fixture trial's settings"""
    max_retries: Any = 1
    """re-enqueues of a trial whose worker died"""
    stale_after_s: Any = 900.0
    """a RUNNING trial without heartbeat for this long counts as dead"""


@dataclass(frozen=True)
class MlflowSettings:
    """Where the trials' runs are tracked."""

    tracking_uri: str | None = None
    """MLflow tracking URI (MLFLOW_TRACKING_URI wins; null: sqlite:///<cwd>/mlflow.db)"""
    experiment: str | None = None
    """MLflow experiment name (null: the study name)"""


@dataclass(frozen=True)
class Objective:
    """One Optuna objective: a metric of the stored evaluation runs, averaged."""

    metric: str
    """an EVAL_METRICS name, averaged over the trial's stored evaluation runs"""
    direction: str
    """maximize | minimize"""
    mode: str | None = None
    """average only over evaluation runs of this decoding mode (null: all)"""

    @property
    def label(self) -> str:
        return f"{self.mode}/{self.metric}" if self.mode else self.metric

    def check(self, fail: Fail, key: str) -> Objective:
        fail.choice(f"{key}.metric", self.metric, EVAL_METRICS)
        fail.choice(f"{key}.direction", self.direction, DIRECTIONS)
        if self.mode is not None:
            fail.choice(f"{key}.mode", self.mode, DECODE_MODES)
        return self


#: strategies a trial of several ranks can run: one process per device, started by srun or by
#: Lightning's standalone launcher (experiments.training.launch); spawn/fork/notebook start their ranks inside
#: the caller, FSDP and DeepSpeed are not what the suite trains with (docs/training.md)
DDP_STRATEGIES = ("ddp", "ddp_find_unused_parameters_true", "ddp_find_unused_parameters_false")
#: strategies of a one-rank trial (it trains inside the worker's process)
SINGLE_STRATEGIES = ("auto", "single_device", *DDP_STRATEGIES)


@dataclass(frozen=True)
class SlurmSettings:
    """Resources used by `python -m sweeps.run SPEC --submit` (plain `sbatch` uses the script's) and
    the devices of one trial (what every array task must hold: one trial at a time per task)."""

    tasks: int = 4
    """array size: trials at a time"""
    cpus_per_task: int = 1
    """CPUs per task (per training rank of a multi-rank trial)"""
    mem: str = "2G"
    """memory per task"""
    time: str = "04:00:00"
    """time limit per task"""
    partition: str | None = None
    """SLURM partition (null: the cluster's default)"""
    gpus: int = 0
    """GPUs per task of a one-rank trial (a multi-GPU trial says gpus_per_trial instead)"""
    extra_args: tuple[str, ...] = ()
    """further sbatch arguments"""
    tasks_per_trial: int | None = None
    """training processes (ranks) of one trial (null: gpus_per_trial, else 1); more than 1 trains with DDP in a process group the worker launches (srun under SLURM)"""
    gpus_per_trial: int = 0
    """GPUs of one trial, one rank per GPU (0: the ranks run on CPUs)"""
    nodes_per_trial: int = 1
    """nodes one trial spans (its ranks split evenly over them)"""
    gpus_per_node: int | None = None
    """GPUs of one node of the partition (null: not checked)"""

    @property
    def ranks(self) -> int:
        """Training processes of one trial."""
        return self.tasks_per_trial or self.gpus_per_trial or 1

    @property
    def tasks_per_node(self) -> int:
        return self.ranks // self.nodes_per_trial

    @property
    def trial_gpus_per_node(self) -> int:
        return self.gpus_per_trial // self.nodes_per_trial

    def check(self, fail: Fail) -> SlurmSettings:
        fail.integer("slurm.tasks", self.tasks, 1, 100000)
        fail.integer("slurm.cpus_per_task", self.cpus_per_task, 1, 4096)
        fail.text("slurm.mem", self.mem)
        fail.text("slurm.time", self.time)
        fail.integer("slurm.gpus", self.gpus, 0, 64)
        fail.integer("slurm.gpus_per_trial", self.gpus_per_trial, 0, 100000)
        fail.integer("slurm.nodes_per_trial", self.nodes_per_trial, 1, 10000)
        if self.tasks_per_trial is not None:
            fail.integer("slurm.tasks_per_trial", self.tasks_per_trial, 1, 100000)
            if self.gpus_per_trial and self.tasks_per_trial != self.gpus_per_trial:
                fail(
                    "slurm.tasks_per_trial",
                    f"{self.tasks_per_trial} != slurm.gpus_per_trial {self.gpus_per_trial}: "
                    "a GPU trial runs one rank per GPU (give one of them)",
                )
        if self.gpus and self.gpus_per_trial:
            fail(
                "slurm.gpus",
                f"{self.gpus} GPUs per task beside slurm.gpus_per_trial {self.gpus_per_trial}: give "
                "gpus_per_trial alone",
            )
        if self.ranks % self.nodes_per_trial:
            fail(
                "slurm.nodes_per_trial",
                f"{self.ranks} ranks per trial do not split evenly over {self.nodes_per_trial} nodes",
            )
        if self.gpus_per_node is not None:
            fail.integer("slurm.gpus_per_node", self.gpus_per_node, 0, 4096)
            if self.nodes_per_trial == 1 and self.gpus_per_trial > self.gpus_per_node:
                fail(
                    "slurm.gpus_per_trial",
                    f"{self.gpus_per_trial} GPUs on a one-node trial (slurm.nodes_per_trial: 1) "
                    f"but a node has slurm.gpus_per_node = {self.gpus_per_node}: raise nodes_per_trial or lower gpus_per_trial",
                )
            if self.trial_gpus_per_node > self.gpus_per_node:
                fail(
                    "slurm.gpus_per_trial",
                    f"{self.gpus_per_trial} GPUs over {self.nodes_per_trial} nodes is "
                    f"{self.trial_gpus_per_node} per node, more than slurm.gpus_per_node = {self.gpus_per_node}",
                )
        return self


class _TrainFail(Fail):
    """A training-config check inside a spec: keys under `train.`, the trial's resources named."""

    def __init__(self, spec_fail: _SpecFail, why: str):
        super().__init__(spec_fail.source)
        self.spec_fail, self.why = spec_fail, why

    def __call__(self, key: str, msg: str) -> None:
        self.spec_fail(f"train.{key}", f"{msg} ({self.why})")


def trial_resources(
    train: TrainConfig, slurm: SlurmSettings, fail: _SpecFail, own: dict[str, Any] | None = None
) -> TrainConfig:
    """The spec's training config with one trial's devices set from `slurm` (tasks per node as
    `trainer.devices`, nodes as `num_nodes`, `ddp` unless a DDP variant is named, the accelerator
    by GPUs or not), refusing a trainer section that disagrees with them, a strategy a trial cannot
    run, and a global batch the trial's ranks cannot hold (devices x num_nodes x data.batch_size x
    accumulation must equal data.global_batch_size). `own`: the trainer keys the spec's `train` section
    sets itself (`devices` / `num_nodes` there must agree; the base config's are replaced)."""
    t = dict(train.trainer)
    own = own or {}
    strategy = t.get("strategy", "auto")
    ranks, per_node, nodes = slurm.ranks, slurm.tasks_per_node, slurm.nodes_per_trial
    where = f"slurm: {ranks} rank(s) per trial on {nodes} node(s)"
    if ranks == 1:
        if not isinstance(strategy, str) or strategy not in SINGLE_STRATEGIES:
            fail(
                "train.trainer.strategy",
                f"{strategy!r}: a one-rank trial trains inside the sweep worker; expected one "
                f"of {list(SINGLE_STRATEGIES)} (several devices: slurm.tasks_per_trial or slurm.gpus_per_trial)",
            )
        if (
            "devices" in own
            and t.get("devices", "auto") not in ("auto", None)
            and config.world_size({**t, "num_nodes": 1}) > 1
        ):
            fail(
                "train.trainer.devices",
                f"{t['devices']!r} devices in a one-rank trial: Lightning would start the other "
                "ranks by running the sweep worker again; set slurm.tasks_per_trial (or gpus_per_trial) instead",
            )
        if "num_nodes" in own and (t.get("num_nodes") or 1) != 1:
            fail(
                "train.trainer.num_nodes",
                f"{t['num_nodes']!r} in a one-rank trial; set slurm.nodes_per_trial instead",
            )
    else:
        if strategy == "auto":
            strategy = "ddp"
        if not isinstance(strategy, str) or strategy not in DDP_STRATEGIES:
            fail(
                "train.trainer.strategy",
                f"{strategy!r}: a trial's ranks are started one process per device (srun, or "
                f"Lightning's standalone launcher); expected one of {list(DDP_STRATEGIES)}",
            )
        if (
            "devices" in own
            and t["devices"] not in ("auto", None)
            and config.world_size({**t, "num_nodes": 1}) != per_node
        ):
            fail(
                "train.trainer.devices",
                f"{t['devices']!r} disagrees with the trial's {per_node} rank(s) per node ({where}); "
                "leave it out, the spec's slurm section sets it",
            )
        if "num_nodes" in own and t.get("num_nodes") not in (None, nodes):
            fail(
                "train.trainer.num_nodes",
                f"{t['num_nodes']!r} disagrees with slurm.nodes_per_trial {nodes}; leave it out",
            )
        accelerator = t.get("accelerator", "auto")
        want = "gpu" if slurm.gpus_per_trial else "cpu"
        if accelerator in ("auto", None):
            accelerator = want
        elif (accelerator == "cpu") != (want == "cpu"):
            fail(
                "train.trainer.accelerator",
                f"{accelerator!r} on a trial with slurm.gpus_per_trial = {slurm.gpus_per_trial}",
            )
        t.update(devices=per_node, num_nodes=nodes, strategy=strategy, accelerator=accelerator)
    out = replace(train, trainer=t)
    # the global batch against the trial's ranks (a one-rank trial is one device whatever `devices` says)
    replace(out, trainer={**t, "devices": per_node, "num_nodes": nodes}).accumulation(_TrainFail(fail, where))
    return out


@dataclass(frozen=True)
class FixtureSettings:
    """The fixture trial: metrics are a deterministic function of the grid point."""

    steps: int = 1
    """"training" steps, each checkpointed"""
    step_seconds: float = 0.0
    """sleep per step (lets tests cancel or pre-empt a running trial)"""
    fail: tuple[dict[str, Any], ...] = ()
    """grid points (partial mappings of the sweep axes) whose trial raises"""

    def check(self, fail: Fail) -> FixtureSettings:
        fail.integer("fixture.steps", self.steps, 1, 100000)
        fail.number("fixture.step_seconds", self.step_seconds, 0.0, 3600.0)
        for i, f in enumerate(self.fail):
            for k in f:
                if k not in axes.names():
                    fail(f"fixture.fail[{i}].{k}", f"unknown key; expected one of {sorted(axes.names())}")
        return self


@dataclass(frozen=True)
class SamplerSpace:
    kind: str  # tpe | random
    params: dict[str, dict[str, Any]]  # name -> {choices: [...]} or {low, high, log}
    seed: int = 0


@dataclass(frozen=True)
class SweepSpec:
    path: Path
    study: str
    trial_kind: str  # the YAML key `objective`: trial (train + evaluate) | fixture
    output_dir: Path
    storage: str  # "journal:<abs path>" or an RDB URL
    tracking_uri: str
    experiment: str
    train: TrainConfig  # the base training config (`train.config` + the section's overrides); a grid point is set by apply_point
    objectives: tuple[Objective, ...]
    eval: EvalConfig
    slurm: SlurmSettings
    fixture: FixtureSettings
    grid: tuple[dict[str, Any], ...] | None  # grid points, in order (None for a sampler space)
    grid_slices: dict[str, tuple[str, ...]] = field(default_factory=dict)  # grid key -> slice names
    sampler: SamplerSpace | None = None
    n_trials: int = 0  # grid: number of points
    max_retries: int = 1  # re-enqueues of a trial whose worker died
    stale_after_s: float = 900.0  # a RUNNING trial without heartbeat for this long counts as dead

    def trial_dir(self, key: str) -> Path:
        """Where the trial of grid point `key` keeps its checkpoint, head and run id (a re-run resumes there)."""
        return self.output_dir / "checkpoints" / self.study / key

    @property
    def directions(self) -> list[str]:
        return [o.direction for o in self.objectives]

    def space_signature(self) -> str:
        """A hash of what defines the study (space + objectives): another space is refused."""
        body = {
            "grid": [grid_key(p) for p in self.grid] if self.grid is not None else None,
            "sampler": None
            if self.sampler is None
            else {"kind": self.sampler.kind, "params": self.sampler.params},
            "objectives": [[o.metric, o.direction, o.mode] for o in self.objectives],
        }
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# the space: grid slices or a sampler, every value checked once against `mtpc.names`


def _values(fail: _SpecFail, v: Any, key: str) -> list:
    """A list of values (a scalar is a one-element list); an empty list is refused."""
    if not isinstance(v, list):
        v = [v]
    if not v:
        fail(key, "expected a non-empty list")
    return v


def _mapping(fail: _SpecFail, d: Any, key: str, allowed: set[str], required: set[str] = frozenset()) -> dict:
    if d is None:
        d = {}
    if not isinstance(d, dict):
        fail(key, f"expected a mapping, got {type(d).__name__}")
    for k in d:
        if k not in allowed:
            fail(f"{key}.{k}", f"unknown key; expected one of {sorted(allowed)}")
    for k in sorted(required - set(d)):
        fail(f"{key}.{k}", "missing (required)")
    return d


def _axis_value(fail: _SpecFail, name: str, v: Any, key: str) -> Any:
    """One axis value, checked once where no TrainConfig is built: an architecture axis against
    `mtpc.names` (the bounds a trial's head would enforce; ff's rank is then set to 1 by `point_rank`,
    so the ff rule holds), a training axis by its type (`tracking.axes`) and its config field's rule
    (`experiments.training.config.check_value`, the rule `TrainConfig.check` applies). `_point` then gives it
    the axis's type."""
    a = axes.axis(name)
    if a.role == axes.ARCHITECTURE:
        try:
            check_axis(name, v, decoding=True)
        except ArchitectureError as e:
            fail(key, e.detail)
        return v
    ok = {int: parsing.is_integer, float: parsing.is_number, str: lambda x: isinstance(x, str)}.get(
        a.type, lambda x: True
    )
    if not ok(v):
        fail(
            key,
            f"expected {a.type.__name__ if a.type is not float else 'a number'} (the type of {a.path}), got {v!r}",
        )
    config.check_value(a.path, v, _AxisFail(fail, key))
    return v


class _AxisFail(Fail):
    """A config field's rule reporting under the spec key of the axis value it checks."""

    def __init__(self, spec_fail: _SpecFail, key: str):
        super().__init__(spec_fail.source)
        self.spec_fail, self.key = spec_fail, key

    def __call__(self, key: str, msg: str) -> None:
        self.spec_fail(self.key, f"{msg} ({key})")


def _grid_axes(slices: dict) -> tuple[str, ...]:
    """The axes of a grid's points: the architecture, the training axes with `always`, and those any
    slice names (a spec that does not name an axis keeps its points, keys and signature)."""
    named = {k for sl in slices.values() if isinstance(sl, dict) for k in sl}
    return tuple(a.name for a in axes.axes() if a.role == axes.ARCHITECTURE or a.always or a.name in named)


def _point(p: dict[str, Any], grid_axes: tuple[str, ...]) -> dict[str, Any]:
    """A product point with ff's rank axis collapsed (`mtpc.names.point_rank`); training axes the
    slice leaves out at their defaults, each value as its axis's type (0 and 0.0 are one point)."""
    p = {k: axes.axis(k).value(p.get(k, axes.axis(k).default)) for k in grid_axes}
    p["rank"] = point_rank(p["circuit"], p["rank"])
    return p


def _expand_grid(
    fail: _SpecFail, space: dict
) -> tuple[tuple[dict[str, Any], ...], dict[str, tuple[str, ...]]]:
    _mapping(fail, space, "space", {"kind", "slices", "full_product"}, {"slices"})
    slices = space["slices"]
    if not isinstance(slices, dict) or not slices:
        fail(
            "space.slices",
            f"expected a non-empty mapping slice_name -> {{{', '.join(axes.names(axes.ARCHITECTURE))}"
            f"[, {', '.join(axes.names(axes.TRAINING))}]}}",
        )
    full = space.get("full_product", False)
    if not isinstance(full, bool):
        fail("space.full_product", f"expected true/false, got {full!r}")
    grid_axes = _grid_axes(slices)
    per_slice: dict[str, dict[str, list]] = {}
    for name, sl in slices.items():
        key = f"space.slices.{name}"
        sl = _mapping(fail, sl, key, set(axes.names()), set(axes.names(axes.ARCHITECTURE)))
        per_slice[str(name)] = {  # an axis the slice leaves out: its default (a training axis)
            p: [_axis_value(fail, p, v, f"{key}.{p}") for v in _values(fail, sl[p], f"{key}.{p}")]
            if p in sl
            else [axes.axis(p).default]
            for p in grid_axes
        }
    if full:
        union = {p: sorted({v for s in per_slice.values() for v in s[p]}, key=str) for p in grid_axes}
        per_slice = {"full": union}
    points: dict[str, dict[str, Any]] = {}
    membership: dict[str, list[str]] = {}
    for sname, vals in per_slice.items():
        for combo in itertools.product(*(vals[p] for p in grid_axes)):
            pt = _point(dict(zip(grid_axes, combo, strict=True)), grid_axes)
            k = grid_key(pt)
            points.setdefault(k, pt)
            if sname not in membership.setdefault(k, []):
                membership[k].append(sname)
    return tuple(points.values()), {k: tuple(v) for k, v in membership.items()}


def _sampler_space(fail: _SpecFail, space: dict) -> SamplerSpace:
    _mapping(fail, space, "space", {"kind", "params", "seed"}, {"kind", "params"})
    kind = fail.choice("space.kind", space["kind"], ("grid",) + SAMPLERS)
    arch = set(
        axes.names(axes.ARCHITECTURE)
    )  # a sampler searches the architecture; training axes stay at their defaults
    params = _mapping(fail, space["params"], "space.params", arch, arch)
    out: dict[str, dict[str, Any]] = {}
    for name, d in params.items():
        key = f"space.params.{name}"
        d = _mapping(fail, d, key, {"choices", "low", "high", "log"})
        if "choices" in d:
            if len(d) != 1:
                fail(key, "give either `choices` or `low`/`high` (+ `log`), not both")
            out[name] = {
                "choices": [
                    _axis_value(fail, name, v, f"{key}.choices")
                    for v in _values(fail, d["choices"], f"{key}.choices")
                ]
            }
        else:
            if name == "circuit":
                fail(key, "circuit is categorical: give `choices`")
            if "low" not in d or "high" not in d:
                fail(key, "expected `choices`, or `low` and `high`")
            lo = _axis_value(fail, name, d["low"], f"{key}.low")
            hi = _axis_value(fail, name, d["high"], f"{key}.high")
            if lo > hi:
                fail(key, f"low {lo} > high {hi}")
            log = d.get("log", False)
            if not isinstance(log, bool):
                fail(f"{key}.log", f"expected true/false, got {log!r}")
            out[name] = {"low": lo, "high": hi, "log": log}
    seed = fail.integer("space.seed", space.get("seed", 0), 0)
    return SamplerSpace(kind=kind, params=out, seed=seed)


def storage_url(raw: str, base: Path) -> str:
    """Normalise a storage setting: a URL (`scheme://`) is kept; anything else is a journal file
    path (`journal:` prefix optional), made absolute against `base`."""
    if "://" in raw:
        return raw
    p = raw[len("journal:") :] if raw.startswith("journal:") else raw
    path = Path(p).expanduser()
    if not path.is_absolute():
        path = base / path
    return f"journal:{path.resolve()}"


def load_spec(
    path: str | Path, *, env: dict[str, str] | None = None, overrides: dict[str, Any] | None = None
) -> SweepSpec:
    """Read and validate a sweep spec. `overrides` (dotted keys -> values, `experiments.plumbing.parsing.apply_overrides`)
    apply before validation; `env` defaults to os.environ (MLFLOW_TRACKING_URI / MTPC_OPTUNA_STORAGE override the file)."""
    path = Path(path)
    env = dict(os.environ) if env is None else env
    if not path.is_file():
        raise SpecError(f"{path}: sweep spec not found")
    try:
        raw = read_yaml(path, what="sweep spec")
    except ValueError as e:
        raise SpecError(str(e)) from None
    if raw is None:  # an empty file, or comments only
        raise SpecError(
            f"{path}: the sweep spec is empty; expected a YAML mapping with at least `study`, `space` "
            "and `objectives` (docs/sweeps.md)"
        )
    if not isinstance(raw, dict):
        raise SpecError(
            f"{path}: expected a YAML mapping of spec keys (study, space, objectives, ...), "
            f"got a {type(raw).__name__}"
        )
    if overrides:
        raw = apply_overrides(raw, overrides, merge=False)
    return parse_spec(raw, path, env=env)


def parse_sets(pairs: list[str]) -> dict[str, Any]:
    """`--set KEY=VALUE` strings -> {dotted key: YAML value} (SpecError on a bad flag)."""
    try:
        return parsing.parse_sets(pairs)
    except ValueError as e:
        raise SpecError(str(e)) from None


def train_config(train: Any, path: Path) -> TrainConfig:
    """The spec's `train` section as a TrainConfig: `config` (a shipped name or a YAML path, default
    debug) with the section's other keys as overrides. Types are checked here (the trainer section
    against Lightning's signature, and the values, when `--init` / `--check` validate every point)."""
    if train is None:
        train = {}
    if not isinstance(train, dict):
        raise SpecError(
            f"{path}: key 'train': expected a mapping (the base training config), got {type(train).__name__}"
        )
    overrides = dict(train)
    base = overrides.pop("config", "debug")
    try:
        return config.load_config(base, overrides, trainer_types=False)
    except ValueError as e:
        raise SpecError(f"{path}: key 'train': {e}") from None


def parse_spec(raw: Any, path: Path, *, env: dict[str, str]) -> SweepSpec:
    fail = _SpecFail(str(path))
    if raw is None:
        raw = {}
    check_class_paths(
        raw, fail
    )  # before any section is parsed: a class outside the allow-list is never imported
    top = parse_section(SpecFile, raw, "", fail)
    study = fail.text("study", top.study)
    if not _NAME_RE.match(study):
        fail("study", f"{study!r}: use letters, digits, '_', '.', '-'")
    kind = fail.choice("objective", top.objective, OBJECTIVE_KINDS)
    out_dir = Path(top.output_dir or f"runs/{study}").expanduser()
    if not out_dir.is_absolute():
        out_dir = Path.cwd() / out_dir
    out_dir = out_dir.resolve()

    storage_raw = env.get(STORAGE_ENV) or top.storage or str(out_dir / "optuna.journal")
    storage = storage_url(fail.text("storage", storage_raw), Path.cwd())

    ml = parse_section(MlflowSettings, top.mlflow, "mlflow", fail)
    configured = None if ml.tracking_uri is None else fail.text("mlflow.tracking_uri", ml.tracking_uri)
    tracking = resolve_uri(configured, env=env, configured_source=f"{path}: mlflow.tracking_uri").uri
    experiment = fail.text("mlflow.experiment", ml.experiment or study)

    space = top.space
    if not isinstance(space, dict):
        fail("space", "expected a mapping")
    grid = None
    slices: dict[str, tuple[str, ...]] = {}
    sampler = None
    if space.get("kind", "grid") == "grid":
        grid, slices = _expand_grid(fail, space)
        n_trials = len(grid)
        if top.n_trials is not None:
            n = fail.integer("n_trials", top.n_trials, 1)
            if n != len(grid):
                fail(
                    "n_trials",
                    f"{n} != {len(grid)} grid points; a grid runs every point once (omit n_trials)",
                )
    else:
        sampler = _sampler_space(fail, space)
        if top.n_trials is None:
            fail("n_trials", "missing (required with a sampler space)")
        n_trials = fail.integer("n_trials", top.n_trials, 1, 100000)

    objectives = tuple(
        parse_section(Objective, o, f"objectives[{i}]", fail).check(fail, f"objectives[{i}]")
        for i, o in enumerate(_values(fail, top.objectives, "objectives"))
    )
    if len({o.label for o in objectives}) != len(objectives):
        fail("objectives", "the same metric/mode appears twice")

    evs = parse_section(EvalConfig, top.eval, "eval", fail).check(fail)
    slurm = parse_section(SlurmSettings, top.slurm, "slurm", fail).check(fail)
    own = (top.train or {}).get("trainer") if isinstance(top.train, dict) else None
    train = trial_resources(
        train_config(top.train, path), slurm, fail, own if isinstance(own, dict) else None
    )
    for o in objectives:
        if o.mode is not None and o.mode not in evs.modes:
            fail("objectives", f"objective mode {o.mode!r} is not evaluated (eval.modes = {list(evs.modes)})")
    if evs.extra_token == "drop" and train.model.known_byte:
        fail(
            "eval.extra_token",
            "'drop' cannot decode with train.model.known_byte: true (the head needs the kept "
            "byte c); expected keep",
        )
    return SweepSpec(
        path=path.resolve(),
        study=study,
        trial_kind=kind,
        output_dir=out_dir,
        storage=storage,
        tracking_uri=tracking,
        experiment=experiment,
        train=train,
        objectives=objectives,
        eval=evs,
        slurm=slurm,
        fixture=parse_section(FixtureSettings, top.fixture, "fixture", fail).check(fail),
        grid=grid,
        grid_slices=slices,
        sampler=sampler,
        n_trials=n_trials,
        max_retries=fail.integer("max_retries", top.max_retries, 0, 100),
        stale_after_s=fail.number("stale_after_s", top.stale_after_s, 10.0, 1e7),
    )
