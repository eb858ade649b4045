"""One sweep trial: train a head (`experiments.training.fit.train_head`), evaluate it with speculative
decoding (`experiments.evaluation.decoding.evaluate_heads` with the spec's `EvalConfig`, every mode on the same
prompt sets in one process, one child run per (mode, temperature, eos, prompt_set)), all in one MLflow parent run.

    run_trial(train: TrainConfig, point, evaluation: EvalConfig, *, mlflow_tracking_uri, mlflow_experiment_id, ...)

`train` is the sweep's base config (the spec's `train` section, parsed at load time), `point` the
grid point {axis param: value} (the axes of `tracking.axes`: circuit, rank, window, lora_depth,
kl_beta, train_seed, ...): `trial_config` sets it with `experiments.training.config.apply_point` and points the run at the trial's tracking and directory;
train_head checks the values once. `evaluation` is the spec's `eval` section. Training checkpoints
under `checkpoint_dir`; a re-run with the same directory resumes from `last.ckpt`. When
`should_stop()` turns true (the sweep worker's SIGUSR1/SIGTERM), training saves a checkpoint at the
next optimizer step and `preempted_exc` is raised instead of evaluating a half-trained head.

After training, the stopping rule (`convergence`: held-out window NLL changed < 1 % over the last
fifth of training) is checked on the logged `val_window_nll` history; `converged` (0/1) and
`val_nll_change_last_fifth` go to the parent, `converged` to every child (0 = undertrained).

The sweep runner derives the objective values from the stored child runs (sweeps/worker.py).
Leaves out: Optuna (sweeps/run.py) and the decoding metrics' definitions (mtpc.speculative).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import tracking
from experiments.evaluation.config import EvalConfig
from experiments.training.config import TrainConfig, apply_point, point_of
from mtpc.atomic import write_json
from tracking import axes


def trial_config(
    base: TrainConfig,
    point: dict[str, Any],
    *,
    tracking_uri: str | None = None,
    experiment: str | None = None,
    run_dir: str | Path | None = None,
) -> TrainConfig:
    """The trial's `TrainConfig`: `base` with the grid point set (`apply_point`), tracking into
    `tracking_uri` / `experiment`, the run in `run_dir` (head in `<run_dir>/head`)."""
    cfg = apply_point(base, point)
    run = replace(
        cfg.run, tracking=True, tracking_uri=tracking_uri, experiment=experiment or cfg.run.experiment
    )
    if run_dir is not None:
        run = replace(run, dir=str(run_dir), export_dir=str(Path(run_dir) / "head"))
    return replace(cfg, run=run)


def check_eval_lengths(
    cfg: TrainConfig, evaluation: EvalConfig, longest: tuple[int, str] | None = None
) -> None:
    """ValueError `eval.max_new_tokens: ...` when the evaluation cannot fit the backbone's context
    (the check generation makes per prompt: prompt + max_new_tokens + window <= max_context), found
    before anything trains; `experiments.evaluation.prompts.longest_prompt` says which prompt length counts
    (`longest`: its result, when the caller has it already). Nothing is checked when the backbone's
    context cannot be known offline."""
    from experiments.training.config import TINY_BACKBONE
    from mtpc.backbones.facts import backbone_max_context

    m = cfg.model
    context = (
        TINY_BACKBONE["max_position_embeddings"]
        if m.backbone == "tiny"
        else backbone_max_context(m.backbone, m.revision)
    )
    if context is None:
        return
    if longest is None:
        from experiments.evaluation.prompts import longest_prompt

        longest = longest_prompt(evaluation)
    prompt, what = longest
    need = prompt + evaluation.max_new_tokens + m.window
    if need > context:
        raise ValueError(
            f"eval.max_new_tokens: {what} ({prompt} ids) + max_new_tokens ({evaluation.max_new_tokens}) + "
            f"window ({m.window}) = {need} exceeds the context of backbone {m.backbone!r} ({context})"
        )


def load_for_eval(head_dir: Path, model: Any):
    """The trained head on a freshly loaded backbone, as `MtpcModel`; `model` is the run's ModelConfig.
    The `tiny` debug backbone is rebuilt from its seed (mtpc.backbones does not know it); others load
    by their recorded name with the run's consent to remote code and its revision."""
    from mtpc import MtpcModel

    if model.backbone == "tiny":
        from experiments.training.module import build_backbone

        tiny = build_backbone("tiny", model.lora_depth, model.backbone_dtype, model.tiny_seed)
        return MtpcModel.from_pretrained(head_dir, backbone=tiny)
    return MtpcModel.from_pretrained(
        head_dir, trust_remote_code=model.trust_remote_code, revision=model.revision
    )


CONVERGENCE_FRACTION = 0.2  # the last fifth of training
CONVERGENCE_TOLERANCE = 0.01  # < 1 % relative change of the held-out window NLL over it


def convergence(
    history: list[tuple[int, float]],
    fraction: float = CONVERGENCE_FRACTION,
    tolerance: float = CONVERGENCE_TOLERANCE,
) -> dict[str, float]:
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


def training_axes(cfg: Any) -> dict[str, Any]:
    """The training params every child run carries (so CE and distilled heads, and training seeds,
    can be told apart from the child alone): every training axis of `tracking.axes` (kl_beta,
    kl_temperature, train_seed, ...) under its param name, as trained. `cfg`: the TrainConfig."""
    point = point_of(cfg)
    return {name: point[name] for name in axes.names(axes.TRAINING)}


def evaluate_head(
    head_dir: Path,
    cfg: TrainConfig,
    evaluation: EvalConfig,
    *,
    parent_run_id: str,
    tracking_uri: str,
    out: Path,
    extra_params: dict[str, Any] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> list[str]:
    """The decoding modes on the same prompt sets (experiments.evaluation.decoding): sampling at every
    temperature of `evaluation.temperatures`, greedy once, each EOS treatment of `evaluation.eos`;
    JSON to `out`, one child run per (mode, temperature, eos, prompt_set) under the parent, carrying
    the training axes and `extra_params`; returns the child run ids."""
    from experiments.evaluation.decoding import evaluate_heads, log_evaluation_to_mlflow
    from experiments.evaluation.prompts import eval_prompt_sets

    model = load_for_eval(head_dir, cfg.model)
    sets, names = eval_prompt_sets(evaluation)  # disjoint draws: dev prompts never overlap reported ones
    results = evaluate_heads(
        {"head": model},
        sets,
        evaluation,
        set_names=names,
        progress=False,  # a sweep trial: the worker prints one line per trial, not tqdm bars
        should_stop=should_stop,
    )  # raises EvaluationStopped between prompt sets
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, results, indent=2)
    params = {**training_axes(cfg), **(extra_params or {})}
    return log_evaluation_to_mlflow(results, parent_run_id, params=params, tracking_uri=tracking_uri)


def run_trial(
    train: TrainConfig,
    point: dict[str, Any],
    evaluation: EvalConfig,
    *,
    mlflow_tracking_uri: str,
    mlflow_experiment_id: str,
    parent_run_name: str,
    parent_run_id: str | None = None,
    checkpoint_dir: str | Path | None = None,
    should_stop: Callable[[], bool] | None = None,
    preempted_exc: type[Exception] = KeyboardInterrupt,
    group: Any = None,
) -> None:
    """Train + evaluate one grid point; log into the parent run (created here if not given).
    `group`: an `experiments.training.launch.ProcessGroup` of more than one rank trains in its own process
    group (the config's trainer then holds its devices and strategy); else training runs here."""
    from experiments.plumbing.quiet import quiet

    quiet()  # a sweep worker is a command line too: only the suite's own messages

    if parent_run_id is None:
        parent_run_id = tracking.start_parent_run(
            mlflow_tracking_uri, mlflow_experiment_id, parent_run_name, params={}, tags={}
        )
    run_dir = Path(checkpoint_dir or Path("runs") / parent_run_name)
    # train and evaluate read MLFLOW_TRACKING_URI when given no URI: make them agree with the
    # sweep for the duration of the trial, then put the caller's environment back
    previous = os.environ.get("MLFLOW_TRACKING_URI")
    os.environ["MLFLOW_TRACKING_URI"] = mlflow_tracking_uri
    try:
        exp_name = tracking.client(mlflow_tracking_uri).get_experiment(mlflow_experiment_id).name
        cfg = trial_config(
            train, point, tracking_uri=mlflow_tracking_uri, experiment=exp_name, run_dir=run_dir
        )
        _train_and_evaluate(
            cfg,
            evaluation,
            uri=mlflow_tracking_uri,
            exp_id=mlflow_experiment_id,
            parent_run_id=parent_run_id,
            run_dir=run_dir,
            should_stop=should_stop or (lambda: False),
            preempted_exc=preempted_exc,
            group=group,
        )
    finally:
        if previous is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = previous


def _train_and_evaluate(
    cfg: TrainConfig,
    evaluation: EvalConfig,
    *,
    uri: str,
    exp_id: str,
    parent_run_id: str,
    run_dir: Path,
    should_stop: Callable[[], bool],
    preempted_exc: type[Exception],
    group: Any = None,
) -> None:
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    if group is not None and group.ranks > 1:
        from experiments.training.launch import train_process_group

        preempted = train_process_group(cfg, group, mlflow_run_id=parent_run_id, should_stop=should_stop)
        head_dir = Path(cfg.resolved().run.export_dir)
    else:
        from experiments.training.fit import train_head

        result = train_head(
            cfg,
            mlflow_run_id=parent_run_id,
            ckpt_path="last" if ckpt.exists() else None,
            should_stop=should_stop,
        )
        preempted, head_dir = result.preempted, result.head_dir
    if preempted or should_stop():
        raise preempted_exc(f"training stopped on request; checkpoint {ckpt}")
    # children of an interrupted earlier attempt would be counted twice: drop them first
    tracking.discard_children(uri, exp_id, parent_run_id)
    history = [
        (m.step, m.value) for m in tracking.client(uri).get_metric_history(parent_run_id, "val_window_nll")
    ]
    conv = convergence(history)  # the stopping rule: an undertrained head is reported as such
    tracking.log_metrics(uri, parent_run_id, {k: v for k, v in conv.items() if v == v})
    # evaluation runs here, in the one process (the worker's) on the trial's first device, after the
    # ranks have exited: mu_lat is batch-1 decoding latency, timed one stream at a time
    from experiments.evaluation.decoding import EvaluationStopped

    try:
        evaluate_head(
            head_dir,
            cfg,
            evaluation,
            parent_run_id=parent_run_id,
            tracking_uri=uri,
            out=run_dir / "evaluation.json",
            extra_params={"converged": int(conv["converged"])},
            should_stop=should_stop,
        )
    except (
        EvaluationStopped
    ):  # the re-run resumes from the last checkpoint (the whole training when it ended on one)
        raise preempted_exc(f"evaluation stopped on request; checkpoint {ckpt}") from None
