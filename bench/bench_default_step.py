"""One plain decoding step of the shipped default against another default model, side by side.

`python bench/bench_default_step.py --other DIR [--out FILE]` loads the shipped default and the model
in DIR (e.g. an earlier default: `git show REV:mtpc/default_model/FILE` for each file of that
folder), prefills both with the same random bytes at 256 and 1024 cached positions, and times one
1-byte `LlamaEngine` step of each (float32, one thread, 50 steps per round, 7 rounds interleaved in
one process: `engine_timing.timed`); writes the median ms and the ratio per context.

Leaves out: heads and cycles (bench_decode.py), the GPU (bench_gpu.py).
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

from mtpc.backbones import LlamaEngine, load_backbone  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--other", required=True, help="a save_pretrained directory (e.g. an earlier default)")
    ap.add_argument("--out", default="bench/results/default_step_cpu.json")
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 1024])
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from mtpc.backbones.shipped import verify_shipped
    from tracking.runs import machine

    models = {verify_shipped(): "default", "other": args.other}
    fns = {}
    for label, spec in models.items():
        bb = load_backbone(spec, dtype=torch.float32)
        for ctx in args.contexts:
            eng = et.prefilled(LlamaEngine(bb, ctx + 64), et.random_prompts(1, ctx, seed=0)[0], ctx + 64)
            fns[f"{label}@{ctx}"] = et.engine_call(eng, torch.tensor([65]), ctx)
    with torch.inference_mode():
        res = et.timed(fns, 50, 7)
    shipped = next(iter(models))
    report = {"shipped": shipped, "other": args.other, "ms": res["ms"],
              "shipped_over_other": {ctx: et.ratio(res, f"{shipped}@{ctx}", f"other@{ctx}") for ctx in args.contexts},
              "hardware": machine(), "command": "python bench/bench_default_step.py " + " ".join(sys.argv[1:]),
              "date_utc": time.strftime("%Y-%m-%d", time.gmtime())}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(json.dumps({k: report[k] for k in ("ms", "shipped_over_other")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
