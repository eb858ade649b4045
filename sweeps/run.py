"""The sweep runner CLI: `python -m sweeps.run SPEC (--check | --init | --worker | --task | --workers N
| --resume | --submit | --status)`.

- `--check`: validate the spec (every grid point's training config, its evaluation against the
  backbone's context), check both stores answer.
- `--init`: create the MLflow experiment and the Optuna study once, enqueue every grid point
  without a trial (idempotent, file-locked: sweeps/study.py).
- `--worker`: reap trials of dead workers, then run waiting trials until none are left
  (sweeps/worker.py); `--task` = `--init` then `--worker` in one process (what slurm/sweep.sh runs).
- `--workers N`: init, then N local worker processes, supervised: a worker that dies (killed,
  crashed) is waited for at once, so its trial counts as dead, and a replacement worker is started
  that reaps and retries that trial within the same run. `--resume` = init + workers
  (`-n N`, default 1), after re-enqueueing every point whose COMPLETE trials have lost their
  MLflow runs (a deleted or replaced tracking store; each named in a warning);
  `--retry-failed` also re-enqueues points whose trials all failed.
- `--submit`: validate, check that `sbatch` is on PATH, init, then `sbatch slurm/sweep.sh` with the
  spec's resources (a trial of several ranks: each array task holds its nodes, tasks and GPUs;
  `sbatch_resources`); no `sbatch`, or an sbatch that fails (no controller), is one line, exit 2. A
  worker in a SLURM job too small for one trial stops at once with exit code 2 (`check_allocation`).
- `--status`: trial counts per state, the RUNNING trials whose worker is gone, the FAIL trials
  with their errors (pre-empted trials that were re-enqueued apart, under `preempted`), the grid
  points whose every trial failed (`failed_points`) (JSON); before any run, one line saying that
  there is no study yet and where it looked.

Exit codes (of every mode; with `--workers`, the most serious code of its workers):
  0   done: no trial left waiting, and every grid point has a COMPLETE trial (or is still to run)
  1   an unexpected error (a bug): Python prints the traceback
  2   bad input: an invalid spec or option, or a store (the Optuna storage, the MLflow tracking
      store, the SLURM controller of --submit) that cannot be reached before any trial ran; one line
      on stderr, nothing consumed
  65  done, but grid points failed: every trial of each failed (a trial's error, not a worker's
      death); one line per point on stderr with its error; `--status` lists them,
      `--resume --retry-failed` runs them again (`--workers`, `--resume`, `--task`; a bare `--worker`,
      what the runner supervises, exits 0 and leaves the verdict to it)
  69  the MLflow tracking store stopped taking writes during the sweep: the attempt that hit it is
      FAIL with the tracking URI in its error and its point is enqueued again; the workers stopped
      taking trials; run `--resume` once the store answers (it also ends the runs left RUNNING)
  70  a local worker died and no replacement could be started (the budget of
      points x (max_retries + 1) replacements is spent); its trial is reaped by the next `--resume`
  75  stopped by SIGUSR1 / SIGTERM / SIGINT (pre-emption): the running trial checkpointed and stays
      RUNNING, to be resumed by the requeued task or reaped and re-run by `--resume`
Leaves out: the spec (sweeps/spec.py) and MLflow (tracking/).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import tracking
from sweeps.liveness import Owner, gone_workers
from sweeps.spec import SpecError, SweepSpec, load_spec, parse_sets
from sweeps.study import (
    PREEMPTED_ATTR,
    StorageError,
    check_storage,
    init,
    load_study,
    log,
    open_storage,
    requeue_lost_runs,
    validate_trial_configs,
)
from sweeps.worker import EXIT_PREEMPTED, EXIT_TRACKING, StopFlag, worker
from tracking.schema import grid_key

EXIT_BAD_INPUT = 2
EXIT_POINTS_FAILED = 65  # EX_DATAERR: the sweep ended, but grid points have only FAIL trials
EXIT_WORKER_DIED = 70  # EX_SOFTWARE
#: worker exit codes that end a worker on purpose (anything else is a death: replaced)
_DELIBERATE = {0, EXIT_BAD_INPUT, EXIT_TRACKING, EXIT_PREEMPTED}
#: the order in which the runner reports its workers' codes: the first one present wins
_SEVERITY = (EXIT_BAD_INPUT, EXIT_TRACKING, EXIT_PREEMPTED, EXIT_WORKER_DIED)
POLL_S = 0.2


ROOT = Path(__file__).resolve().parents[1]


def python_module(module: str, *args: str) -> tuple[list[str], dict[str, str]]:
    """The command and environment of a child `python -m module args` of the suite: PYTHONSAFEPATH=1
    keeps the current directory off its import path (and its children's); this checkout goes on
    PYTHONPATH when this process imported it from a path entry (not from an installed package), so
    the child runs the same code."""
    env = dict(os.environ, PYTHONSAFEPATH="1")
    if str(ROOT) in {os.path.realpath(p or os.curdir) for p in sys.path}:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return [sys.executable, "-m", module, *args], env


def local_workers(spec: SweepSpec, n: int, extra: list[str]) -> int:
    """Start n worker processes and supervise them until all have exited; returns the runner's
    exit code. SIGINT/SIGTERM/SIGUSR1 are forwarded to the workers."""
    cmd, env = python_module("sweeps.run", str(spec.path), "--worker", *extra)
    live: dict[int, subprocess.Popen] = {}
    codes: list[int] = []
    stopping: list[int] = []
    budget = spec.n_trials * (spec.max_retries + 1)

    def start() -> None:
        p = subprocess.Popen(cmd, env=env)
        live[p.pid] = p

    def forward(signum, _frame) -> None:
        stopping.append(signum)
        for p in live.values():
            if p.poll() is None:
                p.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in StopFlag.SIGNALS}
    try:
        for _ in range(n):
            start()
        log(f"started {n} worker(s): pids {sorted(live)}")
        while live:
            for pid, p in list(live.items()):
                rc = p.poll()  # waits for an exited worker at once: no zombie passes for alive
                if rc is None:
                    continue
                del live[pid]
                if rc in _DELIBERATE:
                    codes.append(rc)
                    if rc:
                        log(f"worker pid {pid} exited with {rc}")
                    continue
                how = f"was killed by {signal.Signals(-rc).name}" if rc < 0 else f"crashed (exit code {rc})"
                if stopping:
                    codes.append(EXIT_PREEMPTED)
                    log(f"worker pid {pid} {how} while stopping")
                elif budget > 0:
                    budget -= 1
                    start()
                    log(f"worker pid {pid} {how}: its trial is reaped and retried by a replacement worker")
                else:
                    codes.append(EXIT_WORKER_DIED)
                    log(
                        f"error: worker pid {pid} {how} and the replacement budget is spent; "
                        "its trial stays RUNNING until `--resume` reaps it"
                    )
            time.sleep(POLL_S)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if stopping and EXIT_PREEMPTED not in codes:
        codes.append(EXIT_PREEMPTED)
    return next((c for c in _SEVERITY if c in codes), 0)


def no_study(spec: SweepSpec) -> str:
    """The line `--status` prints before any run: no study yet, and where it looked."""
    return (
        f"no study {spec.study!r} yet in {spec.storage}: nothing has run with this spec there; "
        f"start it with `python -m sweeps.run {spec.path} --workers N` (or --init)"
    )


def status(spec: SweepSpec) -> dict[str, Any]:
    """Trial counts per state, RUNNING trials whose worker is gone, FAIL trials with their error
    (pre-empted ones, re-enqueued without spending a retry, apart), the grid points that failed.
    Before any run (no journal file, or no such study in it): {"exists": False, "storage": ...}."""
    from optuna.trial import TrialState

    path = spec.storage[len("journal:") :] if spec.storage.startswith("journal:") else None
    if path is not None and not Path(path).is_file():  # Optuna would create it (and fail in a missing folder)
        return {"study": spec.study, "exists": False, "storage": spec.storage}
    storage = open_storage(spec.storage)
    study = load_study(spec, storage)
    if study is None:
        return {"study": spec.study, "exists": False, "storage": spec.storage}
    counts: dict[str, int] = {}
    failed, preempted = [], []
    for t in study.get_trials(deepcopy=False):
        counts[t.state.name] = counts.get(t.state.name, 0) + 1
        if t.state == TrialState.FAIL:
            entry = {"trial": t.number, "grid_key": t.user_attrs.get("grid_key"),
                     "error": str(t.user_attrs.get("error", ""))[:300]}  # fmt: skip
            (preempted if t.user_attrs.get(PREEMPTED_ATTR) else failed).append(entry)
    return {"study": spec.study, "exists": True, "points": spec.n_trials, "states": counts,
            "worker_gone": gone_workers(spec, study, Owner.current()), "failed": failed, "preempted": preempted,
            "failed_points": failed_points(spec, study)}  # fmt: skip


def failed_points(spec: SweepSpec, study=None) -> list[dict[str, Any]]:
    """The grid points whose every trial is FAIL (none COMPLETE, none waiting or running), each with
    the error of its last trial: what makes a finished sweep exit EXIT_POINTS_FAILED. A trial failed
    by the reaper and enqueued again (a dead or pre-empted worker) is not one: its retry decides."""
    from optuna.trial import TrialState

    if spec.grid is None:
        return []
    if study is None:
        study = load_study(spec, open_storage(spec.storage))
        if study is None:
            return []
    by_key: dict[str, list] = {}
    for t in study.get_trials(deepcopy=False):
        by_key.setdefault(t.user_attrs.get("grid_key", ""), []).append(t)
    out = []
    for point in spec.grid:
        ts = sorted(by_key.get(grid_key(point), []), key=lambda t: t.number)
        if ts and all(t.state == TrialState.FAIL for t in ts):
            out.append({"grid_key": grid_key(point), "trials": [t.number for t in ts],
                        "error": str(ts[-1].user_attrs.get("error", ""))[:300]})  # fmt: skip
    return out


def finished(spec: SweepSpec, rc: int) -> int:
    """The exit code of a sweep whose workers returned `rc`: EXIT_POINTS_FAILED (with one line per
    failed point) when they all finished (0) but grid points failed."""
    if rc != 0:
        return rc
    failed = failed_points(spec)
    for p in failed:
        log(f"error: grid point {p['grid_key']} failed (trial(s) {p['trials']}): {p['error']}")
    if failed:
        log(
            f"{len(failed)} of {spec.n_trials} grid point(s) failed; `--status` lists them, "
            "`--resume --retry-failed` runs them again"
        )
        return EXIT_POINTS_FAILED
    return 0


def submit(spec: SweepSpec, script: Path, extra: list[str] = (), dry_run: bool = False) -> list[str]:
    """Init, then sbatch the array with the spec's resources; `extra` (e.g. --set overrides) is
    passed on to every task's `sweeps.run` so the tasks see the same spec as this process. No
    `sbatch` on PATH (checked after the stores, before init) or an sbatch that fails: SubmitError in one line."""
    check_storage(spec.storage)  # the stores first: an unreachable one is named before SLURM is
    tracking.check_tracking(spec.tracking_uri)
    if not dry_run and shutil.which("sbatch") is None:
        raise SubmitError(
            "sbatch not found on PATH: --submit needs a SLURM client and controller "
            "(run locally with `--workers N`, or `slurm/local_cluster.sh start DIR`)"
        )
    init(spec)
    cmd = ["sbatch", *sbatch_resources(spec), f"--job-name={spec.study}", str(script), str(spec.path), *extra]
    log("submitting: " + " ".join(cmd))
    if not dry_run:
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as e:
            raise SubmitError(f"sbatch could not be run: {e}") from None
        if r.returncode != 0:
            said = " ".join((r.stderr or r.stdout).split())[-500:] or "no message"
            raise SubmitError(
                f"sbatch failed (exit code {r.returncode}): {said}; nothing was submitted "
                "(the study is initialised; submit again once SLURM answers)"
            )
        print(r.stdout, end="", flush=True)  # "Submitted batch job <id>"
    return cmd


class SubmitError(RuntimeError):
    """sbatch is missing or refused the job: one line, exit 2."""


def sbatch_resources(spec: SweepSpec) -> list[str]:
    """The sbatch options of the spec's `slurm` section: an array of `tasks` elements, each holding one
    trial's devices (a multi-rank trial: its nodes, one task per rank, the GPUs per node)."""
    s = spec.slurm
    cmd = [f"--array=0-{s.tasks - 1}"]
    if s.ranks > 1 or s.nodes_per_trial > 1:
        cmd += [
            f"--nodes={s.nodes_per_trial}",
            f"--ntasks={s.ranks}",
            f"--ntasks-per-node={s.tasks_per_node}",
        ]
    else:
        cmd.append("--ntasks=1")
    cmd += [f"--cpus-per-task={s.cpus_per_task}", f"--mem={s.mem}", f"--time={s.time}"]
    if s.partition:
        cmd.append(f"--partition={s.partition}")
    if s.gpus_per_trial:
        cmd.append(f"--gpus-per-node={s.trial_gpus_per_node}")
    elif s.gpus:
        cmd.append(f"--gpus-per-task={s.gpus}")
    return cmd + list(s.extra_args)


def check_allocation(spec: SweepSpec, env: dict[str, str] | None = None) -> None:
    """Inside a SLURM job, SpecError (naming the slurm key) unless the job holds one trial's ranks and
    nodes: a plain `sbatch slurm/sweep.sh SPEC` gets the script's one task, not the spec's resources."""
    import os

    env = os.environ if env is None else env
    s = spec.slurm
    if "SLURM_JOB_ID" not in env or (s.ranks == 1 and s.nodes_per_trial == 1) or spec.trial_kind != "trial":
        return
    tasks, nodes = (
        int(env.get("SLURM_NTASKS", "1")),
        int(env.get("SLURM_JOB_NUM_NODES", env.get("SLURM_NNODES", "1"))),
    )
    if tasks < s.ranks or nodes < s.nodes_per_trial:
        need = " ".join(sbatch_resources(spec)[1:4])
        raise SpecError(
            f"{spec.path}: key 'slurm.tasks_per_trial': a trial takes {s.ranks} task(s) on "
            f"{s.nodes_per_trial} node(s) but SLURM job {env['SLURM_JOB_ID']} has {tasks} task(s) on {nodes} "
            f"node(s): submit with `python -m sweeps.run SPEC --submit`, or `sbatch {need} ... slurm/sweep.sh SPEC`"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sweeps.run", description=__doc__.split("\n\n")[0],
                                 epilog="Exit codes: 0 done, 1 bug, 2 bad input or store unreachable at start, "
                                        "69 tracking store lost mid-sweep, 70 a worker died unreplaced, 75 stopped by a signal "
                                        "(details: the module docstring, docs/sweeps.md).")  # fmt: skip
    ap.add_argument("spec", help="sweep YAML (sweeps/*.yaml)")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument(
        "--check", action="store_true", help="validate the spec and check the stores can be reached"
    )
    g.add_argument("--init", action="store_true", help="create study + experiment, enqueue the grid")
    g.add_argument("--worker", action="store_true", help="run trials until none are waiting")
    g.add_argument(
        "--task", action="store_true", help="--init then --worker in one process (what slurm/sweep.sh runs)"
    )
    g.add_argument("--workers", type=int, metavar="N", help="init, then N supervised local worker processes")
    g.add_argument(
        "--resume",
        action="store_true",
        help="init, reap dead trials, then workers (--n-workers N, default 1)",
    )
    g.add_argument(
        "--submit", action="store_true", help="init, then sbatch slurm/sweep.sh with the spec's resources"
    )
    g.add_argument(
        "--status",
        action="store_true",
        help="print trial counts, trials whose worker is gone, failures (JSON)",
    )
    ap.add_argument("-n", "--n-workers", type=int, default=1, help="workers for --resume")
    ap.add_argument(
        "--retry-failed",
        action="store_true",
        help="with --init/--resume: re-enqueue points whose trials all failed",
    )
    ap.add_argument("--max-trials", type=int, default=None, help="a worker stops after this many trials")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a spec key (YAML value), e.g. train.backbone=default",
    )
    a = ap.parse_args(argv)
    from experiments.plumbing.quiet import quiet

    quiet()  # MLflow's store set-up and Optuna's study lines: the runner logs its own
    try:
        overrides = parse_sets(a.set)
        spec = load_spec(a.spec, overrides=overrides)
        extra = [x for kv in a.set for x in ("--set", kv)]
        if a.max_trials is not None:
            extra += ["--max-trials", str(a.max_trials)]
        if a.check:
            check_storage(spec.storage)
            tracking.check_tracking(spec.tracking_uri)
            validate_trial_configs(spec)
            print(
                json.dumps(
                    {
                        "study": spec.study,
                        "points": spec.n_trials,
                        "storage": spec.storage,
                        "tracking_uri": spec.tracking_uri,
                    }
                )
            )
            return 0
        if a.init:
            init(spec, retry_failed=a.retry_failed)
            return 0
        if a.worker or a.task:
            stop = StopFlag()
            stop.install()
            check_allocation(spec)
            if a.task:
                init(spec, retry_failed=a.retry_failed)
            rc = worker(spec, max_trials=a.max_trials, stop=stop)
            # a supervised local worker (`--worker`) leaves the verdict on failed points to its runner
            return finished(spec, rc) if a.task else rc
        if a.workers is not None or a.resume:
            n = a.workers if a.workers is not None else a.n_workers
            if n < 1:
                raise SpecError(f"--workers {n}: expected >= 1")
            init(spec, retry_failed=a.retry_failed)
            if a.resume:
                requeue_lost_runs(spec)  # trials COMPLETE in Optuna whose MLflow runs are gone
            return finished(spec, local_workers(spec, n, extra))
        if a.submit:
            submit(spec, Path(__file__).resolve().parent.parent / "slurm" / "sweep.sh", extra)
            return 0
        if a.status:
            st = status(spec)
            if not st["exists"]:
                print(no_study(spec), file=sys.stderr)
            print(json.dumps(st))
            return 0
    except (SpecError, StorageError, SubmitError, tracking.TrackingError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


if __name__ == "__main__":
    sys.exit(main())
