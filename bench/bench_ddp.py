"""What DDP's communication costs on the CPU: 2 processes x 1 thread against 1 process x 2 threads,
the same optimizer steps at the same global batch, side by side.

    python bench/bench_ddp.py --out bench/results/ddp_cpu.json        # the default backbone (default.yaml)
    python bench/bench_ddp.py --dry-run                               # debug config, 2 steps, nothing timed

Each variant is `python -m experiments.train fit` in its own process (a child of this script, run
through its `--child` mode so rank 0 records the wall-clock time of every optimizer step):

- `one`: 1 process, `run.cpu_threads 2`, `data.batch_size B`;
- `ddp2`: Lightning's standalone DDP over gloo, `trainer.devices 2`, `run.cpu_threads 1` and
  `OMP_NUM_THREADS=1` per rank, `data.batch_size B/2` (global batch B: the same steps).

The variants alternate round by round (`--rounds`), so a shared machine's load falls on both alike,
inside `experiments.plumbing.timing_lock.timing()` (the machine-wide timing lock; the background
pre-training paused). Reported per variant: the median time of an optimizer step after the first
`--warmup` steps, the process's wall time (start-up and backbone load included), and the ratio
ddp2 / one of the step time — how much the all-reduce and two processes cost against two threads in
one process on the same cores. No GPU claim: on GPUs each rank has its own device.
A dry run (`--dry-run`: the debug config, 2 steps, one round, no timing lock) checks that both
variants run and that the report has its shape; its times are not reported.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEP_FILE_ENV = "MTPC_BENCH_STEP_TIMES"


def variants(batch: int) -> dict[str, tuple[list[str], dict[str, str]]]:
    """name -> (extra `fit` flags, extra environment)."""
    return {
        "one": (["--data.batch_size", str(batch), "--run.cpu_threads", "2"], {"OMP_NUM_THREADS": "2"}),
        "ddp2": (
            [
                "--data.batch_size",
                str(batch // 2),
                "--trainer.devices",
                "2",
                "--trainer.strategy",
                "ddp",
                "--run.cpu_threads",
                "1",
            ],
            {"OMP_NUM_THREADS": "1"},
        ),
    }


def _run(name: str, flags: list[str], env_extra: dict[str, str], common: list[str], work: Path) -> dict:
    steps = work / f"{name}.steps"
    steps.unlink(missing_ok=True)
    run_dir = work / name
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "MASTER_", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK"))
    }
    env.update(env_extra, **{STEP_FILE_ENV: str(steps), "PYTHONPATH": str(ROOT)})
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        "fit",
        *common,
        *flags,
        "--run.dir",
        str(run_dir),
        "--run.tracking",
        "false",
        "--trainer.enable_progress_bar",
        "false",
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    stamps = [float(x) for x in steps.read_text().split()]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    return {
        "wall_s": wall,
        "step_times_s": [b - a for a, b in zip(stamps, stamps[1:], strict=False)],
        "global_step": metrics["global_step"],
        "final_train_loss": metrics.get("train_loss"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="default", help="training config (a shipped name or a YAML path)")
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps per variant and round")
    ap.add_argument("--batch", type=int, default=2, help="global batch (rows per optimizer step)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    ap.add_argument(
        "--dry-run", action="store_true", help="debug config, 2 steps, 1 round; no times reported"
    )
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.dry_run:
        a.config, a.steps, a.rounds, a.warmup, a.batch = "debug", 2, 1, 0, 4
    if a.batch % 2:
        ap.error("--batch must be even (2 ranks)")
    config = (
        a.config if Path(a.config).is_file() else str(ROOT / "experiments" / "configs" / f"{a.config}.yaml")
    )
    common = [
        "--config",
        config,
        "--trainer.max_steps",
        str(a.steps),
        "--trainer.max_epochs",
        "-1",
        "--run.checkpoint_every_n_steps",
        "0",
        "--trainer.limit_val_batches",
        "0",
    ]
    results: dict[str, list[dict]] = {name: [] for name in variants(a.batch)}
    from experiments.plumbing.timing_lock import timing

    with tempfile.TemporaryDirectory(prefix="bench-ddp-") as tmp:
        for r in range(a.rounds):
            order = list(variants(a.batch).items())
            order = order if r % 2 == 0 else order[::-1]
            for name, (flags, env) in order:
                with contextlib.nullcontext() if a.dry_run else timing(progress=True):
                    results[name].append(_run(f"{name}-{r}", flags, env, common, Path(tmp)))
    report: dict = {
        "config": a.config,
        "steps": a.steps,
        "global_batch": a.batch,
        "rounds": a.rounds,
        "dry_run": a.dry_run,
        "variants": {},
    }
    for name, rounds in results.items():
        assert all(x["global_step"] == a.steps for x in rounds), (name, [x["global_step"] for x in rounds])
        steps = [t for x in rounds for t in x["step_times_s"][max(a.warmup - 1, 0) :]]
        report["variants"][name] = {
            "median_step_s": None if a.dry_run else statistics.median(steps),
            "wall_s": None if a.dry_run else [x["wall_s"] for x in rounds],
            "global_step": a.steps,
            "final_train_loss": [x["final_train_loss"] for x in rounds],
        }
    if not a.dry_run:
        v = report["variants"]
        report["ddp2_over_one_step_time"] = v["ddp2"]["median_step_s"] / v["one"]["median_step_s"]
        from tracking.runs import machine

        report["machine"] = machine()
    text = json.dumps(report, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


def child(argv: list[str]) -> int:
    """The training CLI with rank 0 appending the time of every optimizer step to $MTPC_BENCH_STEP_TIMES."""
    sys.path.insert(0, str(ROOT))
    from lightning.pytorch.callbacks import Callback

    import experiments.train as train

    class StepTimes(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if not trainer.fit_loop._should_accumulate() and trainer.global_rank == 0:
                with open(os.environ[STEP_FILE_ENV], "a") as f:
                    f.write(f"{time.perf_counter()}\n")

    train.train_head = functools.partial(train.train_head, callbacks=[StepTimes()])
    return train.main(argv)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        sys.exit(child(sys.argv[2:]))
    sys.exit(main())
