"""Pre-training throughput of candidate default-model shapes on this machine (the CPU scaling check).

`python bench/bench_pretrain.py --out bench/results/pretrain_cpu.json` times a few optimiser steps
(forward + backward + AdamW, random bytes) of each candidate byte-Llama shape at each sequence
length, precision and thread count, and reports training bytes per second and the plain
1-byte decoding step relative to the old default shape (4 layers, d 512, ffn 1024). It sizes the
CPU run of `experiments.pretrain`; it leaves out data loading and any quality measurement.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SHAPES = {  # name: (layers, d, heads, kv_heads, ffn)
    "old-4x512-f1024": (4, 512, 8, 2, 1024),
    "6x512-f1536": (6, 512, 8, 2, 1536),
    "6x512-f1024": (6, 512, 8, 2, 1024),
}


def build(shape) -> LlamaForCausalLM:
    layers, d, heads, kv, ffn = shape
    cfg = LlamaConfig(
        vocab_size=320,
        hidden_size=d,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


def train_rate(model, seq, batch, bf16, steps=2) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 256, (batch, seq))
    times = []
    for i in range(steps + 1):
        t = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:
            times.append(time.perf_counter() - t)
    return batch * seq / sorted(times)[len(times) // 2]


@torch.inference_mode()
def step_ms(model, ctx=512, reps=30) -> float:
    from transformers import DynamicCache

    cache = DynamicCache()
    model(input_ids=torch.randint(0, 256, (1, ctx)), past_key_values=cache, use_cache=True)
    x = torch.randint(0, 256, (1, 1))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        model(input_ids=x, past_key_values=cache, use_cache=True)
        ts.append(time.perf_counter() - t)
        cache.crop(-1)
    return 1e3 * sorted(ts)[len(ts) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--seqs", nargs="+", type=int, default=[512, 2048])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--bytes-per-step", type=int, default=8192)
    args = ap.parse_args()
    rows = []
    for name in args.shapes:
        torch.manual_seed(0)
        model = build(SHAPES[name])
        params = sum(p.numel() for p in model.parameters())
        torch.set_num_threads(1)
        model.eval()
        step = step_ms(model)
        model.train()
        for seq, threads, bf16 in itertools.product(args.seqs, args.threads, (False, True)):
            torch.set_num_threads(threads)
            rate = train_rate(model, seq, max(1, args.bytes_per_step // seq), bf16)
            row = dict(
                shape=name,
                params=params,
                seq_len=seq,
                threads=threads,
                bf16=bf16,
                train_bytes_per_s=round(rate, 1),
                decode_step_ms_1thread=round(step, 3),
            )
            print(json.dumps(row), flush=True)
            rows.append(row)
    old = [r for r in rows if r["shape"] == "old-4x512-f1024"]
    if old:
        for r in rows:
            r["decode_step_vs_old"] = round(r["decode_step_ms_1thread"] / old[0]["decode_step_ms_1thread"], 3)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    from experiments.plumbing.timing_lock import timing

    with timing(progress=True):  # one timer on the machine; the background pre-training paused
        main()
