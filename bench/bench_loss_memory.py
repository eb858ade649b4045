"""Benchmark: the chunked window loss (custom autograd Function) against the naive one, and the
chunked distillation loss (beta KL + (1 - beta) CE, `--against ce`) against the chunked CE loss.

For each circuit kind, two fresh subprocesses (naive = all (S, n, r, v) logits materialised;
chunked = `window_loss(..., chunk_size=C)`) each build the same seeded head and batch, run one
warm-up plus `--repeats` forward+backward steps (e requires grad, as with a LoRA draft top), and
report the median step time and the peak RSS above what the process held before the first step
minus the gradient tensors (= peak working memory above parameters and their gradients). The
parent compares the two runs' loss (relative error <= 1e-5) and gradients (per tensor,
max|chunked - naive| <= 1e-4 x max|naive|: elementwise rtol is meaningless for float32 sums with
cancellation; tests/test_losses.py checks float64 agreement to 1e-10 elementwise), and checks
memory <= 1/4 of naive and time <= 1.3x. `--rounds` repeats naive/chunked alternately (fresh
processes each) so that load from other jobs hits both; times are the median over all rounds. Results go to JSON (`--out`).

`--against ce` compares instead, for each leaf form in `--leaf-delta-ranks` (0 = full unembedding,
k > 0 = App. G), the chunked CE loss ("chunked") with the chunked distillation loss ("kl": a seeded
random teacher (S, v), kl_beta 0.5): bars peak memory <= 1.5x and time <= 1.5x the CE loss. The two
losses differ, so no loss/gradient agreement is checked there (tests/mtpc/test_losses_kl.py checks
the distillation loss against a direct computation in float64).

CPU only; numbers depend on the machine and on other load (reported: cpu count, load average).

    python bench/bench_loss_memory.py --out bench/results/loss_memory_cpu.json
    python bench/bench_loss_memory.py --against ce --kinds cp,btree --leaf-delta-ranks 0,16 \
        --out bench/results/loss_memory_kl_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmRSS not found in /proc/self/status")


def worker(args: argparse.Namespace) -> None:
    """One mode in this (fresh) process; prints one JSON line, saves loss + grads to args.grads."""
    import torch

    from mtpc.heads import HeadConfig, MtpcHead
    from mtpc.losses import window_loss
    from mtpc.names import point_rank

    torch.manual_seed(0)
    S, n, r, v, d = args.seq_len, args.window, args.rank, args.vocab, args.hidden
    rank = point_rank(args.kind, r)
    head = MtpcHead(HeadConfig(args.kind, n, rank, v, d, leaf_delta_rank=args.leaf_delta_rank))
    head.init_from_unembeddings(torch.randn(min(n, 8), v, d) * d**-0.5, noise=0.05)
    with torch.no_grad():
        for w in head.sum_weight.values():
            w.normal_(0.0, 0.02)  # a trained-looking head: sums depend on e
    ids = torch.randint(0, 256, (1, S))
    e = torch.randn(1, S, d, requires_grad=True)
    # two packed documents, each a user turn (not scored) then an assistant turn (scored)
    doc = torch.zeros(1, S, dtype=torch.long)
    doc[:, S // 2 :] = 1
    pos = torch.arange(S) % (S // 2)
    score = (pos >= (S // 2) // 5).unsqueeze(0)  # (1, S): 80 % assistant bytes
    chunk = None if args.mode == "naive" else args.chunk_size
    teacher = torch.randn(1, S, v) * 2.0 if args.mode == "kl" else None  # seeded, like the rest
    kl = dict(teacher_logits=teacher, kl_beta=0.5) if teacher is not None else {}

    rss_before = _rss_bytes()
    times = []
    for _ in range(1 + args.repeats):
        head.zero_grad(set_to_none=True)  # what optimizer.zero_grad() does by default
        e.grad = None
        t0 = time.perf_counter()
        out = window_loss(head, e, ids, score, doc, chunk_size=chunk, **kl)
        out.loss.backward()
        times.append(time.perf_counter() - t0)
        loss = out.loss.item()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    grads = {name: p.grad for name, p in head.named_parameters()}
    grads["e"] = e.grad
    grad_bytes = sum(g.numel() * g.element_size() for g in grads.values())
    param_bytes = sum(p.numel() * p.element_size() for p in head.parameters())
    torch.save({"loss": loss, "grads": grads}, args.grads)
    print(
        json.dumps(
            {
                "mode": args.mode,
                "kind": args.kind,
                "leaf_delta_rank": args.leaf_delta_rank,
                "loss": loss,
                "times_s": times[1:],
                "median_s": statistics.median(times[1:]),
                "peak_rss_bytes": peak,
                "rss_before_bytes": rss_before,
                "grad_bytes": grad_bytes,
                "param_bytes": param_bytes,
                "peak_above_params_and_grads_bytes": peak - rss_before - grad_bytes,
            }
        )
    )


def compare(naive_path: str, chunked_path: str) -> dict:
    import torch

    a, b = torch.load(naive_path), torch.load(chunked_path)
    loss_rel = abs(a["loss"] - b["loss"]) / abs(a["loss"])
    worst, ok = {}, True
    for name, ref in a["grads"].items():
        got = b["grads"][name]
        scale = ref.abs().max().item()
        rel = (got - ref).abs().max().item() / max(scale, 1e-30)
        ok &= rel <= 1e-4
        worst[name] = {
            "max_abs_err_over_max_abs": rel,
            "norm_rel_err": ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item(),
            # elementwise rtol on float32 sums with cancellation is rounding-dominated; informative only
            "elementwise_allclose_rtol1e-4_atol1e-6max": torch.allclose(
                got, ref, rtol=1e-4, atol=1e-6 * scale
            ),
        }
    return {"loss_rel_err": loss_rel, "loss_ok": loss_rel <= 1e-5, "grads_ok": bool(ok), "grads": worst}


def run_mode(mode: str, kind: str, delta: int, args: argparse.Namespace, grads_path: str) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        mode,
        "--kind",
        kind,
        "--grads",
        grads_path,
        "--leaf-delta-rank",
        str(delta),
    ]
    for k in ("seq_len", "window", "rank", "vocab", "hidden", "chunk_size", "repeats"):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{mode}/{kind}/delta={delta} worker failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="JSON results file")
    p.add_argument("--kinds", default="cp,btree", help="comma-separated circuit kinds")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--window", type=int, default=16)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--vocab", type=int, default=320)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2, help="timed steps after one warm-up, per process")
    p.add_argument("--rounds", type=int, default=2, help="fresh naive + chunked processes, alternating")
    p.add_argument(
        "--against",
        choices=["naive", "ce"],
        default="naive",
        help="naive: chunked CE vs naive CE; ce: chunked distillation vs chunked CE",
    )
    p.add_argument(
        "--leaf-delta-ranks", default="0", help="comma-separated leaf forms (0 full, k > 0 App. G)"
    )
    p.add_argument("--worker", choices=["naive", "chunked", "kl"], help=argparse.SUPPRESS)
    p.add_argument("--kind", help=argparse.SUPPRESS)
    p.add_argument("--leaf-delta-rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--grads", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        args.mode = args.worker
        return worker(args)

    from tracking.runs import machine

    base, new = ("naive", "chunked") if args.against == "naive" else ("chunked", "kl")
    mem_bar, time_bar = (0.25, 1.3) if args.against == "naive" else (1.5, 1.5)
    results = []
    forms = [
        (k.strip(), int(dr))
        for k in args.kinds.split(",")
        if k.strip()
        for dr in args.leaf_delta_ranks.split(",")
    ]
    for kind, delta in forms:
        with tempfile.TemporaryDirectory() as tmp:
            rounds = {base: [], new: []}
            for _ in range(args.rounds):
                for mode in (base, new):
                    run = run_mode(mode, kind, delta, args, os.path.join(tmp, f"{mode}.pt"))
                    rounds[mode].append(run)
                    print(
                        f"{kind} delta={delta} {mode}: {run['median_s']:.2f} s, peak above params+grads "
                        f"{run['peak_above_params_and_grads_bytes'] / 2**20:.0f} MiB",
                        flush=True,
                    )
            runs = {
                mode: {
                    "median_s": statistics.median(t for r in rs for t in r["times_s"]),
                    "peak_above_params_and_grads_bytes": max(
                        r["peak_above_params_and_grads_bytes"] for r in rs
                    ),
                    "rounds": rs,
                }
                for mode, rs in rounds.items()
            }
            check = (
                compare(os.path.join(tmp, "naive.pt"), os.path.join(tmp, "chunked.pt"))
                if base == "naive"
                else {}
            )
        mem_ratio = (
            runs[new]["peak_above_params_and_grads_bytes"] / runs[base]["peak_above_params_and_grads_bytes"]
        )
        time_ratio = runs[new]["median_s"] / runs[base]["median_s"]
        row = {
            "kind": kind,
            "leaf_delta_rank": delta,
            base: runs[base],
            new: runs[new],
            "memory_ratio": mem_ratio,
            "time_ratio": time_ratio,
            **check,
            "memory_ok": mem_ratio <= mem_bar,
            "time_ok": time_ratio <= time_bar,
        }
        agreement = f", loss ok {check['loss_ok']}, grads ok {check['grads_ok']}" if check else ""
        print(
            f"{kind} delta={delta}: {new}/{base} memory ratio {mem_ratio:.3f} (<= {mem_bar}: {row['memory_ok']}), "
            f"time ratio {time_ratio:.2f} (<= {time_bar}: {row['time_ok']}){agreement}",
            flush=True,
        )
        results.append(row)
    report = {
        "config": {
            k: getattr(args, k)
            for k in (
                "seq_len",
                "window",
                "rank",
                "vocab",
                "hidden",
                "chunk_size",
                "repeats",
                "rounds",
                "against",
                "leaf_delta_ranks",
            )
        },
        "machine": {
            **machine(),
            "load_average_at_end": os.getloadavg(),
            "note": "CPU shared with other jobs; times are noisy, ratios measured back to back",
        },
        "results": results,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")
    if not all(
        r.get("loss_ok", True) and r.get("grads_ok", True) and r["memory_ok"] and r["time_ok"]
        for r in results
    ):
        sys.exit(1)


if __name__ == "__main__":
    main()
