"""Where the decoding step's and the 16-byte verify's time goes on a GPU: Llama-3.2-3B's shape, bf16,
batch 1, 1 KiB context.

`python bench/profile_gpu_step.py --out FILE [--tiny]` times, side by side in one process and
interleaved per round (`engine_timing.timed`): the engine's 1-byte step with CUDA graphs (what
`bench_gpu.py` reports as "step"), the same step eager, the 16-byte verify with and without graphs,
the weight floor as plain launches (one matrix-vector product per step weight, as `weight_floor`)
and the same floor replayed from one CUDA graph (no launch gaps: the time to stream the weights with
cuBLAS's GEMV). Then `torch.profiler` over 10 calls of each of the four: the kernels that take the
GPU time, with their counts, and `verify16_vs_step`: kernel by kernel (graphed), the time per call
in the verify and in the step and what the verify adds, largest first — where verify_16's excess
over the step comes from. The bytes every step must read (weights + KV) over the copy bandwidth
measured here give the bound. `--tiny` dry-runs every part on the CPU with a tiny random model
(checks the script only). Run by bench/device.sh (part 2b).

Leaves out: heads and cycles (bench_gpu.py), changing the engine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine_timing as et  # noqa: E402  (bench/engine_timing.py)

from mtpc.backbones import BackboneAdapter, LlamaEngine  # noqa: E402


def top_kernels(prof, device_type: str, n: int = 12) -> list[dict]:
    attr = "device_time_total" if device_type == "cuda" else "cpu_time_total"
    rows = sorted(prof.key_averages(), key=lambda e: getattr(e, attr, 0.0), reverse=True)
    total = sum(
        getattr(e, attr, 0.0)
        for e in prof.key_averages()
        if device_type != "cuda" or e.device_type.name == "CUDA"
    )
    out = []
    for e in rows[:n]:
        us = getattr(e, attr, 0.0)
        out.append(
            {"name": e.key[:120], "count": e.count, "total_us": us, "share": us / total if total else None}
        )
    return out


def kernel_times(prof, device_type: str) -> dict[str, float]:
    """{kernel or op name: total us} over a profile (device time on CUDA, CPU time elsewhere)."""
    attr = "device_time_total" if device_type == "cuda" else "cpu_time_total"
    out: dict[str, float] = {}
    for e in prof.key_averages():
        if device_type == "cuda" and e.device_type.name != "CUDA":
            continue
        out[e.key[:120]] = out.get(e.key[:120], 0.0) + getattr(e, attr, 0.0)
    return out


def compare_kernels(step: dict[str, float], verify: dict[str, float], calls: int, n: int = 12) -> list[dict]:
    """Kernel by kernel, us per call in the verify and in the step and the difference, largest first."""
    rows = [
        {"name": k, "verify_us": verify.get(k, 0.0) / calls, "step_us": step.get(k, 0.0) / calls,
         "added_us": (verify.get(k, 0.0) - step.get(k, 0.0)) / calls}
        for k in set(step) | set(verify)
    ]  # fmt: skip
    return sorted(rows, key=lambda r: r["added_us"], reverse=True)[:n]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--context", type=int, default=1024)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    shape, dtype, ctx = (
        (et.TINY_SHAPE, torch.float32, 64)
        if args.tiny
        else (et.LLAMA32_3B_SHAPE, torch.bfloat16, args.context)
    )
    t0 = time.time()
    report: dict = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "dtype": str(dtype),
                    "context": ctx, "command": "python bench/profile_gpu_step.py " + " ".join(sys.argv[1:]),
                    "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}  # fmt: skip
    model = et.random_llama(shape, dtype=dtype, device=device)
    bb = BackboneAdapter.from_hf(model, name="random")
    prompt = et.random_prompts(1, ctx, seed=0, device=device)[0]
    cap = ctx + 128
    graphs = device.type == "cuda"
    eng_g = et.prefilled(LlamaEngine(bb, cap, cuda_graphs=graphs), prompt, cap)
    eng_e = et.prefilled(LlamaEngine(bb, cap, static=eng_g.static, cuda_graphs=False), prompt, cap)
    one = torch.tensor([65], device=device)
    sixteen = torch.arange(65, 81, device=device)
    floor = et.weight_floor(model)
    fns = {
        "step_graph": et.engine_call(eng_g, one, ctx),
        "step_eager": et.engine_call(eng_e, one, ctx),
        "verify16_graph": et.engine_call(eng_g, sixteen, ctx),
        "verify16_eager": et.engine_call(eng_e, sixteen, ctx),
        "floor_launches": floor,
    }
    if graphs:
        with torch.inference_mode():
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    floor()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                floor()
        fns["floor_graph"] = g.replay
    reps, rounds = (3, 2) if args.tiny else (20, 7)
    with torch.inference_mode():
        res = et.timed(fns, reps, rounds, device=device)
    report["ms"] = res["ms"]
    report["rounds_ms"] = res["rounds_ms"]
    report["verify16_over_step"] = {
        w: et.ratio(res, f"verify16_{w}", f"step_{w}") for w in ("graph", "eager")
    }
    report["weight_bytes"], report["kv_bytes"] = et.weight_bytes(model), et.kv_bytes(model, ctx)
    bw = et.copy_bandwidth(device, 0.05 if args.tiny else 4.0)
    report["copy_bytes_per_s"] = bw
    report["bound_ms"] = (report["weight_bytes"] + report["kv_bytes"]) / bw * 1e3
    report["engine"] = {"layout": eng_g.layout, "static": eng_g.static, "cuda_graphs": eng_g.cuda_graphs,
                        "graphs_captured": sorted(eng_g._graphs), "graph_errors": dict(eng_g.graph_errors)}  # fmt: skip
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if graphs else [])
    kernels = {}
    for name in ("step_graph", "step_eager", "verify16_graph", "verify16_eager"):
        with torch.inference_mode(), torch.profiler.profile(activities=acts) as prof:
            for _ in range(10):
                fns[name]()
            et._sync(device)
        report[f"profile_{name}"] = top_kernels(prof, device.type)
        kernels[name] = kernel_times(prof, device.type)
    report["verify16_vs_step"] = compare_kernels(kernels["step_graph"], kernels["verify16_graph"], 10)
    report["seconds"] = time.time() - t0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1, default=str) + "\n")
    ms = report["ms"]
    print(f"bound {report['bound_ms']:.3f} ms | " + " | ".join(f"{k} {v:.3f} ms" for k, v in ms.items()))
    for name in ("step_graph", "step_eager", "verify16_graph", "verify16_eager"):
        print(name)
        for r in report[f"profile_{name}"][:8]:
            print(f"  {r['total_us'] / 10:9.1f} us/call  x{r['count'] // 10:<4} {r['name'][:90]}")
    print("verify16_graph - step_graph, by kernel")
    for r in report["verify16_vs_step"][:8]:
        print(
            f"  {r['added_us']:+9.1f} us/call ({r['step_us']:.1f} -> {r['verify_us']:.1f}) {r['name'][:80]}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
