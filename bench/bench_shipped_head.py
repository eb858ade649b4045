"""The shipped head's speed-up over plain decoding, measured the one way its figures are reported.

    python bench/bench_shipped_head.py --out bench/results/shipped_head_cpu.json      (3 x 32 x 128, 3 rounds)
    python bench/bench_shipped_head.py --head shipped:<name> --sets 1 --prompts 8 --rounds 3
    python bench/bench_shipped_head.py --dev --sets 1 --draft-lens 4,5,6,8             (choose the draft length)
    python bench/bench_shipped_head.py --dry-run --out /tmp/x.json                    (a tiny random head: seconds)

Held-out prompts nothing was tuned on (`--sets` x `--prompts` drawn by the evaluation's seeded draw from
the held-out ShareGPT conversations: the report sets, never the development sets; `--dev` draws the
development sets of the same draw instead, for choosing settings), `--bytes` new bytes
each, EOS banned; for each mode (greedy, sampling at `--temperature`) `experiments.evaluation.speedup.measure_speedup`
in one process on one thread, inside the machine-wide timing lock (background work paused): plain and
speculative decoding interleaved prompt by prompt, wall clock, the median of the rounds' ratios, with
bytes per cycle, greedy identity and the text's degeneracy beside; `--draft-lens` times each draft
length in turn (each against its own interleaved plain arm). The JSON names the command, the
machine and its L3 cache.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.evaluation.speedup import measure_speedup  # noqa: E402
from mtpc import MtpcModel  # noqa: E402


def l3_cache() -> str:
    try:
        return Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
    except OSError:
        return "unknown"


def _prompts(sets: int, per_set: int, dry_run: bool, dev: bool = False) -> list[str]:
    if dry_run:
        return [f"Write a short note about item {i}." for i in range(sets * per_set)]
    from experiments.evaluation.config import EvalConfig
    from experiments.evaluation.prompts import load_prompt_sets

    # the report sets are the first 3 of the draw (this bench's default); dev sets follow them
    drawn = load_prompt_sets("heldout", per_set, 3, EvalConfig.seed, dev_sets=sets if dev else 0)
    chosen = drawn[3:] if dev else drawn[:sets]
    return [p for s in chosen for p in s]


def _model(head: str, dry_run: bool) -> MtpcModel:
    if not dry_run:
        return MtpcModel.from_pretrained(head)
    from experiments.training.module import build_backbone

    return MtpcModel.from_components(build_backbone("tiny", 0), {"kind": "btree", "window": 4, "rank": 4})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--head", default="default", help="'default', 'shipped:<name>' or a head export directory"
    )
    ap.add_argument("--sets", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=32, help="prompts per set")
    ap.add_argument("--bytes", type=int, default=128, help="new bytes per prompt")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="greedy,sample")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument(
        "--dev", action="store_true", help="the development sets (for choosing), not the report sets"
    )
    ap.add_argument(
        "--draft-lens",
        default="",
        help="comma-separated draft lengths to time in turn (default: the model's)",
    )
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="a tiny random model and head, 2 prompts: checks the bench runs",
    )
    a = ap.parse_args(argv)
    if a.dry_run:
        a.sets, a.prompts, a.bytes, a.rounds = 1, 2, 8, 1
    torch.set_num_threads(1)
    from experiments.plumbing.timing_lock import timing
    from tracking.runs import machine, machine_line

    model = _model(a.head, a.dry_run)
    if a.sets > 3 and not a.dev:
        ap.error(f"--sets: at most 3 report sets, got {a.sets}")
    prompts = _prompts(a.sets, a.prompts, a.dry_run, a.dev)
    lens = [int(x) for x in a.draft_lens.split(",") if x.strip()] or [None]
    result = {
        "command": "python bench/bench_shipped_head.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": f"{machine_line(machine())}; L3 {l3_cache()}",
        "head": a.head if not a.dry_run else "dry-run",
        "engine": model.engine_label(),  # the backbone's engine and weight layout, e.g. compact/rowdot
        "prompts": f"{a.sets} {'development' if a.dev else 'held-out'} sets x {a.prompts} prompts x {a.bytes} "
        f"bytes, EOS banned, {a.rounds} rounds",
        "date": time.strftime("%Y-%m-%d"),
        "modes": {},
    }
    with timing(progress=True):  # one timer on the machine; registered background work paused
        for mode in a.modes.split(","):
            for m in lens:
                got = measure_speedup(model, prompts, mode, a.bytes, a.rounds, a.temperature, draft_len=m)
                if len(lens) == 1:
                    result["modes"][mode] = got
                else:
                    result["modes"].setdefault(mode, {})[str(got["draft_len"])] = got
    text = json.dumps(result, indent=2)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
