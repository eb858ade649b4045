"""The sweep axes, declared once: a sweep point is a set of `TrainConfig` overrides, one per axis.

`AXES` holds one `Axis` row per axis: its param name (the key of a grid point, the Optuna param and
the MLflow param of a trial's runs), the config path it sets (an `experiments.plumbing.parsing.apply_overrides`
key: `train_seed` sets `seed_everything`), its role, its grid-key tag, its display label, its type and
(a training axis) its default and its mark in a plot's point labels. Everything an axis touches is derived from the rows, read when called:

- the spec's grid (sweeps/spec.py: the slice keys, each value checked, the point's values) and the
  Optuna params and choices of a trial (sweeps/study.py);
- the trial's config (`experiments.training.config.apply_point`: the paths, through the one override rule;
  `TrainConfig.check` validates), its run name (`default_run_name`) and child-run params
  (`experiments.training.trial.training_axes`); a multi-rank trial's child reads them back from its config;
- the grid key (`grid_key`: checkpoint directories, trial runs, evaluation run names);
- the analysis's grouping keys and dtypes (analysis/load.py, analysis/aggregate.py), the table
  columns (analysis/paper_tables.py) and the Pareto figure's point labels (analysis/pareto_plot.py).

Roles: an *architecture* axis is always in the grid key, required in every grid slice and searched
by samplers (its bounds are the library's, `mtpc.names.check_axis`); a *training* axis defaults to
`default` (left out of the grid key there, so points that do not vary it keep their keys) and is
fixed at its default in sampler spaces. A training axis with `always` is in every grid point (and
so in its Optuna params) even where a spec does not name it (kl_beta and train_seed: stored studies
were enqueued with them); any other appears in the points, Optuna params and signature only of a
spec that names it, so adding a row changes no existing study, key or run name.

Adding an axis (any scalar `TrainConfig` field) is one row here; its values are checked by the
field's rule in `experiments.training.config` (`check_value`), or by its type alone where the field has none.
Names only (no MLflow, no torch); this module imports nothing of the suite.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ARCHITECTURE = "architecture"
TRAINING = "training"
ROLES: tuple[str, ...] = (ARCHITECTURE, TRAINING)


class UnknownAxis(ValueError):
    """A point names a param that is no sweep axis (one line, naming the known axes)."""


@dataclass(frozen=True)
class Axis:
    """One sweep axis (a row of `AXES`)."""

    name: str
    """the param: the key of a grid point, the Optuna param, the MLflow param of a trial's runs"""
    path: str
    """the TrainConfig field it sets, as an override key (`model.rank`, `seed_everything`)"""
    role: str
    """architecture (always in the grid key, required, searched by samplers) | training"""
    tag: str
    """its prefix in a grid key (`cp-r8-n16-k0-kl0.5-s1`; the circuit has none)"""
    label: str
    """its short name in tables and plots"""
    type: type
    """int | float | str: a point's values (float axes: 0 and 0.0 are one point) and the dtype of the
    param the analysis reads back"""
    default: Any = None
    """a training axis: the value of a point that leaves it out, left out of the grid key"""
    always: bool = False
    """a training axis: in every grid point (and its Optuna params) even where the spec does not name it"""
    mark: str | None = None
    """a training axis: its prefix in a plotted point's label off its default (`β0.5`, `s1`); None: `label`"""

    def at_default(self, v: Any) -> bool:
        """`v` is this axis's default (`0`, `0.0` and `"0"` alike)."""
        return _same(v, self.default)

    def shown(self, v: Any) -> str:
        """`v` as a plot label shows it (a float axis `0.5`, an int axis `1`)."""
        if self.type is float:
            return f"{float(v):g}"
        return str(int(float(v))) if self.type is int else str(v)

    def value(self, v: Any) -> Any:
        """`v` as the axis's type (a float axis: 0 -> 0.0); None stays None."""
        return float(v) if self.type is float and v is not None and not isinstance(v, bool) else v


#: the sweep axes, in grid-key order (the architecture first). A new axis is one row; a training row
#: placed anywhere after the architecture keeps every existing key (it is left out at its default).
AXES: tuple[Axis, ...] = (
    Axis("circuit", "model.circuit", ARCHITECTURE, "", "circuit", str),
    Axis("rank", "model.rank", ARCHITECTURE, "r", "r", int),
    Axis("window", "model.window", ARCHITECTURE, "n", "n", int),
    Axis("lora_depth", "model.lora_depth", ARCHITECTURE, "k", "k", int),
    # weight of the distillation term (0: cross-entropy only)
    Axis("kl_beta", "model.kl_beta", TRAINING, "kl", "β", float, 0.0, always=True),
    # temperature of the teacher in the KL term
    Axis("kl_temperature", "model.kl_temperature", TRAINING, "T", "T_kl", float, 1.0),
    # the head's training seed (the evaluation's `seed` is another param)
    Axis("train_seed", "seed_everything", TRAINING, "s", "seed", int, 0, always=True, mark="s"),
)


def axes(role: str | None = None) -> tuple[Axis, ...]:
    """The rows of `AXES` (read now, so a row added at run time counts), of one role if given."""
    return tuple(a for a in AXES if role is None or a.role == role)


def names(role: str | None = None) -> tuple[str, ...]:
    """The param names of the axes (of one role), in grid-key order."""
    return tuple(a.name for a in axes(role))


def axis(name: str) -> Axis:
    """The row of param `name`; UnknownAxis (one line) when there is none."""
    for a in AXES:
        if a.name == name:
            return a
    raise UnknownAxis(f"unknown sweep axis {name!r}; expected one of {sorted(names())} (tracking/axes.py)")


def check_names(point: dict[str, Any]) -> None:
    """UnknownAxis for the first key of `point` that is no axis."""
    for name in point:
        axis(name)


def defaults() -> dict[str, Any]:
    """The training axes with their defaults."""
    return {a.name: a.default for a in axes(TRAINING)}


def _same(value: Any, default: Any) -> bool:
    try:
        return float(value) == float(default)
    except (TypeError, ValueError):
        return str(value) == str(default)


def grid_key(point: dict[str, Any]) -> str:
    """A short stable name for a grid point, e.g. `cp-r8-n16-k0` (`-kl0.5-s1` for kl_beta 0.5,
    train_seed 1): each axis's tag and value in `AXES` order; a training axis at its default (or
    absent) is left out, and an architecture axis the method does not have (`evabyte-mtp`'s rank:
    None). Checkpoint directories, the parent run of a trial and the names of its evaluation runs.
    Values may be str (as MLflow stores params) or numbers alike."""
    parts = []
    for a in AXES:
        if a.role == TRAINING:
            value = point.get(a.name, a.default)
            if value is None or _same(value, a.default):
                continue
        else:
            value = point[a.name]
            if value is None or value == "None":  # an axis the method lacks (EvaByte's own decoding: no rank)
                continue
        if isinstance(value, float) or a.type is float:
            value = f"{float(value):g}"  # 0.5 and "0.5" alike
        parts.append(f"{a.tag}{value}")
    return "-".join(parts)
