"""Heads side by side on the development prompts: exact offline acceptance, per window position.

    python bench/compare_heads_offline.py paper=RUN_A/head known=RUN_B/head shipped=default \\
        --out bench/results/known_byte_dev_cpu.json
    python bench/compare_heads_offline.py a=DIR --dry-run          (a tiny random model: seconds)

Each head (`name=path`, or `name=default` / `name=shipped:<name>` for a shipped head) is scored on the
same texts: per mode (greedy, sampling at T = 1) one plain pass over the development sets of the
evaluation's seeded draw (`--dev-sets` x `--prompts` prompts after the 3 report sets, never the
report sets), `--bytes` new bytes each, EOS banned (`decode_and_force`); then, for every head and
every `--draft-lens` m up to its window n, `offline_acceptance` (exact expectations, no decoding) pooled: bytes per
cycle and acceptance per window position, beside the plain texts' degeneracy (`texts`). For choosing between heads or options (docs/heads.md);
no timing (speed-ups: bench/bench_shipped_head.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mtpc.heads import load_head  # noqa: E402
from mtpc.shipped_heads import resolve_head  # noqa: E402
from mtpc.speculative.loop import DecodeConfig  # noqa: E402
from mtpc.speculative.offline import decode_and_force, offline_acceptance, pool_offline  # noqa: E402
from mtpc.textstats import degeneracy_metrics  # noqa: E402


def _heads(specs: list[str], dry_run: bool, backbone) -> dict:
    out = {}
    for spec in specs:
        name, sep, where = spec.partition("=")
        if not sep or not name or not where:
            raise SystemExit(f"compare_heads_offline: {spec!r}: expected name=path (or name=default)")
        if dry_run:
            from mtpc.heads import HeadConfig, random_head

            cfg = HeadConfig(
                "btree", 4, 2, backbone.vocab_size, backbone.hidden_size, known_byte=name == "known"
            )
            out[name] = random_head(cfg, seed=len(out))
        else:
            out[name] = load_head(resolve_head(where))[0]
        out[name] = out[name].to(torch.float32).eval()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "heads", nargs="+", help="name=path (a head export) or name=default / name=shipped:<name>"
    )
    ap.add_argument("--dev-sets", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=32, help="prompts per development set")
    ap.add_argument("--bytes", type=int, default=128, help="new bytes per prompt")
    ap.add_argument("--draft-lens", default="4,8", help="comma-separated draft lengths")
    ap.add_argument("--modes", default="greedy,sample")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--dry-run", action="store_true", help="a tiny random model and heads, 2 prompts")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    lens = [int(x) for x in a.draft_lens.split(",") if x.strip()]
    if a.dry_run:
        from experiments.training.module import build_backbone

        backbone = build_backbone("tiny", 0)
        prompts = [torch.tensor([1, 2, 3]), torch.tensor([4, 5])]
        a.bytes, lens = 8, [m for m in lens if m <= 4] or [4]
    else:
        from experiments.evaluation.config import EvalConfig
        from experiments.evaluation.prompts import load_prompt_sets
        from mtpc.backbones import load_backbone

        backbone = load_backbone("default")
        sets = load_prompt_sets("heldout", a.prompts, 3, EvalConfig.seed, dev_sets=a.dev_sets)
        prompts = [torch.tensor(backbone.tokenizer.render_prompt(p)) for s in sets[3:] for p in s]
    heads = _heads(a.heads, a.dry_run, backbone)
    from tracking.runs import machine, machine_line

    result = {
        "command": "python bench/compare_heads_offline.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "prompts": f"{a.dev_sets} development sets x {a.prompts} prompts x {a.bytes} bytes, EOS banned",
        "machine": machine_line(machine()),
        "heads": {name: spec.partition("=")[2] for name, spec in zip(heads, a.heads, strict=True)},
        "texts": {},
        "results": {},
    }
    for mode in a.modes.split(","):
        cfg = DecodeConfig(max_new_tokens=a.bytes, mode=mode, ban_eos=True, eos_id=backbone.eos_token_id)
        seeds = list(range(len(prompts))) if mode == "sample" else None
        tf = decode_and_force(backbone, prompts, cfg, seeds=seeds)
        # the plain texts every head is scored on: acceptance of degenerate text means little
        result["texts"][mode] = degeneracy_metrics(tf.continuations)
        for name, head in heads.items():
            for m in (m for m in lens if m <= head.config.window):  # a shorter head: its own m only
                pooled = pool_offline(offline_acceptance(tf, head, draft_len=m))
                row = {"bytes_per_cycle": pooled["tokens_per_cycle"],
                       "per_position_acceptance": pooled["per_position_acceptance"]}  # fmt: skip
                result["results"].setdefault(mode, {}).setdefault(name, {})[str(m)] = row
                acc = " ".join("-" if x is None else f"{x:.3f}" for x in row["per_position_acceptance"])
                print(
                    f"{mode} {name} m={m}: {row['bytes_per_cycle']:.3f} bytes/cycle; by position {acc}",
                    flush=True,
                )
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
