"""Where `python -m experiments.pretrain` spends its time on the CPU: one factor at a time, side by side.

`python bench/bench_pretrain_loop.py --out bench/results/pretrain_loop_cpu.json` times optimiser steps
(forward + backward + clip + AdamW) of the default shape (4 x 512, SwiGLU 1024, GQA 8/2, vocab 320) on
real packed training rows, in one process, variants interleaved round by round so a shared machine's
load falls on all of them alike; it reports each variant's median bytes/s, its ratio to the suite's
loop (`ours`), and the FLOP/s from the PaLM count. Variants, each differing from `ours` in one factor:

- `ours`: experiments.pretrain's step: 512 x 8 rows, bf16 autocast, 2 threads, masked next-byte loss;
- `ours_1thread`: the same on one thread (the old config's setting);
- `ours_2048x2`: rows of 2048 bytes x 2 (the old config's shape; attention is 4x the cost per byte);
- `ours_fp32`: no autocast;
- `hf_labels`: transformers' own `labels=` loss (no document mask) — the plain loop of the reference;
- `lightning`: the same step inside `lightning.Trainer.fit` (the old loop's framework), per-step time
  between batch starts, so its hooks, logging and progress are inside the figure;
- `data`: building a batch from the packed rows (`TrainRows.batch`), alone.

The background pre-training (if any) is paused while this runs (experiments.plumbing.timing_lock).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import LlamaForCausalLM

from experiments.plumbing.timing_lock import timing
from experiments.pretraining.config import PretrainConfig
from experiments.pretraining.data import TrainRows, summed_nll
from experiments.pretraining.loop import model_flops_per_byte
from mtpc.data import pack, sharegpt_corpus
from mtpc.tokenizer import ByteTokenizer
from tracking.runs import machine

SHAPE = dict(
    hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=2, intermediate_size=1024, max_context=4096
)


def _model(seed: int = 0):
    torch.manual_seed(seed)
    m = LlamaForCausalLM(PretrainConfig(**SHAPE).llama_config())
    return m, torch.optim.AdamW(m.parameters(), lr=1e-4)


def _step(model, opt, ids, doc, bf16: bool, labels: bool = False):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        if labels:
            loss = model(input_ids=ids, labels=ids).loss
        else:
            nll, n = summed_nll(model, ids, doc)
            loss = nll / max(n, 1)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _lightning_times(model, opt, batches, bf16: bool) -> list[float]:
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def training_step(self, batch, i):
            nll, n = summed_nll(self.model, *batch)
            loss = nll / max(n, 1)
            self.log("bpb", loss, prog_bar=True)
            return loss

        def configure_optimizers(self):
            return opt

    starts: list[float] = []

    class Clock(L.Callback):
        def on_train_batch_start(self, *a):
            starts.append(time.perf_counter())

        def on_train_end(self, *a):
            starts.append(time.perf_counter())

    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        precision="bf16-mixed" if bf16 else "32-true",
        max_steps=len(batches),
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        gradient_clip_val=1.0,
        callbacks=[Clock()],
    )
    trainer.fit(Module(), torch.utils.data.DataLoader(batches, batch_size=None))
    return [b - a for a, b in zip(starts[1:-1], starts[2:], strict=True)]  # the first step (set-up) left out


def measure(rounds: int, steps: int, threads: int) -> dict:
    corpus = sharegpt_corpus(progress=False).train[:400]
    rows = {
        s: TrainRows(pack(corpus, ByteTokenizer(), s, max_rows=64), b, 0) for s, b in ((512, 8), (2048, 2))
    }
    variants = {
        "ours": dict(seq=512, threads=threads, bf16=True),
        "ours_1thread": dict(seq=512, threads=1, bf16=True),
        "ours_2048x2": dict(seq=2048, threads=threads, bf16=True),
        "ours_fp32": dict(seq=512, threads=threads, bf16=False),
        "hf_labels": dict(seq=512, threads=threads, bf16=True, labels=True),
        "lightning": dict(seq=512, threads=threads, bf16=True, lightning=True),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(rounds):
        for name, v in variants.items():
            torch.set_num_threads(v["threads"])
            model, opt = _model()
            batches = [rows[v["seq"]].batch(r * steps + i) for i in range(steps + 1)]
            if v.get("lightning"):
                times[name] += _lightning_times(model, opt, batches, v["bf16"])
                continue
            _step(model, opt, *batches[0], v["bf16"], v.get("labels", False))  # warm-up
            for ids, doc in batches[1:]:
                t = time.perf_counter()
                _step(model, opt, ids, doc, v["bf16"], v.get("labels", False))
                times[name].append(time.perf_counter() - t)
    t = time.perf_counter()
    for i in range(200):
        rows[512].batch(i)
    data_s = (time.perf_counter() - t) / 200
    flops = lambda seq: model_flops_per_byte(_model()[0], PretrainConfig(**SHAPE, seq_len=seq))
    out = {}
    for name, v in variants.items():
        med = statistics.median(times[name])
        rate = v["seq"] * (8 if v["seq"] == 512 else 2) / med
        out[name] = {
            "bytes_per_s": rate,
            "step_s_median": med,
            "steps": len(times[name]),
            "flops_per_s": rate * flops(v["seq"]),
            "threads": v["threads"],
        }
    for name in out:
        out[name]["ratio_to_ours"] = out[name]["bytes_per_s"] / out["ours"]["bytes_per_s"]
    out["data"] = {"batch_s": data_s, "share_of_ours_step": data_s / out["ours"]["step_s_median"]}
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per variant per round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    with timing():
        res = measure(args.rounds, args.steps, args.threads)
    res["machine"] = {**machine(), "command": "python bench/bench_pretrain_loop.py"}
    for name, r in res.items():
        if "bytes_per_s" in r:
            print(
                f"{name:14s} {r['bytes_per_s']:8,.0f} B/s  {r['ratio_to_ours']:.2f}x ours  "
                f"{r['flops_per_s'] / 1e9:6.1f} GFLOP/s  ({r['steps']} steps, {r['threads']} threads)"
            )
    print(
        f"data: {res['data']['batch_s'] * 1e3:.2f} ms per batch ({res['data']['share_of_ours_step']:.2%} of a step)"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
