"""Benchmark of the circuit engine on CPU: training forward+backward and the batch-1 draft.

  training: raw head logits (B windows, requires_grad) -> normalize -> log q(x) -> mean window NLL
            -> backward; reported per 1k windows (also with all prefix marginals, what the loss uses);
            the kinds at one (n, r) run interleaved round by round and the ratio to cp is the median
            of per-round ratios (the machine is shared: ratios side by side, DESIGN section 7).
  draft:    batch 1, prefix of length 1 (what the decoding loop calls every cycle): the fused
            `_draft` (sample + conditionals of the sampled window), the unfused `_sample` then
            `_conditionals`, the greedy draft, and `normalize` of raw logits, at 1 and 2 threads,
            under torch.inference_mode (draft also under plain no_grad, which costs more per op).

Medians of repeated runs, as wall time and as process CPU time (robust to waiting for a core on a
shared machine; the bars are judged on it); the machine (CPU model, cores, torch, load average) is
written with the numbers. Usage:  python bench/bench_circuits.py --out bench/results/circuits_cpu.json
Leaves out: the head's unembedding (mtpc/heads.py) and the backbone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mtpc.circuits import build_circuit  # noqa: E402
from mtpc.names import CIRCUIT_KINDS, point_rank  # noqa: E402
from tracking import runs  # noqa: E402


def machine() -> dict:
    m = runs.machine()
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        sha = ""
    return {
        **m,
        "cores": m["cpu_count"],  # the names earlier results used
        "default_threads": m["threads"],
        "loadavg_start": list(os.getloadavg()),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git": sha,
    }


def timed(fn, reps: int, warmup: int, min_time: float = 0.0, max_time: float = 3.0) -> tuple[float, float]:
    """(median wall seconds, median process-CPU seconds) of one call, over `reps` calls (at least
    min_time s; fewer, >= 5, past max_time s). CPU time leaves out the time the process waits for a
    core, which dominates wall-time noise on a shared machine."""
    for _ in range(warmup):
        fn()
    wall, cpu = [], []
    start = time.perf_counter()
    while len(wall) < reps or time.perf_counter() - start < min_time:
        t, c = time.perf_counter(), time.process_time()
        fn()
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - t)
        if len(wall) >= 5 and time.perf_counter() - start > max_time:
            break
    return statistics.median(wall), statistics.median(cpu)


def configs(kinds, windows, ranks):
    for kind in kinds:
        for n in windows:
            for r in sorted({point_rank(kind, r) for r in ranks}):
                yield kind, n, r


def bench_train_group(kinds, n, r, v, budget_elems, reps, generator) -> list[dict]:
    """All kinds at one (n, r), the same batch, steps interleaved round by round so that the
    ratios between kinds are measured side by side under the same machine load."""
    batch = int(min(1024, max(16, budget_elems // (n * r * v))))
    x = torch.randint(0, v, (batch, n), generator=generator)
    steps = {}
    for kind in kinds:
        c = build_circuit(kind, window=n, rank=r, vocab=v)
        raw = {
            k: torch.randn((batch, *s), generator=generator).requires_grad_(True)
            for k, s in c.param_shapes.items()
        }

        def step(c=c, raw=raw, prefix=False):
            q = c.normalize(raw)
            out = c._prefix_log_marginals(q, x) if prefix else c._log_prob(q, x)
            (-out.mean()).backward()  # mean window NLL (or mean prefix marginal)
            for t in raw.values():
                t.grad = None

        steps[kind] = step
    wall = {(kind, pre): [] for kind in kinds for pre in (False, True)}
    cpu = {(kind, pre): [] for kind in kinds for pre in (False, True)}
    for round_ in range(reps + 1):  # round 0 is the warm-up
        for kind in kinds:
            for pre in (False, True):
                t, c = time.perf_counter(), time.process_time()
                steps[kind](prefix=pre)
                if round_:
                    cpu[(kind, pre)].append(time.process_time() - c)
                    wall[(kind, pre)].append(time.perf_counter() - t)
    rows = []
    for kind in kinds:
        row = {"kind": kind, "n": n, "r": r, "v": v, "batch": batch}
        for pre, name in ((False, "nll"), (True, "prefix")):
            row[f"train_{name}_ms_per_1k"] = 1e6 * statistics.median(wall[(kind, pre)]) / batch
            row[f"train_{name}_cpu_ms_per_1k"] = 1e6 * statistics.median(cpu[(kind, pre)]) / batch
            if "cp" in kinds and kind != "cp":  # median over rounds of the per-round CPU-time ratio to cp
                ratios = [a / b for a, b in zip(cpu[(kind, pre)], cpu[("cp", pre)], strict=True)]
                row[f"{name}_over_cp"] = statistics.median(ratios)
                q1, _, q3 = statistics.quantiles(ratios, n=4)
                row[f"{name}_over_cp_iqr"] = [q1, q3]
        rows.append(row)
    return rows


@torch.inference_mode()
def bench_draft(kind, n, r, v, reps, threads, generator) -> dict:
    torch.set_num_threads(threads)
    c = build_circuit(kind, window=n, rank=r, vocab=v)
    raw = {k: torch.randn((1, *s), generator=generator) for k, s in c.param_shapes.items()}
    q = c.normalize(raw)
    prefix = torch.randint(0, v, (1, 1), generator=generator)
    g = torch.Generator().manual_seed(0)
    x = c._sample(q, g, prefix)
    out = {"kind": kind, "n": n, "r": r, "v": v, "threads": threads}

    def put(name, fn, warmup=10):
        w, cpu = timed(fn, reps, warmup, 0.2)
        out[f"{name}_ms"], out[f"{name}_cpu_ms"] = 1e3 * w, 1e3 * cpu

    put("draft", lambda: c._draft(q, prefix, g), 20)
    with torch.inference_mode(False), torch.no_grad():  # what a caller without inference_mode pays
        qn = c.normalize({k: t.clone() for k, t in raw.items()})
        put("draft_no_grad", lambda: c._draft(qn, prefix.clone(), g), 20)
    put("sample_then_conditionals", lambda: c._conditionals(q, c._sample(q, g, prefix)))
    put("greedy_draft", lambda: c._draft(q, prefix, g, greedy=True))
    put("normalize", lambda: c.normalize(raw))
    put("conditionals", lambda: c._conditionals(q, x))
    return out


def table(rows, cols) -> str:
    head = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n"
    body = ""
    for row in rows:
        body += (
            "| "
            + " | ".join(f"{row[c]:.3f}" if isinstance(row[c], float) else str(row[c]) for c in cols)
            + " |\n"
        )
    return head + body


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench/results/circuits_cpu.json"))
    ap.add_argument("--kinds", nargs="+", default=list(CIRCUIT_KINDS), choices=CIRCUIT_KINDS)
    ap.add_argument("--windows", nargs="+", type=int, default=[8, 16])
    ap.add_argument("--ranks", nargs="+", type=int, default=[1, 8, 32, 128])
    ap.add_argument("--vocab", type=int, default=320)
    ap.add_argument(
        "--train-elems", type=int, default=8_000_000, help="batch = this / (n r v), clamped to [16, 1024]"
    )
    ap.add_argument("--train-reps", type=int, default=15, help="interleaved rounds per (n, r)")
    ap.add_argument(
        "--train-threads",
        type=int,
        default=1,
        help="1 by default: on a shared, oversubscribed CPU, multi-threaded ops stall on descheduled threads",
    )
    ap.add_argument("--draft-reps", type=int, default=200)
    ap.add_argument(
        "--draft-threads",
        nargs="+",
        type=int,
        default=[1],
        help="intra-op threads for the batch-1 draft (2 stalls on an oversubscribed CPU)",
    )
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--skip-draft", action="store_true")
    args = ap.parse_args(argv)
    if any(n < 1 for n in args.windows) or any(r < 1 for r in args.ranks):
        ap.error("--windows and --ranks must be >= 1")

    info = machine()
    gen = torch.Generator().manual_seed(0)
    train, draft = [], []
    if not args.skip_train:
        torch.set_num_threads(args.train_threads)
        # a discarded warm-up group: the first steps of a process pay one-off allocation and init costs
        warm = [k for k in args.kinds if k != "ff" or args.ranks[0] == 1]
        bench_train_group(warm, args.windows[0], args.ranks[0], args.vocab, args.train_elems, 2, gen)
        for n in args.windows:
            for r in args.ranks:
                kinds = [k for k in args.kinds if k != "ff" or r == 1]
                for row in bench_train_group(kinds, n, r, args.vocab, args.train_elems, args.train_reps, gen):
                    print(json.dumps(row), flush=True)
                    train.append(row)
    for threads in [] if args.skip_draft else args.draft_threads:
        for kind, n, r in configs(args.kinds, args.windows, args.ranks):
            row = bench_draft(kind, n, r, args.vocab, args.draft_reps, threads, gen)
            print(json.dumps(row), flush=True)
            draft.append(row)
    info["loadavg_end"] = list(os.getloadavg())

    checks = {}
    for row in draft:
        if (row["kind"], row["n"], row["r"]) == ("btree", 16, 32):
            t = row["threads"]
            checks[f"btree_draft_n16_r32_v{row['v']}_threads{t}_ms"] = row["draft_ms"]
            checks[f"btree_draft_n16_r32_v{row['v']}_threads{t}_cpu_ms"] = row["draft_cpu_ms"]
    for row in train:
        if row["kind"] == "btree" and "nll_over_cp" in row:
            checks[f"btree_over_cp_train_nll_cpu_n{row['n']}_r{row['r']}"] = row["nll_over_cp"]
            checks[f"btree_over_cp_train_prefix_cpu_n{row['n']}_r{row['r']}"] = row["prefix_over_cp"]
    result = {
        "machine": info,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "train": train,
        "draft": draft,
        "checks": checks,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for row in train:
        row.setdefault("nll_over_cp", float("nan") if row["kind"] != "cp" else 1.0)
        row.setdefault("prefix_over_cp", float("nan") if row["kind"] != "cp" else 1.0)
    print(
        table(
            train,
            [
                "kind",
                "n",
                "r",
                "batch",
                "train_nll_cpu_ms_per_1k",
                "nll_over_cp",
                "train_prefix_cpu_ms_per_1k",
                "prefix_over_cp",
                "train_nll_ms_per_1k",
            ],
        )
        if train
        else ""
    )
    print(
        table(
            draft,
            [
                "kind",
                "n",
                "r",
                "threads",
                "draft_ms",
                "draft_cpu_ms",
                "draft_no_grad_ms",
                "sample_then_conditionals_ms",
                "greedy_draft_ms",
                "normalize_ms",
            ],
        )
    )
    print(json.dumps(checks, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    from experiments.plumbing.timing_lock import timing

    with timing(progress=True):  # one timer on the machine; the background pre-training paused
        main()
