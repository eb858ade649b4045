"""`make demo` (= `python -m sweeps.demo`): the whole suite once, on the 2-core CPU.

1. check the shipped default model (`mtpc/default_model/`, committed: no pre-training) against its
   manifest, build the bundled ShareGPT corpus once (cached under `mtpc.paths.cache_dir()`), print
   the shipped default head's speed-up over plain decoding on 4 held-out prompts (`shipped_head_line`),
   and measure that head by the sweep's own evaluation (`shipped_reference`: the trials' function,
   prompt sets and metrics) into `<out>/shipped_head.json`, its reference point in the Pareto plots,
2. run `sweeps/smoke.yaml` locally, overridden to train on the default model
   (`train.config=default`: 200 steps of 2 x 512 bytes per head) and evaluated on one set of 32
   held-out prompts x 64 bytes, greedy and sampling: acceptance offline on all 32, latency timed on
   the first 8 (`DEMO_EVAL`); the objective is the derived throughput,
3. run `python -m analysis` (Pareto fronts, figures, tables; logged to the sweep-level MLflow run
   `pareto-summary` as well) on the results, with `--reference <out>/shipped_head.json`: the shipped
   head as a labelled star beside the sweep's points,
4. print where the Optuna journal, the MLflow store, the trained heads (one per grid point, in
   `<out>/checkpoints/mtpc-demo/<grid key>/head`, loadable with `MtpcModel.from_pretrained`) and the
   figures are, and how to open the UI on the experiment's runs table (the saved view `compare
   heads`: tracking/views.py).

Everything goes under `--out` (default `runs/demo`), the MLflow store too: the demo sets the spec's
`mlflow.tracking_uri` to `sqlite:///<out>/mlflow.db` (MLFLOW_TRACKING_URI still wins).

Trials train side by side (one worker per core), but their timed evaluations take a machine-wide
lock (experiments/evaluation/decoding.py) and training waits between steps while another trial times
(experiments.training.callbacks.YieldToTimer), so no latency is measured while another trial computes. The last
line says how long each step took.

Idempotent: a second run finds the model and the finished study and only redraws the analysis; a
run after a Ctrl-C resumes the interrupted trial from its checkpoint (not a failure: the exit code
is 0 once every point is COMPLETE, non-zero while a point has only failed trials). A demo started
while another one writes the same `--out` is refused (exit 2; a lock file in `--out`), and so are an
`--out` that is an existing file and `--workers` below 1, before anything is written.
Leaves out: anything SLURM (see `sbatch slurm/sweep.sh sweeps/smoke.yaml`).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "sweeps" / "smoke.yaml"
# smoke.yaml's training section swapped for the shipped default model; experiments/configs/default.yaml
# is already sized for a shared 2-core CPU (200 steps); k > 0 points train LoRA from the start
DEMO_TRAIN = {"config": "default", "model": {"lora_start_epoch": 0}}
# The demo's evaluation: acceptance offline (exact greedy cycles / expected sampling counts) on 32
# held-out prompts x 64 bytes; latency timed on the first 8 of them beside STP, one timer at a time.
# The objective is the derived throughput (offline bytes per cycle / timed latency per cycle): the
# acceptance of all 32 prompts, not of the 8 timed ones.
DEMO_EVAL = {
    "eval.n_prompts": 32,
    "eval.max_new_tokens": 64,
    "eval.acceptance": "offline",
    "eval.latency_prompts": 8,
    "objectives": [{"metric": "derived_throughput", "direction": "maximize"}],
}


class Phases:
    """The demo's numbered steps: each starts with a header line, and the end lists how long each took."""

    def __init__(self) -> None:
        self.t0 = time.time()
        self.done: list[tuple[str, float]] = []
        self._current: tuple[str, float] | None = None

    def step(self, msg: str) -> None:
        self.close()
        print(f"\n== [{time.time() - self.t0:6.0f} s] {msg}", flush=True)
        self._current = (msg.split(" ", 1)[0], time.time())

    def close(self) -> None:
        if self._current is not None:
            name, start = self._current
            self.done.append((name, time.time() - start))
            self._current = None

    def summary(self) -> str:
        self.close()
        return ", ".join(f"{name} {secs:.0f} s" for name, secs in self.done)


def example_head(spec) -> Path:
    """The head directory of the demo's LoRA point (the first grid point when there is none)."""
    from tracking.schema import grid_key

    point = next((p for p in spec.grid if p.get("lora_depth", 0) > 0), spec.grid[0])
    return spec.trial_dir(grid_key(point)) / "head"


SHIPPED_LINE_PROMPTS, SHIPPED_LINE_BYTES = (
    4,
    64,
)  # the demo's first line: a few held-out prompts, short answers


def shipped_head_line(prompts: int = SHIPPED_LINE_PROMPTS, new_bytes: int = SHIPPED_LINE_BYTES) -> str:
    """One line: the shipped default head's speed-up over plain decoding on a few held-out prompts,
    greedy and sampled (one round each, timed under the machine-wide timing lock; the reported figures
    are bench/bench_shipped_head.py's, on 3 x 32 prompts)."""
    from mtpc.shipped_heads import read_index, shipped_head_names

    if not shipped_head_names():
        return "shipped head: none in this installation"
    import torch

    from experiments.evaluation.config import EvalConfig
    from experiments.evaluation.prompts import load_prompt_sets
    from experiments.evaluation.speedup import measure_speedup
    from experiments.plumbing.timing_lock import timing
    from mtpc import MtpcModel
    from mtpc.names import DECODE_MODES

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = MtpcModel.from_pretrained("default")
        chosen = load_prompt_sets("heldout", prompts, 1, EvalConfig.seed)[0]
        with timing(progress=True):
            r = {m: measure_speedup(model, chosen, m, new_bytes, rounds=1, say=False) for m in DECODE_MODES}
    finally:
        torch.set_num_threads(threads)
    c = model.head.config
    return (
        f"shipped head {read_index()['default']} ({c.kind}, n={c.window}, r={c.rank}; "
        f'MtpcModel.from_pretrained("default")): {r["greedy"]["speedup_median"]:.2f}x plain decoding greedy '
        f"(output identical on {r['greedy']['identical']}), {r['sample']['speedup_median']:.2f}x sampled, "
        f"{r['greedy']['bytes_per_cycle']:.2f} / {r['sample']['bytes_per_cycle']:.2f} bytes per cycle, on "
        f"{prompts} held-out prompts x {new_bytes} bytes, one thread of this machine"
    )


SHIPPED_REFERENCE = "shipped_head.json"


def shipped_reference(spec, out: Path) -> Path | None:
    """The shipped default head as the Pareto plots' reference point: `<out>/shipped_head.json`
    (analysis/reference.py), None when no head ships.

    Measured as every sweep trial measures its head: `evaluate_heads` with the spec's `eval` section
    on the same prompt sets (`eval_prompt_sets`), the same acceptance method and timed subset beside
    STP, with the trials' CPU thread count (`train.run.cpu_threads`), under the machine-wide timing
    lock. The head decodes as it ships (its index's draft_len m; the label says m when m < n), and
    its runs name the backbone as the trials' do (`default`, not the head's `default@<sha8>` of the
    same model), so the analysis finds the setting they share. This is not the first line's figure
    (`shipped_head_line`: an interleaved wall-clock speed-up on a few prompts). Run before the
    sweep, in this process; a file from an earlier demo with the same head (its files' digests) and
    the same evaluation is reused, not measured again."""
    from mtpc.shipped_heads import read_index, shipped_head_names

    if not shipped_head_names():
        return None
    from analysis.reference import write_reference

    index = read_index()
    name = index["default"]
    threads = spec.train.run.cpu_threads
    source = json.loads(json.dumps({
        "head": name, "files": index["heads"][name]["files"], "eval": asdict(spec.eval), "cpu_threads": threads,
    }))  # fmt: skip  # as stored: tuples become lists
    path = out / SHIPPED_REFERENCE
    try:
        if json.loads(path.read_text(encoding="utf-8")).get("source") == source:
            return path
    except (OSError, ValueError, AttributeError):
        pass  # absent, unreadable or another head / evaluation: measured again
    import torch

    from experiments.evaluation.decoding import evaluate_heads
    from experiments.evaluation.prompts import eval_prompt_sets
    from mtpc import MtpcModel

    before = torch.get_num_threads()
    if threads:  # as the trials time (experiments/training/fit.py sets it before training and evaluating)
        torch.set_num_threads(int(threads))
    try:
        model = MtpcModel.from_pretrained("default")
        if spec.train.model.backbone == "default":
            # the trials' heads record the shipped model as `default`; this head's `default@<sha8>` is
            # that very model (resolve_head checked it), so its runs carry the name theirs do
            model.head.config.backbone = "default"
        sets, names = eval_prompt_sets(spec.eval)
        results = evaluate_heads({name: model}, sets, spec.eval, set_names=names, progress=False)
    finally:
        torch.set_num_threads(before)
    c, m = model.head.config, model.draft_len
    label = f"shipped {name}" + (f" (m={m})" if m < c.window else "")
    e = spec.eval
    about = (
        f"the shipped default head {name} ({c.kind}, n={c.window}, r={c.rank}, k={c.lora_depth}, draft_len m={m}) "
        "through the sweep trials' evaluation (experiments.evaluation.decoding.evaluate_heads with the sweep "
        f"spec's eval section: {e.acceptance} acceptance on {e.n_prompts} prompt(s) x {e.max_new_tokens} bytes "
        f"per set, latency timed on the first {e.latency_prompts} beside STP), {threads or 'default'} CPU "
        "thread(s) as the trials, in the demo's process under the timing lock"
    )
    return write_reference(path, label, results, about, source)


def reference_line(path: Path) -> str:
    """One line: what the reference point holds per mode (bytes per cycle, speed-up over STP) and where."""
    ref = json.loads(path.read_text(encoding="utf-8"))
    parts = []
    for row in ref["evaluation"]["summary"]:
        derived = row.get("derived_speedup_vs_stp")  # offline: the sweep's objective's ratio
        speedup = derived or row.get("speedup_vs_stp")
        parts.append(
            f"{row['mode']} {row['tokens_per_cycle']['mean']:.2f} bytes per cycle"
            + (f", {speedup['mean']:.2f}x plain decoding{' (derived)' if derived else ''}" if speedup else "")
        )
    return (
        f"reference point: {ref['label']} measured as the sweep's trials are: {'; '.join(parts)} "
        f"({_shown(path)}, drawn in the Pareto plots)"
    )


def analysis_args(spec, fig_dir: Path, reference: Path | None) -> list[str]:
    """`python -m analysis`'s arguments for the demo's sweep, with the shipped head's reference point."""
    args = ["--tracking-uri", spec.tracking_uri, "--experiment", spec.experiment, "--out", str(fig_dir)]
    return args + (["--reference", str(reference)] if reference is not None else [])


def _shown(path: Path) -> str:
    """`path` relative to the working directory when it lies below it (as a user would type it)."""
    rel = os.path.relpath(path)
    return path.as_posix() if rel.startswith("..") else Path(rel).as_posix()


def demo_overrides(out: Path, objective: str) -> dict:
    return {
        "study": "mtpc-demo",
        "objective": objective,
        "output_dir": str(out),
        "mlflow.tracking_uri": f"sqlite:///{out / 'mlflow.db'}",
        "mlflow.experiment": "mtpc-demo",
        "train": DEMO_TRAIN,
        **DEMO_EVAL,
    }


def status_command(out: Path) -> str:
    """The `--status` command of the demo's study in `out` (smoke.yaml with the demo's study and folder)."""
    return (
        f"python -m sweeps.run {SMOKE.relative_to(REPO)} --set study=mtpc-demo "
        f"--set output_dir={shlex.quote(str(out))} --status"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sweeps.demo", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out", default="runs/demo", help="results directory (journal, MLflow store, checkpoints, figures)"
    )
    ap.add_argument(
        "--workers",
        type=int,
        default=2,
        help="local worker processes (default 2: one per core; training uses 1 thread)",
    )
    ap.add_argument(
        "--objective",
        choices=("trial", "fixture"),
        default="trial",
        help="fixture: skip training (plumbing check)",
    )
    a = ap.parse_args(argv)
    phases = Phases()
    out = Path(a.out).resolve()
    problem = (
        f"--workers {a.workers}: expected at least 1 worker process"
        if a.workers < 1
        else f"--out {a.out}: {out} exists and is not a directory; give a folder for the demo's results"
        if out.exists() and not out.is_dir()
        else f"--out {a.out}: {out.parent} is not a directory"
        if not out.exists() and not _dir_or_absent(out.parent)
        else None
    )
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    from filelock import FileLock, Timeout

    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"error: --out {a.out}: cannot create {out} ({e.strerror or e})", file=sys.stderr)
        return 2
    lock = FileLock(str(out / ".demo.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        print(
            f"error: {out} is in use by another demo (lock {out / '.demo.lock'}); wait for it to finish "
            "or pass another --out",
            file=sys.stderr,
        )
        return 2
    try:
        return _demo(a, out, phases)
    finally:
        lock.release()


def _dir_or_absent(path: Path) -> bool:
    """No file stands where a folder of `path`'s (or `path` itself) is to be created."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path.is_dir()


def _demo(a: argparse.Namespace, out: Path, phases: Phases) -> int:
    """The demo's four steps in `out` (held by this process)."""
    from experiments.plumbing.quiet import quiet

    quiet()  # MLflow's store set-up and Optuna's study lines: the demo prints its own

    import tracking
    from sweeps import run
    from sweeps.spec import SpecError, load_spec
    from sweeps.study import StorageError

    try:
        spec = load_spec(SMOKE, overrides=demo_overrides(out, a.objective))
    except SpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.objective == "trial":
        phases.step("1/4 the shipped default model, its head and the bundled data (built once, then cached)")
        from mtpc.backbones.shipped import SHIPPED_DIR, verify_shipped
        from mtpc.data import sharegpt_corpus

        corpus = sharegpt_corpus()
        print(
            f"corpus: {len(corpus.train)} training conversations, {len(corpus.heldout_prompts)} held-out prompts"
        )
        print(f"model: {verify_shipped()} ({SHIPPED_DIR})")
        print(shipped_head_line())
        reference = shipped_reference(spec, out)
        if reference is not None:
            print(reference_line(reference))
    else:
        reference = None  # the plumbing objective's metrics are stand-ins: no measured head beside them
    phases.step(
        f"2/4 sweep {SMOKE.relative_to(REPO)} on the default model: {spec.n_trials} grid points, {a.workers} worker(s)"
        + " (training side by side, timing one at a time)"
    )
    try:
        exp_id = run.init(spec)["experiment_id"]
        if a.workers == 1:
            rc = run.worker(spec)
        else:
            sets = [
                x
                for k, v in demo_overrides(out, a.objective).items()
                for x in ("--set", f"{k}={json.dumps(v)}")
            ]
            rc = run.local_workers(spec, a.workers, sets)
    except (SpecError, StorageError, tracking.TrackingError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    st = run.status(spec)
    print(f"trials: {st['states']}")
    fig_dir = out / "analysis"
    phases.step("3/4 python -m analysis: Pareto fronts, figures and tables")
    cmd, env = run.python_module("analysis", *analysis_args(spec, fig_dir, reference))
    r = subprocess.run(cmd, cwd=REPO, env=env)
    if r.returncode != 0:
        print(f"python -m analysis exited with {r.returncode}", file=sys.stderr)
        rc = rc or r.returncode
    phases.step("4/4 where things are")
    print(f"Optuna study     : {spec.study} in {spec.storage}")
    print(f"MLflow store     : {spec.tracking_uri} (experiment {spec.experiment})")
    print(f"checkpoints/heads: {out / 'checkpoints' / spec.study}/<grid key>/head")
    head = example_head(spec)
    if (head / "config.json").is_file():
        print(f'load a head      : MtpcModel.from_pretrained("{_shown(head)}")')
    print(f"figures, tables  : {fig_dir}")
    print(f"trial states     : {status_command(out)}")
    print(
        f"open the UI      : mlflow ui --backend-store-uri {spec.tracking_uri} --host 127.0.0.1 --port 5000"
    )
    print(f"                   then browse {tracking.runs_url('http://127.0.0.1:5000', exp_id)}")
    print(f"demo took {time.time() - phases.t0:.0f} s ({phases.summary()}); exit code {rc}")
    # grid points whose every trial failed; a pre-empted trial that a re-run resumed is not one
    failed = len(st.get("failed_points", []))
    if failed:
        print(f"{failed} grid point(s) failed: see their `error` in `{status_command(out)}` or the log above")
    return rc if rc else (1 if failed else 0)


if __name__ == "__main__":
    sys.exit(main())
