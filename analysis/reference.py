"""Reference points of the Pareto figures: a head measured outside the sweep (the demo's shipped
default head) drawn beside the sweep's configurations as a labelled marker. A reference is never on
the front, in a table or in summary.csv.

A reference file is JSON (`write_reference`; the demo writes `<out>/shipped_head.json`):

    {"format": "mtpc-reference/1", "label": "shipped btree-n4-r16-known",
     "about": "how it was measured", "source": {what the writer keys it by}, "evaluation": <one evaluate_heads result>}

`evaluation` is what `experiments.evaluation.decoding.evaluate_heads` returns for one head: the
function every sweep trial evaluates its head with. `read_reference` turns its runs into the rows
`analysis.load` builds from MLflow (params as MLflow stores them, `log_evaluation_to_mlflow`'s
selection; metrics as `tracking.log_evaluation` stores them), and `reference_points` aggregates them
as the sweep's runs are (`aggregate`, `split_settings`: mean over prompt sets; in an offline setting
the derived throughput). So the point sits where the head would sit as a sweep configuration.

A reference is drawn only in a setting equal to one it was measured in (`analysis.aggregate.Setting`:
backbone, mode, temperature, top_p, EOS, extra token, hardware with its thread count and engine, and
acceptance method) and on the same prompt sets (by name); otherwise it is left out with a note, never
placed among points it cannot be compared with.

Leaves out: measuring (sweeps/demo.py `shipped_reference`), drawing (analysis/pareto_plot.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pandas as pd

from analysis.aggregate import Setting, aggregate, split_settings
from analysis.filters import Filters, apply_filters
from analysis.load import AnalysisError, SkippedRun, records_to_frame, run_record
from tracking.runs import param_str
from tracking.schema import ACCEPTANCE_PREFIX, EVAL_PARAMS

FORMAT = "mtpc-reference/1"


@dataclass(frozen=True)
class ReferencePoint:
    """One reference head in one setting, in the units the setting's points are placed by."""

    label: str
    """the legend entry (the demo's: shipped btree-n4-r16-known)"""
    text: str
    """beside the marker: n/r/k, as the sweep's points"""
    mu_acc: float
    """accepted drafted bytes per cycle, mean over prompt sets"""
    mu_acc_std: float
    """std over prompt sets (NaN: one set)"""
    mu_lat: float
    """seconds per cycle, mean over prompt sets"""
    mu_lat_std: float
    throughput: float
    """bytes/s as the setting's points use it: the logged throughput (offline: the derived one)"""
    prompt_sets: str = ""
    """comma-joined prompt-set names it was measured on"""


@dataclass(frozen=True)
class Reference:
    """A reference file as read: its label, where it came from, its evaluation runs as load's rows."""

    label: str
    path: Path
    runs: pd.DataFrame


def reference_record(
    label: str, evaluation: dict[str, Any], about: str, source: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The JSON-able content of a reference file (the module docstring's layout); `source`: what
    the writer recognises its own file by (the demo: head, its files' digests, the evaluation)."""
    return {
        "format": FORMAT,
        "label": label,
        "about": about,
        "source": source or {},
        "evaluation": evaluation,
    }


def write_reference(
    path: Path, label: str, evaluation: dict[str, Any], about: str, source: dict[str, Any] | None = None
) -> Path:
    """Write a reference file (atomically: a reader never sees half of it); returns `path`."""
    from mtpc.atomic import write_json

    _records(evaluation, label, path)  # refuse what read_reference would refuse, before writing
    write_json(path, reference_record(label, evaluation, about, source), indent=2)
    return path


def _records(evaluation: Any, label: str, path: Path) -> list[dict[str, Any]]:
    """The evaluation's runs as `run_record` rows, params and metrics stored as
    `log_evaluation_to_mlflow` + `tracking.log_evaluation` store them; ValueError naming `path`."""
    runs = evaluation.get("runs") if isinstance(evaluation, dict) else None
    if not isinstance(runs, list) or not runs or not all(isinstance(r, dict) for r in runs):
        raise ValueError(
            f"{path}: 'evaluation': expected an evaluate_heads result with a non-empty 'runs' list"
        )
    heads = sorted({str(r.get("head")) for r in runs})
    if len(heads) != 1:
        raise ValueError(f"{path}: 'evaluation' holds heads {heads}; a reference file holds one head")
    records = []
    for i, r in enumerate(runs):
        params = {}
        for k in EVAL_PARAMS:
            if k == "hardware":
                params[k] = evaluation.get("hardware")
            elif k == "acceptance_method":
                params[k] = r.get(k, "online")
            else:
                params[k] = r.get(k)
        metrics = r.get("metrics")
        if not isinstance(metrics, dict):
            raise ValueError(f"{path}: evaluation.runs[{i}]: expected a 'metrics' object")
        scalars = {
            k: float(v)
            for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        }
        for j, a in enumerate(metrics.get("per_position_acceptance") or [], 1):
            if a is not None:
                scalars[f"{ACCEPTANCE_PREFIX}{j}"] = float(a)
        stored = {k: param_str(v) for k, v in params.items() if v is not None}
        rec = run_record(f"reference-{i}", label, "reference", stored, scalars)
        if isinstance(rec, SkippedRun):
            raise ValueError(f"{path}: evaluation.runs[{i}]: missing {', '.join(rec.missing)}")
        records.append(rec)
    return records


def read_reference(path: str | Path) -> Reference:
    """A reference file, checked; AnalysisError naming the file and what is wrong."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise AnalysisError(f"--reference {path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise AnalysisError(f"--reference {path}: not a readable JSON file ({err})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("label"), str):
        raise AnalysisError(
            f"--reference {path}: expected an object with format {FORMAT!r}, a 'label' and an 'evaluation' "
            "(analysis/reference.py; the demo writes one as shipped_head.json)"
        )
    try:
        records = _records(data.get("evaluation"), data["label"], path)
    except ValueError as err:
        raise AnalysisError(f"--reference {err}") from None
    return Reference(data["label"], path, records_to_frame(records))


def reference_points(ref: Reference, filters: Filters | None = None) -> dict[Setting, ReferencePoint]:
    """The reference's point in each setting it was measured in, aggregated as the sweep's runs are.
    `filters`: the analysis's; only what selects settings and prompt sets applies (a reference is
    not a configuration: the window, LoRA depth and circuit filters leave it in)."""
    f = replace(filters or Filters(), window=None, lora_depth=None, circuit=None)
    runs, _ = apply_filters(ref.runs, f)
    if runs.empty:
        return {}
    out: dict[Setting, ReferencePoint] = {}
    for setting, part in split_settings(aggregate(runs)):
        row = part.iloc[0]
        rank = "–" if pd.isna(row["rank"]) else row["rank"]
        out[setting] = ReferencePoint(
            label=ref.label,
            text=f"{row['window']}/{rank}/{row['lora_depth']}",
            mu_acc=float(row["mu_acc_mean"]),
            mu_acc_std=float(row["mu_acc_std"]),
            mu_lat=float(row["mu_lat_mean"]),
            mu_lat_std=float(row["mu_lat_std"]),
            throughput=float(row["throughput_mean"]),
            prompt_sets=str(row["prompt_sets"]),
        )
    return out


def _prompt_sets(part: pd.DataFrame) -> str:
    """The prompt-set names the setting's configurations were evaluated on, comma-joined."""
    names = {s for v in part["prompt_sets"].dropna() for s in str(v).split(",") if s}
    return ",".join(sorted(names))


def points_for(
    setting: Setting, part: pd.DataFrame, refs: list[dict[Setting, ReferencePoint]]
) -> list[ReferencePoint]:
    """The references measured in `setting` on the prompt sets of its configurations (`part`)."""
    sets = _prompt_sets(part) if "prompt_sets" in part.columns else None
    found = (points.get(setting) for points in refs)
    return [p for p in found if p is not None and (sets is None or p.prompt_sets == sets)]


def unmatched_note(ref: Reference, points: dict[Setting, ReferencePoint], drawn: int) -> str | None:
    """A note when a reference was drawn in no figure: where it was measured, so the mismatch shows."""
    if drawn:
        return None
    if not points:
        return f"note: reference {ref.label!r} ({ref.path}): no run passes the filters; not drawn"
    where = "; ".join(f"{s.title()} on prompt sets {p.prompt_sets}" for s, p in points.items())
    return (
        f"note: reference {ref.label!r} ({ref.path}) was measured in no setting of these runs "
        f"(its settings: {where}); not drawn"
    )
