"""One sweep trial: train a head (`experiments.train.train_head`), evaluate it with speculative
decoding (`experiments.evaluate`'s importable functions, both modes on the same prompt sets in one
process, one child run per (mode, prompt_set)), all in one MLflow parent run.

    run_trial(train_config, eval_config, *, mlflow_tracking_uri, mlflow_experiment_id, parent_run_name, ...)

`train_config` = {"config": <shipped name or YAML path>, <nested overrides>..., "circuit", "rank",
"window", "lora_depth"} (the grid point's names go to `model.*`). Training checkpoints under
`checkpoint_dir`; a re-run with the same directory resumes from `last.ckpt`. When `should_stop()`
turns true (pre-emption), training saves a checkpoint at the next batch end and `preempted_exc` is
raised instead of evaluating a half-trained head. Lightning gets `LightningEnvironment` from
train_head (a one-task SLURM job is not a multi-process or self-requeueing job).

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
from pathlib import Path
from typing import Any

from mtpc.names import DECODE_MODES, DEV_SET_PREFIX, GRID_PARAMS


def stop_callback(should_stop: Callable[[], bool], ckpt_path: Path):
    """A Lightning callback: once `should_stop()` is true, save `ckpt_path` and end fit."""
    from lightning.pytorch.callbacks import Callback

    class StopOnRequest(Callback):
        stopped = False

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if should_stop() and not self.stopped:
                ckpt_path.parent.mkdir(parents=True, exist_ok=True)
                trainer.save_checkpoint(str(ckpt_path))
                self.stopped = True
                trainer.should_stop = True

    return StopOnRequest()


def train_overrides(train_config: dict[str, Any], *, tracking_uri: str, experiment: str | None) -> tuple[str | dict, dict[str, Any]]:
    """Split a sweep's train config into (base config, overrides for experiments.train.train_head)."""
    cfg = dict(train_config)
    base = cfg.pop("config", "debug")
    overrides: dict[str, Any] = {}
    for k in GRID_PARAMS:
        if k in cfg:
            overrides[f"model.{k}"] = cfg.pop(k)
    if "kl_beta" in cfg:  # the training axes: the loss weight and the head's training seed
        overrides["model.kl_beta"] = cfg.pop("kl_beta")
    if "train_seed" in cfg:
        overrides["seed_everything"] = cfg.pop("train_seed")
    for k, v in cfg.items():
        overrides[k] = v
    overrides["run.tracking"] = True
    overrides["run.tracking_uri"] = tracking_uri
    if experiment:
        overrides["run.experiment"] = experiment
    return base, overrides


def load_for_eval(head_dir: Path, resolved: dict[str, Any]):
    """The trained head on a freshly loaded backbone, as `MtpcModel`. The `tiny` debug backbone is
    rebuilt from its seed (mtpc.backbones does not know it); others load by their recorded name."""
    from mtpc import MtpcModel

    m = resolved.get("model", {})
    backbone = None
    if m.get("backbone") == "tiny":
        from experiments.module import build_backbone

        backbone = build_backbone("tiny", m.get("lora_depth", 0), m.get("backbone_dtype"), m.get("tiny_seed", 0))
    return MtpcModel.from_pretrained(head_dir, backbone=backbone)


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


def training_axes(resolved: dict[str, Any]) -> dict[str, Any]:
    """The training params every child run carries (so CE and distilled heads, and training seeds,
    can be told apart from the child alone): kl_beta, kl_temperature, train_seed."""
    m = resolved.get("model", {})
    return {"kl_beta": float(m.get("kl_beta", 0.0)), "kl_temperature": float(m.get("kl_temperature", 1.0)),
            "train_seed": resolved.get("seed_everything", 0)}


def evaluate_head(head_dir: Path, resolved: dict[str, Any], eval_config: dict[str, Any], *, parent_run_id: str,
                  tracking_uri: str, out: Path, extra_params: dict[str, Any] | None = None) -> list[str]:
    """The decoding modes on the same prompt sets (experiments.evaluate): sampling at every
    temperature of `temperatures`, greedy once, each EOS treatment of `eos`; JSON to `out`, one child
    run per (mode, temperature, eos, prompt_set) under the parent, carrying the training axes and
    `extra_params`; returns the child run ids."""
    import json

    from experiments.evaluate import evaluate_heads, load_prompt_sets, log_evaluation_to_mlflow, summarize

    model = load_for_eval(head_dir, resolved)
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
    out.write_text(json.dumps(results, indent=2) + "\n")
    params = {**training_axes(resolved), **(extra_params or {})}
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
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_tracking_uri)
    if parent_run_id is None:
        parent_run_id = client.create_run(mlflow_experiment_id, run_name=parent_run_name).info.run_id
    run_dir = Path(checkpoint_dir or Path("runs") / parent_run_name)
    # train and evaluate read MLFLOW_TRACKING_URI when given no URI: make them agree with the
    # sweep for the duration of the trial, then put the caller's environment back
    previous = os.environ.get("MLFLOW_TRACKING_URI")
    os.environ["MLFLOW_TRACKING_URI"] = mlflow_tracking_uri
    try:
        return _train_and_evaluate(
            train_config, eval_config, uri=mlflow_tracking_uri, exp_id=mlflow_experiment_id,
            exp_name=client.get_experiment(mlflow_experiment_id).name, parent_run_id=parent_run_id,
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
    from sweeps.tracking import child_runs, discard_children

    ckpt = run_dir / "checkpoints" / "last.ckpt"
    base, overrides = train_overrides(train_config, tracking_uri=uri, experiment=exp_name)
    stopper = stop_callback(should_stop, ckpt)
    result = train_head(
        base, overrides, mlflow_run_id=parent_run_id, ckpt_path="last" if ckpt.exists() else None,
        run_dir=run_dir, export_dir=run_dir / "head", callbacks=[stopper],
    )
    # train_head's own SIGUSR1 handler (result.preempted) or our stop request (SIGTERM, SIGUSR1)
    if getattr(result, "preempted", False) or stopper.stopped or should_stop():
        raise preempted_exc(f"training stopped on request; checkpoint {ckpt}")
    # children of an interrupted earlier attempt would be counted twice: drop them first
    discard_children(uri, exp_id, parent_run_id)
    modes = eval_config.get("modes", list(DECODE_MODES))
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    history = [(m.step, m.value) for m in client.get_metric_history(parent_run_id, "val_window_nll")]
    conv = convergence(history)  # the stopping rule: an undertrained head is reported as such
    client.log_batch(parent_run_id, metrics=[_metric(k, v) for k, v in conv.items() if v == v])
    evaluate_head(result.head_dir, result.config, eval_config, parent_run_id=parent_run_id, tracking_uri=uri,
                  out=run_dir / "evaluation.json", extra_params={"converged": int(conv["converged"])})
    out: dict[str, float] = {}
    runs = child_runs(uri, exp_id, parent_run_id)
    for key in ("mu_lat", "mu_acc", "tokens_per_cycle", "throughput", "speedup_vs_stp"):
        vals = [r.data.metrics[key] for r in runs if key in r.data.metrics]
        if vals:
            out[key] = sum(vals) / len(vals)
        for mode in modes:
            mv = [r.data.metrics[key] for r in runs if key in r.data.metrics and r.data.params.get("mode") == mode]
            if mv:
                out[f"{mode}/{key}"] = sum(mv) / len(mv)
    return out


def _metric(key: str, value: float):
    import time

    from mlflow.entities import Metric

    return Metric(key, float(value), int(time.time() * 1000), 0)
