"""Evaluation runs: the one writer of the child run that holds one evaluation (a head, a decoding
mode, a prompt set) and the reader that finds them again (the sweep runner's read-back, the analysis).

An evaluation run is a FINISHED child of its trial's parent run, named for what it is:
`cp-r8-n16-k0/sample/set1` (grid key / mode, plus `-drop`, `-T<temperature>` or `-eos_allowed`
when not the default / prompt set). It carries the params `tracking.schema.EVAL_PARAMS` (plus whatever the caller
adds, e.g. the trial), the scalar metrics (`EVAL_METRICS`), `acceptance_pos_<i>` for every tested
window position i (1-based) and the artifact `accepted_length_histogram.json` =
{"accepted_length_histogram": counts by accepted length, "per_position_acceptance": [...]}.
A trial's parent run carries, per evaluation label, the mean of SUMMARY_METRICS over its reported
prompt sets (`greedy/throughput`, `log_trial_summary`): one row per trial in the UI's runs table.
Leaves out: computing any metric (experiments/evaluation/decoding.py, the fixture trial in sweeps/trials.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from tracking.runs import PARENT_TAG, child_runs, iter_runs, log_metrics, param_str
from tracking.schema import (
    ACCEPTANCE_PREFIX,
    DEV_SET_PREFIX,
    EOS_MODES,
    GRID_PARAMS,
    HISTOGRAM_ARTIFACT,
    grid_key,
)
from tracking.store import client

#: params an evaluation run cannot be named (or found) without
NAME_PARAMS: tuple[str, ...] = (*GRID_PARAMS, "mode", "prompt_set")
#: tag of runs that are about evaluations without being one (the analysis summary run)
SUMMARY_TAG = "mtpc.analysis"
#: the metrics a trial's parent run summarises per evaluation label (`greedy/throughput`)
SUMMARY_METRICS: tuple[str, ...] = ("mu_acc", "mu_lat", "tokens_per_cycle", "throughput", "speedup_vs_stp")
SUMMARY_DIGITS = 4


def evaluation_label(params: dict[str, Any]) -> str:
    """`<mode>[-drop][-T<t>][-eos_allowed]`, e.g. `greedy`, `sample-T0.7`: the decoding mode and what
    the evaluation varied away from its defaults (extra_token keep, temperature 1 when sampling,
    EOS banned)."""
    label = str(params["mode"])
    if params.get("extra_token", "keep") not in (None, "keep"):
        label += f"-{params['extra_token']}"
    t = params.get("temperature")
    if label.startswith("sample") and t is not None and float(t) != 1.0:
        label += f"-T{float(t):g}"
    if params.get("eos", EOS_MODES[0]) not in (None, EOS_MODES[0]):
        label += f"-eos_{params['eos']}"
    return label


def evaluation_run_name(params: dict[str, Any]) -> str:
    """`<grid key>/<evaluation label>/set<prompt set>`, e.g. `cp-r8-n16-k0/sample/set1`: the grid key
    (with the training axes away from their defaults), the label, the prompt set."""
    ps = str(params["prompt_set"])
    return f"{grid_key(params)}/{evaluation_label(params)}/{'set' + ps if ps.isdigit() else ps}"


def summary_metrics(runs: list, metrics: tuple[str, ...] = SUMMARY_METRICS) -> dict[str, float]:
    """`<evaluation label>/<metric>`: the mean of each metric over the evaluation runs of that label
    on the reported prompt sets (development sets choose settings, they are not results)."""
    groups: dict[str, list] = {}
    for r in runs:
        if is_evaluation_run(r) and not str(r.data.params["prompt_set"]).startswith(DEV_SET_PREFIX):
            groups.setdefault(evaluation_label(r.data.params), []).append(r)
    out = {}
    for label, rs in groups.items():
        for m in metrics:
            vals = [r.data.metrics[m] for r in rs if m in r.data.metrics]
            if vals:
                out[f"{label}/{m}"] = sum(vals) / len(vals)
    return out


def log_trial_summary(uri: str, experiment_id: str, parent_run_id: str) -> dict[str, float]:
    """Log `summary_metrics` of a trial's stored evaluation runs on its parent run, rounded to
    SUMMARY_DIGITS significant digits (a row to read: the evaluation runs keep full precision), so
    the runs table compares trials on one row each (the saved view of tracking/views.py)."""
    out = {
        k: float(f"{v:.{SUMMARY_DIGITS}g}")
        for k, v in summary_metrics(child_runs(uri, experiment_id, parent_run_id)).items()
    }
    log_metrics(uri, parent_run_id, out)
    return out


def log_evaluation(
    uri: str,
    parent_run_id: str,
    params: dict[str, Any],
    metrics: dict[str, Any],
    *,
    per_position_acceptance: list[float | None] | None = None,
    histogram: list[int] | None = None,
    artifacts: dict[str, Any] | None = None,
    experiment_id: str | None = None,
) -> str:
    """Store one evaluation as a FINISHED child run of `parent_run_id` (see the module docstring);
    returns its id. Non-numeric and NaN metrics are left out; `artifacts` maps further JSON
    artifact names to their content (e.g. `per_prompt.json`). A failure while logging ends the
    child FAILED and re-raises."""
    from mlflow.entities import Metric, Param

    missing = [k for k in NAME_PARAMS if k not in params]
    if missing:
        raise ValueError(
            f"evaluation params lack {missing}; an evaluation run carries {list(NAME_PARAMS)} at least"
        )
    c = client(uri)
    exp = experiment_id or c.get_run(parent_run_id).info.experiment_id
    run_id = c.create_run(
        exp, run_name=evaluation_run_name(params), tags={PARENT_TAG: parent_run_id}
    ).info.run_id
    try:
        scalars = {
            k: float(v)
            for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        }
        for i, a in enumerate(per_position_acceptance or [], 1):
            if a is not None:
                scalars[f"{ACCEPTANCE_PREFIX}{i}"] = float(a)
        ps = [Param(k, param_str(v)) for k, v in params.items()]
        ms = [Metric(k, v, 0, 0) for k, v in scalars.items()]
        for i in range(0, max(len(ps), len(ms)), 100):
            c.log_batch(run_id, params=ps[i : i + 100], metrics=ms[i : i + 100])
        if histogram is not None:
            c.log_dict(run_id, {"accepted_length_histogram": histogram,
                                "per_position_acceptance": per_position_acceptance}, HISTOGRAM_ARTIFACT)  # fmt: skip
        for name, obj in (artifacts or {}).items():
            c.log_dict(run_id, obj, name)
    except BaseException:
        c.set_terminated(run_id, "FAILED")
        raise
    c.set_terminated(run_id, "FINISHED")
    return run_id


def is_evaluation_run(run) -> bool:
    """An evaluation run: has the params mode and prompt_set and is not a summary run."""
    p = run.data.params
    return "mode" in p and "prompt_set" in p and SUMMARY_TAG not in run.data.tags


def evaluation_runs(c, experiment_ids: list[str], parent_run_id: str | None = None) -> Iterator[Any]:
    """Every evaluation run of the experiments (of one parent if given), whatever its status."""
    flt = f"tags.`{PARENT_TAG}` = '{parent_run_id}'" if parent_run_id else ""
    return (r for r in iter_runs(c, experiment_ids, flt) if is_evaluation_run(r))
