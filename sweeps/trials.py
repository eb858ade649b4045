"""What one trial does, by the spec's `objective:` kind (`spec.trial_kind`), behind one signature:
`run_trial(ctx)` fills the trial's parent MLflow run and stores one evaluation run per (mode,
prompt_set) with `tracking.log_evaluation`; the runner then reads the stored evaluation runs back
and derives the Optuna values (the spec's `objectives`) from them (so a trial can never succeed
without stored results).

- `fixture`: metrics are a deterministic function of the grid point (no torch import); it
  checkpoints a step counter, honours pre-emption, and can be told to fail on chosen points.
  Tests and cluster checks use it; it is not a model of real behaviour.
- `trial`: `experiments.training.trial.run_trial` (train the head, evaluate speculative decoding); a trial
  of several ranks (`slurm.tasks_per_trial` / `gpus_per_trial`) trains in its own process group
  (`experiments.training.launch`), evaluates in the worker.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tracking
from experiments.evaluation.prompts import eval_passes, prompt_set_names  # light: no torch
from sweeps.spec import SweepSpec
from tracking.schema import ACCEPTANCE_PREFIX


class Preempted(Exception):  # noqa: N818 (a control-flow signal, not an error)
    """The worker was asked to stop (SIGUSR1 before the time limit, SIGTERM): the trial saved its
    checkpoint and stays RUNNING, to be resumed by the requeued task (or reaped and re-run)."""


@dataclass
class TrialContext:
    spec: SweepSpec
    point: dict[str, Any]  # circuit, rank, window, lora_depth
    trial_number: int
    tracking_uri: str
    experiment_id: str
    parent_run_id: str
    parent_run_name: str
    checkpoint_dir: Path  # keyed by grid point: a re-run of the point resumes from it
    should_stop: Callable[[], bool]
    set_attr: Callable[[str, Any], None]  # store a user attr on the Optuna trial


def run_trial(ctx: TrialContext) -> None:
    if ctx.spec.trial_kind == "fixture":
        fixture_trial(ctx)
        return
    from experiments.training import trial  # heavy imports (torch, lightning) only here
    from experiments.training.launch import ProcessGroup

    s = ctx.spec.slurm
    trial.run_trial(
        ctx.spec.train,
        ctx.point,
        ctx.spec.eval,
        mlflow_tracking_uri=ctx.tracking_uri,
        mlflow_experiment_id=ctx.experiment_id,
        parent_run_name=ctx.parent_run_name,
        parent_run_id=ctx.parent_run_id,
        checkpoint_dir=ctx.checkpoint_dir,
        should_stop=ctx.should_stop,
        preempted_exc=Preempted,
        group=ProcessGroup(ranks=s.ranks, nodes=s.nodes_per_trial, gpus_per_node=s.trial_gpus_per_node),
    )


# ------------------------------------------------------------------------------------------------
# fixture


#: the stand-in acceptance rate per circuit kind; a kind not listed (a new one) takes DEFAULT_BASE_RATE,
#: so adding a kind needs no line here
_BASE_RATE = {"ff": 0.45, "cp": 0.55, "hmm": 0.62, "btree": 0.60}
DEFAULT_BASE_RATE = 0.5


def fixture_metrics(point: dict[str, Any], mode: str, extra_token: str = "keep") -> dict[str, float]:
    """Plausible-looking, deterministic stand-in metrics under the evaluator's names (EVAL_METRICS,
    acceptance_pos_<i>); tokens_per_cycle = mu_acc + 1, as extra_token=keep guarantees."""
    n, r, k, c = point["window"], point["rank"], point["lora_depth"], point["circuit"]
    rate = min(0.95, _BASE_RATE.get(c, DEFAULT_BASE_RATE) + 0.03 * math.log2(r) + 0.04 * k) * (
        0.9 if mode == "sample" else 1.0
    )
    per_pos = [rate**i for i in range(1, n)]  # P(position i+1 accepted)
    mu_acc = sum(per_pos)
    mu_lat = 1e-3 * (1.0 + 0.002 * n * r + 0.15 * k + (0.05 if c in ("hmm", "btree") else 0.0))
    tpc = mu_acc + 1.0
    stp_mu_lat = 0.9e-3
    out = {
        "mu_lat": mu_lat,
        "mu_acc": mu_acc,
        "tokens_per_cycle": tpc,
        "throughput": tpc / mu_lat,
        "max_throughput": n / mu_lat,
        "stp_mu_lat": stp_mu_lat,
        "stp_throughput": 1.0 / stp_mu_lat,
        "speedup_vs_stp": (tpc / mu_lat) * stp_mu_lat,
        "peak_mem_bytes": 1e6 * (1 + n * r),
    }
    out.update({f"{ACCEPTANCE_PREFIX}{i + 2}": p for i, p in enumerate(per_pos)})  # 1-based window position
    return out


def fixture_histogram(point: dict[str, Any], mode: str, cycles: int = 100) -> list[int]:
    """Counts of accepted lengths 0..n-1 over `cycles` cycles, consistent with fixture_metrics."""
    m = fixture_metrics(point, mode)
    n = point["window"]
    surv = [1.0] + [m[f"{ACCEPTANCE_PREFIX}{i + 2}"] for i in range(n - 1)]  # P(accepted >= i)
    probs = [surv[i] - (surv[i + 1] if i + 1 < n else 0.0) for i in range(n)]
    return [round(cycles * p) for p in probs]


def _matches(point: dict[str, Any], partial: dict[str, Any]) -> bool:
    return all(point.get(k) == v for k, v in partial.items())


def _write_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def fixture_trial(ctx: TrialContext) -> None:
    spec, point = ctx.spec, ctx.point
    fx = spec.fixture
    ctx.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    ckpt = ctx.checkpoint_dir / "fixture_state.json"
    start = json.loads(ckpt.read_text())["step"] if ckpt.exists() else 0
    ctx.set_attr("resumed_from_step", start)
    uri, parent = ctx.tracking_uri, ctx.parent_run_id
    tracking.log_params(uri, parent, {"backbone": "fixture", "seed": spec.train.seed_everything, **point})
    for step in range(start, fx.steps):
        if ctx.should_stop():
            raise Preempted(f"stopped before step {step} of {fx.steps}")
        time.sleep(fx.step_seconds)
        _write_atomic(ckpt, {"step": step + 1})
        tracking.log_metrics(uri, parent, {"train_loss": 1.0 / (step + 1)}, step=step)
    for partial in fx.fail:
        if _matches(point, partial):
            raise RuntimeError(
                f"fixture: forced failure for grid point {point} (fixture.fail entry {partial})"
            )
    tracking.log_metrics(uri, parent, {"resumed_from_step": start, "window_nll": 1.0 / point["rank"]})
    tracking.discard_children(uri, ctx.experiment_id, parent)
    e = spec.eval
    for mode, temperature in eval_passes(e.modes, e.temperatures):
        for eos in e.eos:
            for ps in prompt_set_names(e.sets, e.dev_sets):  # named as experiments.training.trial names them
                params = {
                    "backbone": "fixture",
                    **point,
                    "mode": mode,
                    "extra_token": e.extra_token,
                    "eos": eos,
                    "temperature": temperature,
                    "prompt_set": ps,
                    "seed": e.seed,
                    "hardware": "fixture",
                    "top_p": e.top_p,
                    "acceptance_method": e.acceptance,
                }
                metrics = fixture_metrics(point, mode, e.extra_token)
                if (
                    e.acceptance == "offline"
                ):  # as evaluate names them: derived from offline acceptance and timed latency
                    metrics.update(
                        derived_throughput=metrics["throughput"],
                        derived_speedup_vs_stp=metrics["speedup_vs_stp"],
                    )
                per_pos = [None] + [
                    metrics.pop(f"{ACCEPTANCE_PREFIX}{i}") for i in range(2, point["window"] + 1)
                ]
                tracking.log_evaluation(
                    uri,
                    parent,
                    params,
                    metrics,
                    per_position_acceptance=per_pos,
                    histogram=fixture_histogram(point, mode),
                    experiment_id=ctx.experiment_id,
                )
