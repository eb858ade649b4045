"""Offline (teacher-forced) acceptance against the online loop: wall time, where it goes, agreement.

    python bench/bench_offline.py --out bench/results/offline_cpu.json            # 3 x 225 x 256, one head
    python bench/bench_offline.py --heads 8 --no-online --out ...                  # per-head cost, 8 heads
    python bench/bench_offline.py --prefill-only --out ...                         # the prompts' prefill alone
    python bench/bench_offline.py --tiny --prompts 4 --sets 1 --max-new-tokens 16  # dry run (random tiny Llama)
    python bench/bench_offline.py --device cuda --prompts 32 --batch 256 --slot-budget 1048576 --out ...  # a GPU

For each mode (greedy, sampling at T = 1; EOS banned): the offline arm times `continuations`
(plain decoding, `--batch` prompts at once on the compact forward, batches of similar length),
`teacher_force` (one pass), `decode_and_force` (the two fused: what the suite runs for k = 0 on
the compact forward; its texts are compared with the two-step ones) and `offline_acceptance`
per head; the online arm (`--online`, default on) runs
`MtpcModel.generate` on the same prompts with the same seeds for the first head. Beside the
times it records the agreement of the two: greedy, the fraction of prompts whose offline cycles
differ from the online loop's (float32: near-ties); sampling, the mean and 99 % interval of
(online - offline expected) accepted drafts and cycles, paired by text (the online run's own
text goes through one more pass for that). `--device cuda`: the same on a GPU (every timed part ends
with a device synchronisation; the online loop replays CUDA graphs as `MtpcModel.generate` does
there); `--slot-budget` sets the key-slot cap on a batch (`slot_budget` of `continuations` /
`decode_and_force`; default `offline.KV_BUDGET_BYTES` of keys and values). Heads: trained exports of the default model in the
cache when present, else heads started from its unembedding (every kind in turn). One thread
(`--threads`), as a sweep worker. Writes JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from mtpc.names import CIRCUIT_KINDS, DECODE_MODES, default_rank  # noqa: E402
from mtpc.speculative.offline import CONTINUATION_BATCH  # noqa: E402

KINDS = CIRCUIT_KINDS


def _tiny_backbone():
    from transformers import LlamaConfig, LlamaForCausalLM

    from mtpc.backbones import BackboneAdapter

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      bos_token_id=256, eos_token_id=257)  # fmt: skip
    return BackboneAdapter.from_hf(LlamaForCausalLM(cfg).eval(), name="tiny-random")


def _backbone(args):
    from mtpc.backbones import load_backbone

    bb = _tiny_backbone() if args.tiny else load_backbone("default", device=args.device)
    if args.tiny and args.device != "cpu":
        bb.model.to(args.device)
    return bb


def _clock(device) -> float:
    """perf_counter after the device's queued work is done (a GPU runs asynchronously)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def _heads(bb, count: int, window: int):
    from mtpc import MtpcModel
    from mtpc.heads import HeadConfig, MtpcHead
    from mtpc.paths import cache_dir

    root = cache_dir() / "heads"
    dirs = sorted(p for p in root.glob("default-*") if (p / "config.json").is_file()) if root.is_dir() else []
    models = []
    for d in dirs[:count] if bb.name != "tiny-random" else []:
        m = MtpcModel.from_pretrained(d, backbone=bb)
        if m.head.config.lora_depth == 0:
            models.append(m)
    for i in range(count - len(models)):
        kind = KINDS[i % len(KINDS)]
        cfg = HeadConfig(kind=kind, window=window, rank=default_rank(kind), vocab=bb.vocab_size,
                         hidden=bb.hidden_size, backbone=bb.name)  # fmt: skip
        head = MtpcHead(cfg)
        head.init_from_unembeddings(bb.lm_head_weight.detach(), generator=torch.Generator().manual_seed(i))
        models.append(MtpcModel.from_components(bb, head.to(bb.device, bb.dtype)))
    return models


def _prompts(bb, args) -> list[list[torch.Tensor]]:
    if args.tiny:
        g = torch.Generator().manual_seed(0)
        return [[torch.randint(0, 256, (int(torch.randint(8, 40, (1,), generator=g)),), generator=g)
                 for _ in range(args.prompts)] for _ in range(args.sets)]  # fmt: skip
    from experiments.evaluation.prompts import load_prompt_sets

    sets = load_prompt_sets(args.prompt_source, num_prompts=args.prompts, sets=args.sets, seed=0)
    tok = bb.tokenizer
    return [[torch.tensor(tok.render_prompt(p), dtype=torch.long) for p in ps] for ps in sets]


def _device_name(device) -> str:
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _interval(d: list[float]) -> dict:
    n = len(d)
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1)) if n > 1 else float("nan")
    half = 2.5758 * sd / math.sqrt(n)
    return {"mean": mean, "ci99": [mean - half, mean + half], "n": n}


def measure_prefill(args) -> dict:
    """The prompts' prefill alone, as `decode_and_force` batches it (both arms pay it)."""
    from mtpc.backbones.llama_batch import LlamaBatchEngine
    from mtpc.speculative.offline import _engine_plan

    torch.set_num_threads(args.threads)
    bb = _backbone(args)
    engine, seconds, size = LlamaBatchEngine(bb), 0.0, 0
    for prompts in _prompts(bb, args):
        size += sum(p.shape[0] for p in prompts)
        for groups in _engine_plan(engine, prompts, args.batch, args.max_new_tokens, args.slot_budget):
            rows = [i for g in groups for i in g]
            t = _clock(args.device)
            engine.prefill([prompts[i] for i in rows], args.max_new_tokens, [len(g) for g in groups])
            seconds += _clock(args.device) - t
    return {"backbone": bb.name, "sets": args.sets, "prompts": args.prompts, "batch": args.batch,
            "threads": args.threads, "prompt_bytes": size, "prefill_s": seconds}  # fmt: skip


def measure(args) -> dict:
    from mtpc.speculative.loop import DecodeConfig
    from mtpc.speculative.offline import (
        continuations,
        decode_and_force,
        fused_pass_applies,
        offline_acceptance,
        pool_offline,
        teacher_force,
    )

    torch.set_num_threads(args.threads)
    bb = _backbone(args)
    models = _heads(bb, args.heads, args.window)
    sets = _prompts(bb, args)
    out = {"backbone": bb.name, "device": _device_name(bb.device), "slot_budget": args.slot_budget,
           "heads": [m.head.config.kind for m in models], "sets": args.sets,
           "prompts": args.prompts, "prompt_source": args.prompt_source, "max_new_tokens": args.max_new_tokens, "batch": args.batch,
           "threads": args.threads, "modes": {}}  # fmt: skip
    fuses = fused_pass_applies(bb, args.batch)
    two_step = args.two_step or not fuses  # continuations + teacher_force, timed beside the fused path
    for mode in args.modes:
        cfg = DecodeConfig(
            max_new_tokens=args.max_new_tokens, mode=mode, eos_id=bb.eos_token_id, ban_eos=True
        )
        rec = {"continuations_s": 0.0, "pass_s": 0.0, "per_head_s": [0.0] * len(models), "online_s": 0.0,
               "metrics": [], "greedy_prompts_differing": 0, "d_accepted": [], "d_cycles": [], "fused_s": 0.0,
               "fused_texts_differing": 0, "greedy_texts_differing_online": 0}  # fmt: skip
        for prompts in sets:
            seeds = list(range(len(prompts)))
            if two_step:
                t0 = _clock(args.device)
                ys = continuations(
                    bb, prompts, cfg, seeds=seeds, batch_size=args.batch, slot_budget=args.slot_budget
                )
                t1 = _clock(args.device)
                tf = teacher_force(bb, prompts, ys, cfg)
                t2 = _clock(args.device)
                rec["continuations_s"] += t1 - t0
                rec["pass_s"] += t2 - t1
            if fuses:  # the suite's path for k = 0 on the compact forward
                t = _clock(args.device)
                fused = decode_and_force(
                    bb, prompts, cfg, seeds=seeds, batch_size=args.batch, slot_budget=args.slot_budget
                )
                rec["fused_s"] += _clock(args.device) - t
                if two_step:
                    rec["fused_texts_differing"] += sum(
                        a != b for a, b in zip(fused.continuations, ys, strict=True)
                    )
                tf = fused  # the heads below read the fused pass (the suite's path for k = 0)
            offline = []
            for j, m in enumerate(models):
                t = _clock(args.device)
                offline.append(offline_acceptance(tf, m.head))
                rec["per_head_s"][j] += _clock(args.device) - t
            rec["metrics"].append([pool_offline(o) for o in offline])
            if not args.online:
                continue
            m, texts, online = models[0], [], []
            t = _clock(args.device)
            for i, p in enumerate(prompts):
                g = m.generate(p, max_new_tokens=args.max_new_tokens, mode=mode, seed=seeds[i], ban_eos=True)
                texts.append(g.ids.tolist())
                online.append(g.stats)
            rec["online_s"] += _clock(args.device) - t
            paired = offline_acceptance(
                teacher_force(bb, prompts, texts, cfg), m.head
            )  # on the loop's own texts
            if mode == "greedy":  # the suite's offline texts (fused, batched) against the loop's own
                rec["greedy_texts_differing_online"] += sum(
                    a != b for a, b in zip(tf.continuations, texts, strict=True)
                )
            for st, off in zip(online, paired, strict=True):
                if mode == "greedy":
                    differs = (
                        st.accepted_length_histogram != off.accepted_length_histogram
                        or st.cycles != off.cycles
                    )
                    rec["greedy_prompts_differing"] += int(differs)
                rec["d_accepted"].append(st.mu_acc * st.cycles - off.accepted)
                rec["d_cycles"].append(st.cycles - off.cycles)
        if two_step:
            rec["two_step_one_head_s"] = rec["continuations_s"] + rec["pass_s"] + rec["per_head_s"][0]
        else:  # not measured: left out rather than written as 0
            for k in ("continuations_s", "pass_s", "fused_texts_differing"):
                rec.pop(k)
        offline_one = (rec["fused_s"] if fuses else rec["continuations_s"] + rec["pass_s"]) + rec[
            "per_head_s"
        ][0]
        rec["offline_one_head_s"] = offline_one  # the suite's path: fused when k = 0 on the compact forward
        if args.online:
            rec["speedup_one_head"] = rec["online_s"] / offline_one
            rec["paired_accepted"] = _interval(rec.pop("d_accepted"))
            rec["paired_cycles"] = _interval(rec.pop("d_cycles"))
        else:
            rec.pop("d_accepted"), rec.pop("d_cycles")
        out["modes"][mode] = rec
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--sets", type=int, default=3)
    p.add_argument("--prompts", type=int, default=225, help="prompts per set")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--heads", type=int, default=1, help="heads sharing one pass per prompt set")
    p.add_argument("--window", type=int, default=8)
    p.add_argument(
        "--batch",
        type=int,
        default=CONTINUATION_BATCH,
        help="at most this many prompts decoded at once for the continuations",
    )
    p.add_argument(
        "--no-two-step",
        dest="two_step",
        action="store_false",
        help="time only the fused path (decode_and_force), not continuations + teacher_force beside it",
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--prompt-source",
        default="heldout",
        help="heldout (the bundled corpus's held-out prompts) or a .jsonl of them (experiments.evaluate)",
    )
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument(
        "--slot-budget",
        type=int,
        default=None,
        help="at most this many key slots allocated a batch (default: offline.KV_BUDGET_BYTES of keys and values)",
    )
    p.add_argument(
        "--modes", nargs="+", choices=DECODE_MODES, default=list(DECODE_MODES), help="greedy, sample or both"
    )
    p.add_argument("--no-online", dest="online", action="store_false", help="skip the online arm")
    p.add_argument("--tiny", action="store_true", help="dry run on a random tiny Llama")
    p.add_argument(
        "--prefill-only", action="store_true", help="time only the prompts' prefill (both arms pay it)"
    )
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    result = measure_prefill(args) if args.prefill_only else measure(args)
    result = {"command": "python " + " ".join(["bench/bench_offline.py", *argv]),
              "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), **result}  # fmt: skip
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    modes = result.get("modes")
    print(
        json.dumps(
            {m: {k: v for k, v in r.items() if k != "metrics"} for m, r in modes.items()}
            if modes
            else result,
            indent=1,
        )
    )
    return result


if __name__ == "__main__":
    from experiments.plumbing.timing_lock import timing

    with timing(progress=True):  # one timer on the machine; the background pre-training paused
        main()
