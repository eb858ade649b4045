"""CPU benchmark of speculative decoding on the embedded default model: every circuit at n in {8, 16}.

    python bench/bench_decode.py --out bench/results/decode_cpu.json     (make bench-decode)

For each window n and circuit kind it uses a trained head export when one exists
(`<heads-dir>/default-<kind>-n<n>-r*`, as experiments/nll_table.py writes them; default
heads-dir = mtpc.paths.cache_dir()/heads) and otherwise a fresh random head (rank 8, seed 0),
labelled `"source": "random"` in the JSON. All heads of one n share one backbone and run, with
STP, on the same held-out prompts in this process (experiments.evaluate.evaluate_heads), greedy
and sampling, keep and drop; speedup_vs_ff uses that n's ff head. EOS is banned (equal lengths).

Reports mu_acc, tokens_per_cycle, mu_lat, throughput, speedup_vs_stp, speedup_vs_ff (mean ± std
over prompt sets) and the hardware. Absolute times on a shared CPU are not meaningful; the ratios
are measured side by side. Leaves out: GPU measurements (see docs/decoding.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.evaluate import evaluate_heads, hardware, load_prompt_sets  # noqa: E402
from mtpc import MtpcModel  # noqa: E402
from mtpc.names import CIRCUIT_KINDS, DECODE_MODES, EXTRA_TOKEN_OPTIONS, point_rank  # noqa: E402
from mtpc.paths import cache_dir  # noqa: E402

REPORT = ("mu_acc", "tokens_per_cycle", "mu_lat", "throughput", "speedup_vs_stp", "speedup_vs_ff")


def find_head(heads_dir: Path, kind: str, window: int) -> Path | None:
    found = sorted(heads_dir.glob(f"default-{kind}-n{window}-r*"))
    found = [p for p in found if (p / "config.json").is_file() and (p / "head.safetensors").is_file()]
    return found[0] if found else None


def build_models(backbone, heads_dir: Path, window: int, rank: int) -> tuple[dict, dict]:
    models, sources = {}, {}
    for kind in CIRCUIT_KINDS:
        path = find_head(heads_dir, kind, window)
        m = None
        if path is not None:
            try:
                m = MtpcModel.from_pretrained(path, backbone=backbone)
                sources[kind] = f"trained: {path}"
            except ValueError as e:  # e.g. a LoRA head: the benchmark uses k = 0 only
                print(f"skipping {path}: {e}", file=sys.stderr)
        if m is None:
            spec = {"kind": kind, "window": window, "rank": point_rank(kind, rank), "seed": 0}
            m = MtpcModel.from_components(backbone, spec)
            sources[kind] = "random"
        models[kind] = m
    return models, sources


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/decode_cpu.json")
    ap.add_argument("--windows", default="8,16")
    ap.add_argument("--heads-dir", default=str(cache_dir() / "heads"))
    ap.add_argument("--random-rank", type=int, default=8)
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--sets", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier on a shared CPU)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from mtpc.backbones import load_backbone

    backbone = load_backbone("default")
    prompt_sets = load_prompt_sets("heldout", args.num_prompts, args.sets, args.seed)
    report = {
        "hardware": hardware(),
        "command": "python bench/bench_decode.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "backbone": "default",
        "settings": {k: getattr(args, k) for k in ("num_prompts", "sets", "max_new_tokens", "threads", "seed")},
        "note": "shared 2-core CPU with other jobs running; compare ratios, not absolute times",
        "windows": {},
    }
    t0 = time.time()
    for window in (int(w) for w in args.windows.split(",")):
        models, sources = build_models(backbone, Path(args.heads_dir), window, args.random_rank)
        res = evaluate_heads(
            models, prompt_sets, DECODE_MODES, EXTRA_TOKEN_OPTIONS, max_new_tokens=args.max_new_tokens,
            seed=args.seed, eos=("banned",), ff_name="ff",
        )  # fmt: skip
        rows = []
        for s in res["summary"]:
            row = {k: s[k] for k in ("circuit", "window", "rank", "mode", "extra_token")}
            row["source"] = sources[s["head"]]
            row.update({k: s[k]["mean"] for k in REPORT})
            row.update({f"{k}_std": s[k]["std"] for k in REPORT})
            rows.append(row)
            print(
                f"n={window:2d} {row['circuit']:>5} {row['mode']:>6}/{row['extra_token']:<4} "
                f"mu_acc={row['mu_acc']:.2f} tpc={row['tokens_per_cycle']:.2f} mu_lat={row['mu_lat'] * 1e3:.1f}ms "
                f"speedup_vs_stp={row['speedup_vs_stp']:.2f} speedup_vs_ff={row['speedup_vs_ff']:.2f} ({row['source'][:7]})",
                flush=True,
            )
        report["windows"][str(window)] = {"rows": rows, "stp": res["stp"], "runs": res["runs"]}
    report["wall_s"] = time.time() - t0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
