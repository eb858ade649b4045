"""Head + draft at batch 1 against its floor, reading the head's weights (issue 13, item 3).

For each head (kind, n, r, App. G leaf delta rank k; d, v, float32, one intra-op thread) it times,
side by side in one process, round by round:
  old:        circuit._draft(circuit.normalize(head(e)), [c], g, greedy) (the loop's call before
              `decode_params`: the training forward, then normalize, then the fused draft)
  new:        dec.draft(e, [c], g, greedy), dec = head.decoder() (= circuit._draft(dec.params(e), ...))
  addmm:      the same with HeadDecoder(head, onednn=False): MKL's addmm over a transposed copy
              instead of oneDNN's product (the default on the CPU in float32), side by side
  new_greedy_x_only: dec.draft(e, [c], greedy=True, conditionals=False) (what greedy verification reads)
  new_params: dec.params(e) alone (the head part of `new`)
  draft_hot:  circuit._draft(params, [c], g, greedy) alone, on parameters just computed (hot)
each in sampling and greedy mode, and the floor: head weight bytes / read bandwidth.

Two conditions, each timed call preceded by:
  loop: one 1-byte step of a random-weight byte Llama of the default model's shape (4 layers,
        d 512, vocab 320, float32, 37 MB, 512 bytes of KV cache; Hugging Face forward), as in the
        decoding loop: the step streams its weights through the caches, then the head runs
        (the bar's condition);
  cold: a read of a 256 MB buffer (8x the 32 MB L3 of the machine measured): nothing of the head,
        nor of torch's own code and data, is left in any cache (a harsher start than the loop).
The floor's bandwidth is that 256 MB read, timed before every cold call (single thread, cache-cold,
under the same load as the calls); its median is used. Medians over the rounds, wall and thread
CPU time (CPU time leaves out waiting for a core on a shared machine).

Bar: new (wall, loop) <= 1.3 x floor + 0.3 ms, for cp and btree at n = 16, r = 8, d = 512, v = 320,
k = 16; also checked on CPU time (floor from the read's CPU time), the robust version on a shared machine.
Usage:  python bench/bench_head.py --out bench/results/head_cpu.json    (~3 minutes)
Leaves out: the acceptance test and the backbone's own timing.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from mtpc.names import DECODE_MODES

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_circuits import machine  # noqa: E402

from mtpc.heads import HeadConfig, HeadDecoder, MtpcHead, random_head  # noqa: E402

HEADS = [("cp", 16, 8), ("btree", 16, 8), ("btree", 16, 32), ("hmm", 16, 8), ("ff", 16, 1)]
BAR_HEADS = {("cp", 16, 8), ("btree", 16, 8)}
FLUSH_BYTES = 256 * 2**20


def make_head(kind: str, n: int, r: int, v: int, d: int, k: int, seed: int) -> MtpcHead:
    """A head parameterised like the trained ones (App. G leaves, float32), with random weights:
    leaves from a random unembedding (init_from_unembeddings), sum weights small random."""
    return random_head(
        HeadConfig(kind, n, r, v, d, leaf_delta_rank=k), seed, init="unembedding", sum_std=0.02
    )


class StandIn:
    """The step between head calls in the `loop` condition: a random-weight Llama of the default
    model's shape, one 1-byte step on a 512-byte KV cache, cropped back after each step."""

    def __init__(self, vocab: int, hidden: int, context: int = 512, seed: int = 0):
        from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

        torch.manual_seed(seed)
        cfg = LlamaConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
        )
        self.model = LlamaForCausalLM(cfg).eval()
        self.bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        params = inspect.signature(self.model.forward).parameters  # transformers renamed the cache argument
        self.kw = {"cache" if "cache" in params else "past_key_values": DynamicCache(), "use_cache": True}
        self.model(input_ids=torch.randint(0, 256, (1, context)), **self.kw)
        self.ids = torch.tensor([[65]])

    def __call__(self) -> None:
        self.model(input_ids=self.ids, **self.kw)
        next(iter(self.kw.values())).crop(-1)  # back to the same context length


def bench_head(kind, n, r, v, d, k, rounds, flush, step, seed=0) -> dict:
    head = make_head(kind, n, r, v, d, k, seed)  # built outside inference mode, as a loaded head is
    with torch.inference_mode():
        return _bench_head(head, kind, n, r, v, d, k, rounds, flush, step, seed)


def _bench_head(head, kind, n, r, v, d, k, rounds, flush, step, seed) -> dict:
    c, dec = head.circuit, head.decoder()  # oneDNN's product where it runs (the default)
    mkl = HeadDecoder(head, onednn=False)  # the addmm over a transposed copy, side by side
    nbytes = sum(p.numel() * p.element_size() for p in head.parameters())
    e = torch.randn(d, generator=torch.Generator().manual_seed(seed + 1))
    prefix = torch.tensor([7])
    g = torch.Generator().manual_seed(seed + 2)
    paths = {}
    for greedy, mode in ((False, "sample"), (True, "greedy")):
        paths[f"old_{mode}"] = lambda greedy=greedy: c._draft(
            c.normalize(head(e)), prefix, generator=g, greedy=greedy
        )
        paths[f"new_{mode}"] = lambda greedy=greedy: dec.draft(e, prefix, generator=g, greedy=greedy)
        paths[f"addmm_{mode}"] = lambda greedy=greedy: mkl.draft(e, prefix, generator=g, greedy=greedy)
    paths["new_greedy_x_only"] = lambda: dec.draft(e, prefix, generator=g, greedy=True, conditionals=False)
    paths["old_params"] = lambda: c.normalize(head(e))
    paths["new_params"] = lambda: dec.params(e)
    paths["addmm_params"] = lambda: mkl.params(e)
    q = dec.params(e)
    for greedy, mode in ((False, "sample"), (True, "greedy")):
        paths[f"draft_{mode}"] = lambda greedy=greedy: c._draft(q, prefix, generator=g, greedy=greedy)
    conditions = {"loop": step, "cold": flush.sum}
    wall = {(cond, p): [] for cond in conditions for p in paths}
    cpu = {key: [] for key in wall}
    read, read_cpu = [], []
    for round_ in range(rounds + 1):  # round 0 warms up
        for cond, before in conditions.items():
            for name, fn in paths.items():
                t, tc = time.perf_counter(), time.thread_time()
                before()
                t0, c0 = time.perf_counter(), time.thread_time()
                fn()
                c1, t1 = time.thread_time(), time.perf_counter()
                if round_:
                    if cond == "cold":  # the 256 MB read: the floor's bandwidth
                        read.append(t0 - t)
                        read_cpu.append(c0 - tc)
                    wall[(cond, name)].append(t1 - t0)
                    cpu[(cond, name)].append(c1 - c0)
    size = flush.numel() * flush.element_size()
    row = {
        "kind": kind,
        "n": n,
        "r": r,
        "v": v,
        "d": d,
        "leaf_delta_rank": k,
        "dtype": "float32",
        "params": sum(p.numel() for p in head.parameters()),
        "weight_bytes": nbytes,
        "new_onednn": dec.onednn,
    }
    for suffix, reads in (
        ("", read),
        ("_cpu", read_cpu),
    ):  # wall, and CPU time (robust to waiting for a core)
        bandwidth = size / statistics.median(reads)  # bytes / s
        row[f"read{suffix}_GBps"] = bandwidth / 1e9
        row[f"floor{suffix}_ms"] = 1e3 * nbytes / bandwidth
        row[f"bar{suffix}_ms"] = 1.3 * row[f"floor{suffix}_ms"] + 0.3
    for cond, name in wall:
        row[f"{cond}_{name}_ms"] = 1e3 * statistics.median(wall[(cond, name)])
        row[f"{cond}_{name}_cpu_ms"] = 1e3 * statistics.median(cpu[(cond, name)])
    for cond in conditions:
        for mode in DECODE_MODES:
            row[f"{cond}_new_{mode}_over_floor"] = row[f"{cond}_new_{mode}_ms"] / row["floor_ms"]
            row[f"{cond}_new_{mode}_cpu_over_floor_cpu"] = (
                row[f"{cond}_new_{mode}_cpu_ms"] / row["floor_cpu_ms"]
            )
            row[f"{cond}_old_over_new_{mode}"] = row[f"{cond}_old_{mode}_ms"] / row[f"{cond}_new_{mode}_ms"]
            row[f"{cond}_new_over_addmm_{mode}"] = (
                row[f"{cond}_new_{mode}_ms"] / row[f"{cond}_addmm_{mode}_ms"]
            )
    for mode in ("sample", "greedy", "greedy_x_only"):
        row[f"bar_met_{mode}"] = row[f"loop_new_{mode}_ms"] <= row["bar_ms"]
        row[f"bar_met_{mode}_cpu"] = row[f"loop_new_{mode}_cpu_ms"] <= row["bar_cpu_ms"]
    return row


def table(rows) -> str:
    cols = [
        "kind",
        "r",
        "read_GBps",
        "floor_ms",
        "bar_ms",
        "loop_old_sample_ms",
        "loop_new_sample_ms",
        "loop_addmm_greedy_ms",
        "loop_new_greedy_ms",
        "loop_new_greedy_x_only_ms",
        "loop_new_params_ms",
        "loop_draft_sample_ms",
        "cold_new_sample_ms",
        "read_cpu_GBps",
        "bar_cpu_ms",
        "loop_new_sample_cpu_ms",
        "loop_new_greedy_cpu_ms",
    ]
    out = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n"
    for row in rows:
        out += (
            "| "
            + " | ".join(f"{row[c]:.3f}" if isinstance(row[c], float) else str(row[c]) for c in cols)
            + " |\n"
        )
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench/results/head_cpu.json"))
    ap.add_argument(
        "--rounds",
        type=int,
        default=30,
        help="timed rounds per head (each times every path once per condition)",
    )
    ap.add_argument("--vocab", type=int, default=320)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument(
        "--leaf-delta-rank", type=int, default=16, help="App. G delta rank k of the trained heads"
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--heads", nargs="+", default=[f"{k}:{n}:{r}" for k, n, r in HEADS], help="kind:n:r ...")
    args = ap.parse_args(argv)
    heads = []
    for spec in args.heads:
        try:
            kind, n, r = spec.split(":")
            heads.append((kind, int(n), int(r)))
        except ValueError:
            ap.error(f"--heads: expected kind:n:r (e.g. btree:16:8), got {spec!r}")
    torch.set_num_threads(args.threads)
    info = machine()
    flush = torch.ones(FLUSH_BYTES // 4)
    rows = []
    with torch.inference_mode():
        step = StandIn(args.vocab, args.hidden)
    info["stand_in_step_bytes"] = step.bytes
    for kind, n, r in heads:
        row = bench_head(kind, n, r, args.vocab, args.hidden, args.leaf_delta_rank, args.rounds, flush, step)
        print(json.dumps(row), flush=True)
        rows.append(row)
    info["loadavg_end"] = list(os.getloadavg())
    checks = {
        f"{row['kind']}_n{row['n']}_r{row['r']}_bar_met_{m}{t}": row[f"bar_met_{m}{t}"]
        for row in rows
        if (row["kind"], row["n"], row["r"]) in BAR_HEADS
        for m in ("sample", "greedy", "greedy_x_only")
        for t in ("", "_cpu")
    }
    result = {
        "machine": info,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "heads": rows,
        "checks": checks,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(table(rows))
    print(json.dumps(checks, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    from experiments.plumbing.timing_lock import timing

    with timing(progress=True):  # one timer on the machine; the background pre-training paused
        main()
