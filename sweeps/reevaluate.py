"""Add evaluation passes to the finished trials of a sweep, as more child runs of each trial.

    python -m sweeps.reevaluate sweeps/fidelity_cpu.yaml --set 'eval.modes=[greedy]' [--workers 2]
    python -m sweeps.reevaluate SPEC --set 'eval.modes=[sample]' --set 'eval.temperatures=[0.8]' --keys cp-r8-n8-k0

The spec, with `--set` applied to its `eval` section only, names the study, the tracking store and
the evaluation. Each trial head the sweep finished (`<output_dir>/checkpoints/<study>/<grid key>/head`
with its `mlflow_run_id.txt`) is evaluated on the same prompt sets (the draws depend only on
`eval.seed`, `eval.sets`, `eval.dev_sets` and `eval.n_prompts`) and logged under the trial's parent
run, carrying its training axes and `converged` flag, so `python -m analysis` and
`python -m analysis.fidelity` read the new passes beside the old. A (mode, temperature) pass whose
child runs already cover every prompt set is skipped, so the command is resumable; a pass left
partial by an interruption is deleted and redone. Grid points that have not finished are listed
and left alone. Training settings cannot be changed here: they would describe heads that were not
trained.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import multiprocessing
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import tracking
from experiments.evaluation.prompts import eval_passes, prompt_set_names
from sweeps.spec import SpecError, load_spec, parse_sets
from tracking.schema import grid_key


@dataclass(frozen=True)
class Job:
    key: str
    point: dict[str, Any]
    run_dir: Path
    parent: str
    passes: tuple[tuple[str, float], ...]  # the (mode, temperature) passes still missing


def _pass_of(mode: str, temperature: Any) -> tuple[str, float | None]:
    """A pass's identity: greedy ignores the temperature."""
    return (mode, None) if mode == "greedy" else (mode, float(temperature))


def plan(
    spec, uri: str, keys: set[str] | None = None, *, delete_partial: bool = True
) -> tuple[list[Job], list[str]]:
    """The jobs (trials with missing passes) and the grid keys that have no finished trial head.
    Deletes the child runs of partial passes (an interrupted earlier run of this command) unless
    `delete_partial` is false (a dry run changes nothing)."""
    from experiments.training.mlflow_run import RUN_ID_FILE

    ev = spec.eval
    names = set(prompt_set_names(ev.sets, ev.dev_sets))
    wanted = eval_passes(ev.modes, ev.temperatures)
    client = tracking.client(uri)
    exp = client.get_experiment_by_name(spec.experiment)
    jobs, missing = [], []
    for point in spec.grid or ():
        key = grid_key(point)
        if keys is not None and key not in keys:
            continue
        run_dir = spec.trial_dir(key)
        id_file = run_dir / RUN_ID_FILE
        if exp is None or not (run_dir / "head" / "head.safetensors").is_file() or not id_file.is_file():
            missing.append(key)
            continue
        parent = id_file.read_text().strip()
        if client.get_run(parent).info.status != "FINISHED":
            missing.append(key)
            continue
        children = tracking.child_runs(uri, exp.experiment_id, parent, finished_only=False)
        todo = []
        for mode, temperature in wanted:
            want = _pass_of(mode, temperature)
            runs = [
                r
                for r in children
                if _pass_of(r.data.params.get("mode", ""), r.data.params.get("temperature", "nan")) == want
            ]
            done = {r.data.params.get("prompt_set") for r in runs if r.info.status == "FINISHED"}
            if names <= done:
                continue
            for r in runs if delete_partial else ():  # partial: redo the whole pass
                client.delete_run(r.info.run_id)
            todo.append((mode, temperature))
        if todo:
            jobs.append(Job(key, point, run_dir, parent, tuple(todo)))
    return jobs, missing


def run_job(spec_path: str, overrides: dict[str, Any], job: Job, uri: str) -> str:
    """Evaluate one trial's head for its missing passes (one process, the run's CPU thread count)."""
    import torch

    from experiments.plumbing.quiet import quiet
    from experiments.training.trial import evaluate_head, trial_config

    quiet()
    spec = load_spec(spec_path, overrides=overrides)
    cfg = trial_config(
        spec.train, job.point, tracking_uri=uri, experiment=spec.experiment, run_dir=job.run_dir
    )
    torch.set_num_threads(int(cfg.run.cpu_threads or 1))
    converged = tracking.client(uri).get_run(job.parent).data.metrics.get("converged")
    extra = {"converged": int(converged)} if converged is not None else {}
    for mode in dict.fromkeys(m for m, _ in job.passes):
        temps = tuple(t for m, t in job.passes if m == mode)
        ev = replace(spec.eval, modes=(mode,), temperatures=temps)
        tag = mode if mode == "greedy" else f"{mode}_T" + "_".join(f"{t:g}" for t in temps)
        evaluate_head(
            job.run_dir / "head",
            cfg,
            ev,
            parent_run_id=job.parent,
            tracking_uri=uri,
            out=job.run_dir / f"evaluation_{tag}.json",
            extra_params=extra,
        )
    exp_id = tracking.client(uri).get_run(job.parent).info.experiment_id
    tracking.log_trial_summary(uri, exp_id, job.parent)  # the trial's row in the UI gains the new passes
    return job.key


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sweeps.reevaluate", description=__doc__.split("\n\n")[0])
    ap.add_argument("spec")
    ap.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="eval.KEY=VALUE",
        help="override the spec's evaluation (eval.* keys only); repeatable",
    )
    ap.add_argument("--keys", default=None, help="comma-separated grid keys (default: every finished trial)")
    ap.add_argument("--workers", type=int, default=1, help="processes, one trial head each at a time")
    ap.add_argument("--dry-run", action="store_true", help="list what would be evaluated and stop")
    args = ap.parse_args(argv)
    try:
        overrides = parse_sets(args.sets)
        bad = sorted(k for k in overrides if not k.startswith("eval."))
        if bad:
            raise SpecError(
                f"--set {', '.join(bad)}: only eval.* keys can change after training "
                "(the heads were trained with the spec's other settings)"
            )
        # the objectives play no part here (nothing is optimised); a neutral one keeps a spec whose
        # objective reads a mode this evaluation leaves out valid
        overrides["objectives"] = [{"metric": "mu_acc", "direction": "maximize"}]
        spec = load_spec(args.spec, overrides=overrides)
        if spec.grid is None:
            raise SpecError(f"{args.spec}: space.kind must be grid (trials are found by grid key)")
        uri = spec.tracking_uri
        jobs, missing = plan(
            spec, uri, set(args.keys.split(",")) if args.keys else None, delete_partial=not args.dry_run
        )
    except (SpecError, tracking.TrackingError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    passes = sorted({p for j in jobs for p in j.passes})
    print(
        f"reevaluate: {len(jobs)} trial head(s) to evaluate for {passes}; "
        f"{len(missing)} grid point(s) without a finished trial"
        + (f": {', '.join(missing)}" if missing else ""),
        flush=True,
    )
    if args.dry_run or not jobs:
        return 0
    failed = 0
    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=max(1, args.workers), mp_context=ctx) as pool:
        futures = {pool.submit(run_job, args.spec, overrides, j, uri): j.key for j in jobs}
        for f in cf.as_completed(futures):
            try:
                print(f"reevaluate: {f.result()} done", flush=True)
            except Exception as e:  # one head's failure must not lose the others' results
                failed += 1
                print(
                    f"reevaluate: {futures[f]} FAILED: {type(e).__name__}: {e}", file=sys.stderr, flush=True
                )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
