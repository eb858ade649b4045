"""Trials per minute of a sweep's stores at 1, 4 and 8 workers: which Optuna store to pick at what scale.

`python bench/bench_sweep_store.py --out bench/results/sweep_store_cpu.json` runs the fixture objective
(no torch: each trial is `steps` sleeps of `step_seconds` plus its Optuna and MLflow traffic) over a
grid of 16 points with `python -m sweeps.run SPEC --workers W`, for each store:

- `journal`: the one-file default (Optuna journal on the shared folder, MLflow sqlite file);
- `postgres`: a PostgreSQL server (sweeps/local_postgres.sh, 127.0.0.1) as the Optuna storage and as
  the backend store of an `mlflow server`.

and reports wall time and trials per minute of the whole run (worker start-up included: on a
cluster every array task pays it too). On a 2-core machine W > 2 measures contention as much as the
store; the figure that transfers is how the store's share of a trial grows with W. The background
pre-training (if any) is paused while it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from experiments.plumbing.timing_lock import timing  # noqa: E402
from tests.sweep_helpers import fixture_spec, fresh_tracking_uri, start_server, stop_server  # noqa: E402
from tracking.runs import machine  # noqa: E402

SCRIPT = REPO / "sweeps" / "local_postgres.sh"


GRID = {"a": {"circuit": ["cp", "hmm"], "rank": [2, 4], "window": [4, 8], "lora_depth": [0, 1]}}
POINTS = 16


def _run(
    tmp: Path, study: str, workers: int, steps: int, step_seconds: float, storage: str | None, uri: str
) -> float:
    extra = {"storage": storage} if storage else {}
    spec = fixture_spec(
        tmp,
        study,
        tracking_uri=uri,
        space={"kind": "grid", "slices": GRID},
        fixture={"steps": steps, "step_seconds": step_seconds},
        **extra,
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("MTPC_OPTUNA_STORAGE", None)
    t = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "sweeps.run", str(spec), "--workers", str(workers)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    dt = time.perf_counter() - t
    if r.returncode != 0:
        raise RuntimeError(f"{study}: sweeps.run exited {r.returncode}: {r.stderr[-1000:]}")
    return dt


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--step-seconds", type=float, default=0.25)
    ap.add_argument("--stores", nargs="+", default=["journal", "postgres"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="mtpc-store-bench-") as d, timing():
        d = Path(d)
        pg = None
        if "postgres" in args.stores:
            r = subprocess.run(["bash", str(SCRIPT), "start"], capture_output=True, text=True, check=True)
            pg = dict(
                line[len("export ") :].split("=", 1)
                for line in r.stdout.splitlines()
                if line.startswith("export ")
            )
        try:
            for store in args.stores:
                for w in args.workers:
                    study = f"{store}{w}"
                    tmp = d / study
                    tmp.mkdir()
                    if store == "journal":
                        dt = _run(
                            tmp,
                            study,
                            w,
                            args.steps,
                            args.step_seconds,
                            None,
                            fresh_tracking_uri(tmp / "mlflow"),
                        )
                    else:
                        for db in (f"optuna_{w}", f"mlflow_{w}"):
                            subprocess.run(
                                ["bash", str(SCRIPT), "createdb", pg["MTPC_PG_DIR"], db], check=True
                            )
                        proc, uri = start_server(tmp / "server", backend=f"{pg['MTPC_PG_URL']}/mlflow_{w}")
                        try:
                            dt = _run(
                                tmp,
                                study,
                                w,
                                args.steps,
                                args.step_seconds,
                                f"{pg['MTPC_PG_URL']}/optuna_{w}",
                                uri,
                            )
                        finally:
                            stop_server(proc)
                    row = {
                        "store": store,
                        "workers": w,
                        "points": POINTS,
                        "wall_s": dt,
                        "trials_per_minute": POINTS / dt * 60,
                        "sleep_per_trial_s": args.steps * args.step_seconds,
                    }
                    results.append(row)
                    print(
                        f"{store:9s} {w} workers: {dt:6.1f} s, {row['trials_per_minute']:5.1f} trials/min",
                        flush=True,
                    )
        finally:
            if pg:
                subprocess.run(["bash", str(SCRIPT), "stop", pg["MTPC_PG_DIR"]], capture_output=True)
    out = {
        "results": results,
        "machine": machine(),
        "command": "python bench/bench_sweep_store.py " + " ".join(argv or sys.argv[1:]),
    }
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
