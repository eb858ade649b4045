"""Held-out per-position NLL of ff / cp / hmm / btree heads on the embedded default model.

    python -m experiments.training.nll_table --windows 8 16 --kinds ff cp hmm btree [--steps 200] [--rank 8] [--seed 0]
    python -m experiments.training.nll_table --table        # print the markdown table from the results file

Each (kind, n) is one `train_head("default", ...)` run; its head is exported to
`cache_dir()/heads/default-<kind>-n<n>-r<r>` and one JSON line (config, per-position NLL, bits per
byte, timing) is appended to bench/results/train_nll_default_cpu.jsonl. Leaves out plotting.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from experiments.training.fit import train_head
from experiments.training.mlflow_run import PROJECT_DIR
from mtpc.backbones.shipped import SHIPPED_DIR
from mtpc.names import CIRCUIT_KINDS, DEFAULT_RANK, point_rank
from mtpc.paths import cache_dir
from tracking.runs import machine, machine_line

RESULTS = PROJECT_DIR / "bench" / "results" / "train_nll_default_cpu.jsonl"


def run_one(kind: str, window: int, rank: int, steps: int, seed: int = 0) -> dict:
    rank = point_rank(kind, rank)  # one --rank for every kind: ff has no rank axis
    name = f"default-{kind}-n{window}-r{rank}" + (f"-seed{seed}" if seed else "")
    over = {
        "model.circuit": kind,
        "model.window": window,
        "model.rank": rank,
        "trainer.max_steps": steps,
        "run.name": name,
        "seed_everything": seed,
        "data.seed": seed,
    }
    t = time.perf_counter()
    res = train_head(
        "default", over, run_dir=PROJECT_DIR / "runs" / "nll" / name, export_dir=cache_dir() / "heads" / name
    )
    m = res.metrics
    pretrain = json.loads((SHIPPED_DIR / "pretrain_metrics.json").read_text())  # the shipped default's record
    row = {
        "name": name,
        "circuit": kind,
        "window": window,
        "rank": rank,
        "steps": steps,
        "seed": seed,
        "leaf_delta_rank": res.config["model"].get("leaf_delta_rank"),
        "train_bytes": steps * res.config["data"]["seq_len"] * res.config["data"]["batch_size"],
        "val_nll": [m[f"val_nll_{j}"] for j in range(1, window + 1)],
        "val_window_nll": m["val_window_nll"],
        "val_bits_per_byte": m["val_bits_per_byte"],
        "val_stp_nll": m.get("val_stp_nll"),
        "head_dir": str(res.head_dir),
        "mlflow_run_id": res.mlflow_run_id,
        "seconds": time.perf_counter() - t,
        "machine": machine_line(machine()),
        "backbone_pretrain_steps": pretrain.get("steps"),
        "backbone_heldout_bpb": pretrain.get("heldout_bits_per_byte"),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("a") as f:
        f.write(json.dumps(row) + "\n")
    return row


def table(path: Path = RESULTS) -> str:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    # only rows trained on the backbone of the newest row (the default model may have been re-trained)
    bb = (rows[-1]["backbone_pretrain_steps"], rows[-1]["backbone_heldout_bpb"])
    rows = [r for r in rows if (r["backbone_pretrain_steps"], r["backbone_heldout_bpb"]) == bb]
    latest = {}
    for r in rows:  # the last run of each (name, steps) wins
        latest[r["name"], r["steps"]] = r
    rows = sorted(
        latest.values(),
        key=lambda r: (r["steps"], r.get("seed", 0), r["window"], CIRCUIT_KINDS.index(r["circuit"])),
    )
    out = [
        "| steps | seed | circuit | n | r | NLL pos 1 | pos 2 | pos 4 | pos 8 | pos 16 | window NLL (nats) | bits/byte "
        "| STP NLL pos 1 | min |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        nll = r["val_nll"]
        pos = [f"{nll[j - 1]:.3f}" if j <= len(nll) else "" for j in (1, 2, 4, 8, 16)]
        stp = f"{r['val_stp_nll']:.3f}" if r.get("val_stp_nll") is not None else ""
        out.append(
            f"| {r['steps']} | {r.get('seed', 0)} | {r['circuit']} | {r['window']} | {r['rank']} | "
            + " | ".join(pos)
            + f" | {r['val_window_nll']:.3f} | {r['val_bits_per_byte']:.3f} | {stp} | {r['seconds'] / 60:.1f} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m experiments.training.nll_table", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--windows", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--kinds", nargs="+", default=list(CIRCUIT_KINDS), choices=CIRCUIT_KINDS)
    ap.add_argument("--rank", type=int, default=DEFAULT_RANK)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument(
        "--seed", type=int, default=0, help="seed of the head init and data order (name gets -seed<k>)"
    )
    ap.add_argument("--table", action="store_true", help="only print the table from the results file")
    args = ap.parse_args(argv)
    from experiments.plumbing.quiet import quiet

    quiet()
    if not args.table:
        for n in args.windows:
            for kind in args.kinds:
                row = run_one(kind, n, args.rank, args.steps, args.seed)
                print(
                    json.dumps(
                        {k: row[k] for k in ("name", "val_window_nll", "val_bits_per_byte", "seconds")}
                    ),
                    flush=True,
                )
    print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
