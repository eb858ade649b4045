"""Sweep specs: load a YAML file, validate every key before any work starts, expand the grid.

A spec names the study, the objective implementation (`trial` = train + evaluate, `fixture` = a
fast deterministic stand-in for tests), the base training config, the space (grid slices, or an
Optuna sampler with bounds), the objectives and their directions, the Optuna storage, the MLflow
tracking URI and experiment, the evaluation settings and sbatch resources. See docs/sweeps.md for
the schema. Errors are `SpecError` (a `ValueError`) naming the file and the dotted key.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mtpc.names import (
    DECODE_MODES,
    EOS_MODES,
    EVAL_METRICS,
    EXTRA_TOKEN_OPTIONS,
    GRID_PARAMS,
    SWEEP_AXES,
    TRAIN_AXES,
    ArchitectureError,
    check_architecture,
    check_axis,
    grid_key,
    point_rank,
)
from tracking.store import resolve_uri

OBJECTIVE_KINDS = ("trial", "fixture")
DIRECTIONS = ("maximize", "minimize")
SAMPLERS = ("tpe", "random")
STORAGE_ENV = "MTPC_OPTUNA_STORAGE"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class SpecError(ValueError):
    """A sweep spec is invalid: the message names the file, the key and what was expected."""


@dataclass(frozen=True)
class Objective:
    metric: str  # an EVAL_METRICS name: averaged over the trial's stored evaluation runs
    direction: str  # maximize | minimize
    mode: str | None = None  # average only over child runs of this decoding mode (None: all)

    @property
    def label(self) -> str:
        return f"{self.mode}/{self.metric}" if self.mode else self.metric


@dataclass(frozen=True)
class EvalSettings:
    modes: tuple[str, ...] = DECODE_MODES
    prompts: str = "heldout"  # `heldout` (the corpus' held-out prompts) or a .jsonl file
    sets: int = 1  # prompt sets per mode: one child run each (named by the evaluator)
    dev_sets: int = 0  # extra, disjoint development sets ("dev0", ...): for choosing settings, never reported
    n_prompts: int = 8  # prompts per set
    max_new_tokens: int = 64
    extra_token: str = "keep"
    temperatures: tuple[float, ...] = (1.0,)  # sampling temperatures, each its own child runs (greedy runs once)
    top_p: float = 1.0
    seed: int = 0  # the evaluation's sampling seed (prompt i uses seed + i); the training seed is train_seed
    eos: tuple[str, ...] = ("banned",)  # EOS treatments evaluated: banned (equal lengths) and/or allowed
    stp: bool = True  # run the plain model beside every head (speedup_vs_stp); false halves the evaluation


@dataclass(frozen=True)
class SlurmSettings:
    """Resources used by `python -m sweeps.run SPEC --submit` (plain `sbatch` uses the script's)."""

    tasks: int = 4  # array size
    cpus_per_task: int = 1
    mem: str = "2G"
    time: str = "04:00:00"
    partition: str | None = None
    gpus: int = 0
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class FixtureSettings:
    """The fixture objective: metrics are a deterministic function of the grid point."""

    steps: int = 1  # "training" steps, each checkpointed
    step_seconds: float = 0.0  # sleep per step (lets tests cancel or pre-empt a running trial)
    fail: tuple[dict[str, Any], ...] = ()  # grid points (partial dicts) whose trial raises


@dataclass(frozen=True)
class SamplerSpace:
    kind: str  # tpe | random
    params: dict[str, dict[str, Any]]  # name -> {choices: [...]} or {low, high, log}
    seed: int = 0


@dataclass(frozen=True)
class SweepSpec:
    path: Path
    study: str
    objective_kind: str
    output_dir: Path
    storage: str  # "journal:<abs path>" or an RDB URL
    tracking_uri: str
    experiment: str
    train: dict[str, Any]
    objectives: tuple[Objective, ...]
    eval: EvalSettings
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
# validation helpers: every check names file + dotted key


class _Ctx:
    def __init__(self, path: Path):
        self.path = path

    def err(self, key: str, msg: str) -> SpecError:
        return SpecError(f"{self.path}: key '{key}': {msg}")

    def keys(self, d: Any, key: str, allowed: set[str], required: set[str] = frozenset()) -> dict:
        if d is None:
            d = {}
        if not isinstance(d, dict):
            raise self.err(key, f"expected a mapping, got {type(d).__name__}")
        for k in d:
            if k not in allowed:
                where = f"{key}.{k}" if key else str(k)
                raise self.err(where, f"unknown key; expected one of {sorted(allowed)}")
        for k in required:
            if k not in d:
                raise self.err(f"{key}.{k}" if key else k, "missing (required)")
        return d

    def int_(self, v: Any, key: str, lo: int | None = None, hi: int | None = None) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.err(key, f"expected an integer, got {v!r}")
        if lo is not None and v < lo or hi is not None and v > hi:
            raise self.err(key, f"{v} out of range; expected {lo if lo is not None else '-inf'}..{hi if hi is not None else 'inf'}")
        return v

    def float_(self, v: Any, key: str, lo: float | None = None, hi: float | None = None) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self.err(key, f"expected a number, got {v!r}")
        v = float(v)
        if lo is not None and v < lo or hi is not None and v > hi:
            raise self.err(key, f"{v} out of range; expected {lo}..{hi}")
        return v

    def choice(self, v: Any, key: str, choices: tuple) -> Any:
        if v not in choices:
            raise self.err(key, f"{v!r} is not one of {list(choices)}")
        return v

    def str_(self, v: Any, key: str) -> str:
        if not isinstance(v, str) or not v:
            raise self.err(key, f"expected a non-empty string, got {v!r}")
        return v

    def list_(self, v: Any, key: str) -> list:
        if not isinstance(v, list):
            v = [v]
        if not v:
            raise self.err(key, "expected a non-empty list")
        return v


def _check_grid_value(ctx: _Ctx, name: str, v: Any, key: str) -> Any:
    """One axis value, checked against `mtpc.names` (the bounds a trial's head would enforce)."""
    try:
        check_axis(name, v, decoding=True)
    except ArchitectureError as e:
        raise ctx.err(key, e.detail) from None
    return v


def _normalise_point(p: dict[str, Any], ctx: _Ctx, key: str) -> dict[str, Any]:
    """A product point with ff's rank axis collapsed (`mtpc.names.point_rank`), checked as the head
    checks it; training axes default (TRAIN_AXES), kl_beta as a float (so 0 and 0.0 are one point)."""
    p = {k: p.get(k, TRAIN_AXES.get(k)) for k in SWEEP_AXES}
    p["rank"] = point_rank(p["circuit"], p["rank"])
    p["kl_beta"] = float(p["kl_beta"])
    try:
        check_architecture(**{k: p[k] for k in GRID_PARAMS}, decoding=True)
    except ArchitectureError as e:
        raise ctx.err(f"{key}.{e.key}", e.detail) from None
    return p


def _expand_grid(
    ctx: _Ctx, space: dict
) -> tuple[tuple[dict[str, Any], ...], dict[str, tuple[str, ...]]]:
    ctx.keys(space, "space", {"kind", "slices", "full_product"}, {"slices"})
    slices = space["slices"]
    if not isinstance(slices, dict) or not slices:
        raise ctx.err("space.slices", "expected a non-empty mapping slice_name -> {circuit, rank, window, lora_depth"
                      "[, kl_beta, train_seed]}")
    full = space.get("full_product", False)
    if not isinstance(full, bool):
        raise ctx.err("space.full_product", f"expected true/false, got {full!r}")
    per_slice: dict[str, dict[str, list]] = {}
    for name, sl in slices.items():
        key = f"space.slices.{name}"
        ctx.keys(sl, key, set(SWEEP_AXES), set(GRID_PARAMS))
        vals = {}
        for p in SWEEP_AXES:
            given = sl.get(p, TRAIN_AXES.get(p))
            vals[p] = [_check_grid_value(ctx, p, v, f"{key}.{p}") for v in ctx.list_(given, f"{key}.{p}")]
        per_slice[str(name)] = vals
    if full:
        union = {p: sorted({v for s in per_slice.values() for v in s[p]}, key=str) for p in SWEEP_AXES}
        per_slice = {"full": union}
    points: dict[str, dict[str, Any]] = {}
    membership: dict[str, list[str]] = {}
    for sname, vals in per_slice.items():
        for combo in itertools.product(*(vals[p] for p in SWEEP_AXES)):
            key = "space" if full else f"space.slices.{sname}"
            pt = _normalise_point(dict(zip(SWEEP_AXES, combo, strict=True)), ctx, key)
            k = grid_key(pt)
            points.setdefault(k, pt)
            if sname not in membership.setdefault(k, []):
                membership[k].append(sname)
    return tuple(points.values()), {k: tuple(v) for k, v in membership.items()}


def _sampler_space(ctx: _Ctx, space: dict) -> SamplerSpace:
    ctx.keys(space, "space", {"kind", "params", "seed"}, {"kind", "params"})
    kind = ctx.choice(space["kind"], "space.kind", ("grid",) + SAMPLERS)
    params = ctx.keys(space["params"], "space.params", set(GRID_PARAMS), set(GRID_PARAMS))
    out: dict[str, dict[str, Any]] = {}
    for name, d in params.items():
        key = f"space.params.{name}"
        d = ctx.keys(d, key, {"choices", "low", "high", "log"})
        if "choices" in d:
            if len(d) != 1:
                raise ctx.err(key, "give either `choices` or `low`/`high` (+ `log`), not both")
            out[name] = {"choices": [_check_grid_value(ctx, name, v, f"{key}.choices") for v in ctx.list_(d["choices"], f"{key}.choices")]}
        else:
            if name == "circuit":
                raise ctx.err(key, "circuit is categorical: give `choices`")
            if "low" not in d or "high" not in d:
                raise ctx.err(key, "expected `choices`, or `low` and `high`")
            lo = _check_grid_value(ctx, name, d["low"], f"{key}.low")
            hi = _check_grid_value(ctx, name, d["high"], f"{key}.high")
            if lo > hi:
                raise ctx.err(key, f"low {lo} > high {hi}")
            log = d.get("log", False)
            if not isinstance(log, bool):
                raise ctx.err(f"{key}.log", f"expected true/false, got {log!r}")
            out[name] = {"low": lo, "high": hi, "log": log}
    seed = ctx.int_(space.get("seed", 0), "space.seed", 0)
    return SamplerSpace(kind=kind, params=out, seed=seed)


_TOP_KEYS = {
    "study", "objective", "output_dir", "storage", "mlflow", "train", "space", "objectives",
    "n_trials", "eval", "slurm", "fixture", "max_retries", "stale_after_s",
}


def storage_url(raw: str, base: Path) -> str:
    """Normalise a storage setting: a URL (`scheme://`) is kept; anything else is a journal file
    path (`journal:` prefix optional), made absolute against `base`."""
    if "://" in raw:
        return raw
    p = raw[len("journal:"):] if raw.startswith("journal:") else raw
    path = Path(p).expanduser()
    if not path.is_absolute():
        path = base / path
    return f"journal:{path.resolve()}"


def load_spec(path: str | Path, *, env: dict[str, str] | None = None, overrides: dict[str, Any] | None = None) -> SweepSpec:
    """Read and validate a sweep spec. `overrides` (dotted keys -> values) apply before validation;
    `env` defaults to os.environ (MLFLOW_TRACKING_URI / MTPC_OPTUNA_STORAGE override the file)."""
    path = Path(path)
    env = dict(os.environ) if env is None else env
    if not path.is_file():
        raise SpecError(f"{path}: sweep spec not found")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise SpecError(f"{path}: not valid YAML: {e}") from e
    if overrides:
        raw = apply_overrides(raw or {}, overrides)
    return parse_spec(raw, path, env=env)


def parse_sets(pairs: list[str]) -> dict[str, Any]:
    """`--set KEY=VALUE` strings -> {dotted key: YAML value}."""
    out: dict[str, Any] = {}
    for kv in pairs:
        if "=" not in kv:
            raise SpecError(f"--set {kv!r}: expected KEY=VALUE")
        k, v = kv.split("=", 1)
        out[k] = yaml.safe_load(v)
    return out


def apply_overrides(raw: dict, overrides: dict[str, Any]) -> dict:
    """Set dotted keys (`train.backbone`, `eval.n_prompts`) in a copy of the raw spec."""
    raw = json.loads(json.dumps(raw))
    for dotted, value in overrides.items():
        d = raw
        parts = dotted.split(".")
        for p in parts[:-1]:
            d = d.setdefault(p, {})
        d[parts[-1]] = value
    return raw


def parse_spec(raw: Any, path: Path, *, env: dict[str, str]) -> SweepSpec:
    ctx = _Ctx(path)
    raw = ctx.keys(raw, "", _TOP_KEYS, {"study", "space", "objectives"})
    study = ctx.str_(raw["study"], "study")
    if not _NAME_RE.match(study):
        raise ctx.err("study", f"{study!r}: use letters, digits, '_', '.', '-'")
    kind = ctx.choice(raw.get("objective", "trial"), "objective", OBJECTIVE_KINDS)
    out_dir = Path(raw.get("output_dir", f"runs/{study}")).expanduser()
    if not out_dir.is_absolute():
        out_dir = Path.cwd() / out_dir
    out_dir = out_dir.resolve()

    storage_raw = env.get(STORAGE_ENV) or raw.get("storage") or str(out_dir / "optuna.journal")
    storage = storage_url(ctx.str_(storage_raw, "storage"), Path.cwd())

    ml = ctx.keys(raw.get("mlflow"), "mlflow", {"tracking_uri", "experiment"})
    configured = None if ml.get("tracking_uri") is None else ctx.str_(ml["tracking_uri"], "mlflow.tracking_uri")
    tracking = resolve_uri(configured, env=env, configured_source=f"{path}: mlflow.tracking_uri").uri
    experiment = ctx.str_(ml.get("experiment", study), "mlflow.experiment")

    train = raw.get("train") or {}
    if not isinstance(train, dict):
        raise ctx.err("train", f"expected a mapping (the base training config), got {type(train).__name__}")

    space = raw["space"]
    if not isinstance(space, dict):
        raise ctx.err("space", "expected a mapping")
    skind = space.get("kind", "grid")
    grid = None
    slices: dict[str, tuple[str, ...]] = {}
    sampler = None
    if skind == "grid":
        grid, slices = _expand_grid(ctx, space)
        n_trials = len(grid)
        if "n_trials" in raw and raw["n_trials"] is not None:
            n = ctx.int_(raw["n_trials"], "n_trials", 1)
            if n != len(grid):
                raise ctx.err("n_trials", f"{n} != {len(grid)} grid points; a grid runs every point once (omit n_trials)")
    else:
        sampler = _sampler_space(ctx, space)
        if "n_trials" not in raw:
            raise ctx.err("n_trials", "missing (required with a sampler space)")
        n_trials = ctx.int_(raw["n_trials"], "n_trials", 1, 100000)

    objs = ctx.list_(raw["objectives"], "objectives")
    objectives = []
    for i, o in enumerate(objs):
        key = f"objectives[{i}]"
        o = ctx.keys(o, key, {"metric", "direction", "mode"}, {"metric", "direction"})
        objectives.append(
            Objective(
                metric=ctx.choice(o["metric"], f"{key}.metric", EVAL_METRICS),
                direction=ctx.choice(o["direction"], f"{key}.direction", DIRECTIONS),
                mode=None if o.get("mode") is None else ctx.choice(o["mode"], f"{key}.mode", DECODE_MODES),
            )
        )
    if len({o.label for o in objectives}) != len(objectives):
        raise ctx.err("objectives", "the same metric/mode appears twice")

    ev = ctx.keys(raw.get("eval"), "eval", set(EvalSettings.__dataclass_fields__))
    d = EvalSettings()
    modes = tuple(ctx.choice(m, "eval.modes", DECODE_MODES) for m in ctx.list_(ev.get("modes", list(d.modes)), "eval.modes"))
    for o in objectives:
        if o.mode is not None and o.mode not in modes:
            raise ctx.err("objectives", f"objective mode {o.mode!r} is not evaluated (eval.modes = {list(modes)})")
    evs = EvalSettings(
        modes=modes,
        prompts=ctx.str_(ev.get("prompts", d.prompts), "eval.prompts"),
        sets=ctx.int_(ev.get("sets", d.sets), "eval.sets", 1, 1000),
        dev_sets=ctx.int_(ev.get("dev_sets", d.dev_sets), "eval.dev_sets", 0, 1000),
        n_prompts=ctx.int_(ev.get("n_prompts", d.n_prompts), "eval.n_prompts", 1, 100000),
        max_new_tokens=ctx.int_(ev.get("max_new_tokens", d.max_new_tokens), "eval.max_new_tokens", 1, 1_000_000),
        extra_token=ctx.choice(ev.get("extra_token", d.extra_token), "eval.extra_token", EXTRA_TOKEN_OPTIONS),
        temperatures=tuple(ctx.float_(t, "eval.temperatures", 1e-6, 100.0)
                           for t in ctx.list_(ev.get("temperatures", list(d.temperatures)), "eval.temperatures")),
        top_p=ctx.float_(ev.get("top_p", d.top_p), "eval.top_p", 1e-6, 1.0),
        seed=ctx.int_(ev.get("seed", d.seed), "eval.seed", 0),
        eos=tuple(ctx.choice(x, "eval.eos", EOS_MODES) for x in ctx.list_(ev.get("eos", list(d.eos)), "eval.eos")),
        stp=ctx.choice(ev.get("stp", d.stp), "eval.stp", (True, False)),
    )
    for name in ("temperatures", "eos"):
        values = getattr(evs, name)
        if len(set(values)) != len(values):
            raise ctx.err(f"eval.{name}", f"{list(values)} names a value twice")

    sl = ctx.keys(raw.get("slurm"), "slurm", set(SlurmSettings.__dataclass_fields__))
    ds = SlurmSettings()
    slurm = SlurmSettings(
        tasks=ctx.int_(sl.get("tasks", ds.tasks), "slurm.tasks", 1, 100000),
        cpus_per_task=ctx.int_(sl.get("cpus_per_task", ds.cpus_per_task), "slurm.cpus_per_task", 1, 4096),
        mem=ctx.str_(str(sl.get("mem", ds.mem)), "slurm.mem"),
        time=ctx.str_(str(sl.get("time", ds.time)), "slurm.time"),
        partition=sl.get("partition"),
        gpus=ctx.int_(sl.get("gpus", ds.gpus), "slurm.gpus", 0, 64),
        extra_args=tuple(str(a) for a in sl.get("extra_args", ())),
    )

    fx = ctx.keys(raw.get("fixture"), "fixture", {"steps", "step_seconds", "fail"})
    fails = []
    for i, f in enumerate(fx.get("fail", []) or []):
        fails.append(dict(ctx.keys(f, f"fixture.fail[{i}]", set(SWEEP_AXES))))
    fixture = FixtureSettings(
        steps=ctx.int_(fx.get("steps", 1), "fixture.steps", 1, 100000),
        step_seconds=ctx.float_(fx.get("step_seconds", 0.0), "fixture.step_seconds", 0.0, 3600.0),
        fail=tuple(fails),
    )
    return SweepSpec(
        path=path.resolve(),
        study=study,
        objective_kind=kind,
        output_dir=out_dir,
        storage=storage,
        tracking_uri=tracking,
        experiment=experiment,
        train=dict(train),
        objectives=tuple(objectives),
        eval=evs,
        slurm=slurm,
        fixture=fixture,
        grid=grid,
        grid_slices=slices,
        sampler=sampler,
        n_trials=n_trials,
        max_retries=ctx.int_(raw.get("max_retries", 1), "max_retries", 0, 100),
        stale_after_s=ctx.float_(raw.get("stale_after_s", 900.0), "stale_after_s", 10.0, 1e7),
    )
