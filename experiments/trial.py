"""One sweep trial: train a head (`experiments.train.train_head`), evaluate it with speculative
decoding (`experiments.evaluate`'s importable functions, both modes on the same prompt sets in one
process, one child run per (mode, prompt_set)), all in one MLflow parent run.

    run_trial(train_config, eval_config, *, mlflow_tracking_uri, mlflow_experiment_id, parent_run_name, ...)

`train_config` = {"config": <shipped name or YAML path>, <nested overrides>..., "circuit", "rank",
"window", "lora_depth", "kl_beta", "train_seed"}: `trial_config` parses the base config with the
overrides and sets the grid point on it with `dataclasses.replace` (architecture and kl_beta on
`model`, train_seed as `seed_everything`); train_head checks the values once. Training checkpoints
under `checkpoint_dir`; a re-run with the same directory resumes from `last.ckpt`. When
`should_stop()` turns true (the sweep worker's SIGUSR1/SIGTERM), training saves a checkpoint at the
next optimizer step and `preempted_exc` is raised instead of evaluating a half-trained head.

After training, the stopping rule (`convergence`: held-out window NLL changed < 1 % over the last
fifth of training) is checked on the logged `val_window_nll` history; `converged` (0/1) and
`val_nll_change_last_fifth` go to the parent, `converged` to every child (0 = undertrained).

Returns the objective metrics as means over the stored child runs ("<metric>" over all,
"<mode>/<metric>" per mode). The sweep runner reads the child runs back itself as well.
Leaves out: Optuna (sweeps/run.py) and the decoding metrics' definitions (mtpc.speculative).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import tracking
from mtpc.atomic import write_json
from mtpc.names import DECODE_MODES, DEV_SET_PREFIX, GRID_PARAMS


def trial_config(train_config: dict[str, Any], *, tracking_uri: str | None = None, experiment: str | None = None,
                 run_dir: str | Path | None = None) -> Any:
    """The trial's `TrainConfig`: the spec's base config + nested overrides, the grid point set with
    `dataclasses.replace`, tracking into `tracking_uri` / `experiment`, the run in `run_dir` (head in
    `<run_dir>/head`)."""
    from experiments.config import load_config

    overrides = dict(train_config)
    base = overrides.pop("config", "debug")
    model = {k: overrides.pop(k) for k in (*GRID_PARAMS, "kl_beta") if k in overrides}
    seed = {"seed_everything": overrides.pop("train_seed")} if "train_seed" in overrides else {}
    cfg = load_config(base, overrides)
    run = replace(cfg.run, tracking=True, tracking_uri=tracking_uri, experiment=experiment or cfg.run.experiment)
    if run_dir is not None:
        run = replace(run, dir=str(run_dir), export_dir=str(Path(run_dir) / "head"))
    return replace(cfg, model=replace(cfg.model, **model), run=run, **seed)


def load_for_eval(head_dir: Path, model: Any):
    """The trained head on a freshly loaded backbone, as `MtpcModel`; `model` is the run's ModelConfig.
    The `tiny` debug backbone is rebuilt from its seed (mtpc.backbones does not know it); others load
    by their recorded name with the run's consent to remote code and its revision."""
    from mtpc import MtpcModel

    if model.backbone == "tiny":
        from experiments.module import build_backbone

        tiny = build_backbone("tiny", model.lora_depth, model.backbone_dtype, model.tiny_seed)
        return MtpcModel.from_pretrained(head_dir, backbone=tiny)
    return MtpcModel.from_pretrained(head_dir, trust_remote_code=model.trust_remote_code, revision=model.revision)


CONVERGENCE_FRACTION = 0.2  # the last fifth of training
CONVERGENCE_TOLERANCE = 0.01  # < 1 % relative change of the held-out window NLL over it


def convergence(history: list[tuple[int, float]], fraction: float = CONVERGENCE_FRACTION,
                tolerance: float = CONVERGENCE_TOLERANCE) -> dict[str, float]:
    """The stopping rule of docs/fidelity.md on a (step, val_window_nll) history.

    With L the last validated step, v_L its value and v_ref the value at the last validation at or
    before step (1 - fraction) L: change = |v_L - v_ref| / v_L; `converged` = 1 iff change < tolerance.
    Without a validation inside [0, (1 - fraction) L] (or with fewer than two) the change is unknown
    (NaN) and the head counts as not converged (undertrained).
    """
    pts = sorted((int(s), float(v)) for s, v in history)
    if len(pts) < 2:
        return {"val_nll_change_last_fifth": float("nan"), "converged": 0.0}
    last_step, last = pts[-1]
    before = [v for s, v in pts[:-1] if s <= (1 - fraction) * last_step]
    if not before or last == 0:
        return {"val_nll_change_last_fifth": float("nan"), "converged": 0.0}
    change = abs(last - before[-1]) / abs(last)
    return {"val_nll_change_last_fifth": change, "converged": float(change < tolerance)}


def eval_passes(modes, temperatures) -> list[tuple[str, float]]:
    """(mode, temperature) pairs an evaluation runs: sampling at every temperature, greedy once (at
    the first temperature, which greedy ignores)."""
    return [(m, t) for i, t in enumerate(temperatures) for m in modes if m == "sample" or i == 0]


def prompt_set_names(sets: int, dev_sets: int = 0) -> list[str]:
    """"0".."sets-1" (reported), then "dev0".. (development prompts, disjoint from the reported ones)."""
    return [str(i) for i in range(sets)] + [f"{DEV_SET_PREFIX}{i}" for i in range(dev_sets)]


def training_axes(cfg: Any) -> dict[str, Any]:
    """The training params every child run carries (so CE and distilled heads, and training seeds,
    can be told apart from the child alone): kl_beta, kl_temperature, train_seed. `cfg`: the TrainConfig."""
    return {"kl_beta": float(cfg.model.kl_beta), "kl_temperature": float(cfg.model.kl_temperature),
            "train_seed": cfg.seed_everything}


def evaluate_head(head_dir: Path, cfg: Any, eval_config: dict[str, Any], *, parent_run_id: str,
                  tracking_uri: str, out: Path, extra_params: dict[str, Any] | None = None) -> list[str]:
    """The decoding modes on the same prompt sets (experiments.evaluate): sampling at every
    temperature of `temperatures`, greedy once, each EOS treatment of `eos`; JSON to `out`, one child
    run per (mode, temperature, eos, prompt_set) under the parent, carrying the training axes and
    `extra_params`; returns the child run ids."""

    from experiments.evaluate import evaluate_heads, load_prompt_sets, log_evaluation_to_mlflow, summarize

    model = load_for_eval(head_dir, cfg.model)
    names = prompt_set_names(eval_config.get("sets", 1), eval_config.get("dev_sets", 0))
    sets = load_prompt_sets(eval_config.get("prompts", "heldout"), eval_config.get("n_prompts", 8), len(names),
                            eval_config.get("seed", 0))  # disjoint draws: dev prompts never overlap reported ones
    modes = tuple(eval_config.get("modes", DECODE_MODES))
    temperatures = tuple(eval_config.get("temperatures", (1.0,)))
    results = None
    for temperature in temperatures:
        passes = tuple(m for m, t in eval_passes(modes, temperatures) if t == temperature)
        res = evaluate_heads(
            {"head": model}, sets, passes, (eval_config.get("extra_token", "keep"),),
            max_new_tokens=eval_config.get("max_new_tokens", 64), temperature=temperature,
            top_p=eval_config.get("top_p", 1.0), seed=eval_config.get("seed", 0),
            eos=tuple(eval_config.get("eos", ("banned",))), set_names=names, stp=eval_config.get("stp", True),
        )
        if results is None:
            results = res
        else:  # one JSON for the whole evaluation: runs and STP baselines of every temperature
            results["runs"] += res["runs"]
            for mode, rows in res["stp"].items():
                results["stp"].setdefault(mode, []).extend(rows)
    results["config"]["temperatures"] = list(temperatures)
    results["summary"] = summarize(results)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, results, indent=2)
    params = {**training_axes(cfg), **(extra_params or {})}
    return log_evaluation_to_mlflow(results, parent_run_id, params=params, tracking_uri=tracking_uri)


def run_trial(
    train_config: dict[str, Any],
    eval_config: dict[str, Any],
    *,
    mlflow_tracking_uri: str,
    mlflow_experiment_id: str,
    parent_run_name: str,
    parent_run_id: str | None = None,
    checkpoint_dir: str | Path | None = None,
    should_stop: Callable[[], bool] | None = None,
    preempted_exc: type[Exception] = KeyboardInterrupt,
) -> dict[str, float]:
    """Train + evaluate one architecture; log into the parent run (created here if not given)."""
    from experiments.quiet import quiet

    quiet()  # a sweep worker is a command line too: only the suite's own messages

    if parent_run_id is None:
        parent_run_id = tracking.start_parent_run(mlflow_tracking_uri, mlflow_experiment_id, parent_run_name, params={}, tags={})
    run_dir = Path(checkpoint_dir or Path("runs") / parent_run_name)
    # train and evaluate read MLFLOW_TRACKING_URI when given no URI: make them agree with the
    # sweep for the duration of the trial, then put the caller's environment back
    previous = os.environ.get("MLFLOW_TRACKING_URI")
    os.environ["MLFLOW_TRACKING_URI"] = mlflow_tracking_uri
    try:
        return _train_and_evaluate(
            train_config, eval_config, uri=mlflow_tracking_uri, exp_id=mlflow_experiment_id,
            exp_name=tracking.client(mlflow_tracking_uri).get_experiment(mlflow_experiment_id).name, parent_run_id=parent_run_id,
            run_dir=run_dir, should_stop=should_stop or (lambda: False), preempted_exc=preempted_exc,
        )
    finally:
        if previous is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = previous


def _train_and_evaluate(
    train_config: dict[str, Any], eval_config: dict[str, Any], *, uri: str, exp_id: str, exp_name: str,
    parent_run_id: str, run_dir: Path, should_stop: Callable[[], bool], preempted_exc: type[Exception],
) -> dict[str, float]:
    from experiments.train import train_head

    ckpt = run_dir / "checkpoints" / "last.ckpt"
    cfg = trial_config(train_config, tracking_uri=uri, experiment=exp_name, run_dir=run_dir)
    result = train_head(cfg, mlflow_run_id=parent_run_id, ckpt_path="last" if ckpt.exists() else None,
                        should_stop=should_stop)
    if result.preempted or should_stop():
        raise preempted_exc(f"training stopped on request; checkpoint {ckpt}")
    # children of an interrupted earlier attempt would be counted twice: drop them first
    tracking.discard_children(uri, exp_id, parent_run_id)
    modes = eval_config.get("modes", list(DECODE_MODES))
    history = [(m.step, m.value) for m in tracking.client(uri).get_metric_history(parent_run_id, "val_window_nll")]
    conv = convergence(history)  # the stopping rule: an undertrained head is reported as such
    tracking.log_metrics(uri, parent_run_id, {k: v for k, v in conv.items() if v == v})
    evaluate_head(result.head_dir, cfg, eval_config, parent_run_id=parent_run_id, tracking_uri=uri,
                  out=run_dir / "evaluation.json", extra_params={"converged": int(conv["converged"])})
    out: dict[str, float] = {}
    runs = tracking.child_runs(uri, exp_id, parent_run_id)
    for key in ("mu_lat", "mu_acc", "tokens_per_cycle", "throughput", "speedup_vs_stp"):
        vals = [r.data.metrics[key] for r in runs if key in r.data.metrics]
        if vals:
            out[key] = sum(vals) / len(vals)
        for mode in modes:
            mv = [r.data.metrics[key] for r in runs if key in r.data.metrics and r.data.params.get("mode") == mode]
            if mv:
                out[f"{mode}/{key}"] = sum(mv) / len(mv)
    return out
