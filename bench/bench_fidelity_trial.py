"""Short measured trial for sizing the fidelity study (sweeps/fidelity.yaml) on the CPU.

    python bench/bench_fidelity_trial.py --out bench/results/fidelity_trial_cpu.json
    python bench/bench_fidelity_trial.py --estimate bench/results/fidelity_trial_cpu.json sweeps/fidelity.yaml
    python bench/bench_fidelity_trial.py --rate --out bench/results/head_training_rate_cpu.json

Measure: for a few representative heads on the default model (the shipped one when present, else a
random-weight Llama of the CPU default's shape: d 512, 4 layers, 8 heads, 2 KV heads, MLP 1024,
vocab 320, labelled "random-default-shape"), train `--steps` optimizer steps of the study's training
config (experiments/configs/default.yaml: 2 x 512 bytes, App. G leaves) and time every step after
the first, one validation pass, the fixed per-trial overhead (backbone + data setup, export), and
`--generations` evaluations of 128 bytes (greedy and sampling) on held-out prompts, once with STP
beside the head and once the head alone (eval.stp: false).
One thread, as every sweep worker runs. Writes JSON.

Rate (`--rate`): the head-training figure — trained byte positions (rows x bytes of a step) per
thread-CPU second of the optimizer step alone (validation, set-up and the cache's fill excluded) — for
the demo's head (btree n = 4, r = 4) and the bench head (btree n = 8, r = 16, beta = 0.5), App. G
leaves 16, on the shipped default and the training config's own rows, at k = 0 and k = 1, with where
a step's time goes (trunk or cache read, teacher, window loss forward, backward, Adam). At k = 0 two
arms side by side, round by round in one process: the trunk run every step, and a warm hidden-state
cache (experiments/training/hidden_cache.py; filled first, its fill time reported apart). k = 1 has no cache
(the LoRA top trains). Medians over the timed steps of every round.

Estimate: for every grid point of a sweep spec, the nearest measured head (same circuit, window,
distillation on/off, LoRA depth if measured, else the closest) gives per-step, per-validation and
per-generation seconds; the total over the grid is printed per slice, in CPU-minutes (divide by
the number of workers for wall time on an otherwise idle machine).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

POINTS = (  # circuit, window, rank, lora_depth, kl_beta
    ("ff", 8, 1, 0, 0.0),
    ("cp", 8, 32, 0, 0.0),
    ("cp", 8, 32, 0, 0.5),
    ("btree", 8, 32, 0, 0.0),
    ("hmm", 16, 32, 0, 0.0),
    ("btree", 16, 32, 0, 0.0),
    ("btree", 16, 32, 2, 0.0),
    ("ff", 16, 1, 0, 0.0),
)
GEN_BYTES = 128


def random_default_shape(directory: Path) -> str:
    """A random-weight byte Llama of the CPU default's shape, saved with the byte tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from mtpc.tokenizer import ByteTokenizer

    cfg = LlamaConfig(
        vocab_size=320,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=257,
        eos_token_id=258,
        pad_token_id=256,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(directory)
    ByteTokenizer().save_pretrained(directory)
    return str(directory)


def measure(args: argparse.Namespace) -> dict:
    import torch
    from lightning.pytorch.callbacks import Callback

    from experiments.evaluation.config import EvalConfig
    from experiments.evaluation.decoding import evaluate_heads, hardware
    from experiments.evaluation.prompts import load_prompt_sets
    from experiments.training.fit import train_head
    from experiments.training.trial import load_for_eval
    from mtpc.backbones import default_model_dir
    from mtpc.names import DECODE_MODES

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="mtpc-fidelity-bench-"))
    if (default_model_dir() / "config.json").is_file():
        backbone, label = "default", "default (shipped)"
    else:
        backbone, label = random_default_shape(tmp / "bb"), "random-default-shape"
    prompts = load_prompt_sets("heldout", args.generations, 1, seed=0)

    class StepTimer(Callback):
        def __init__(self):
            self.t, self.steps, self.val = None, [], []

        def on_train_batch_start(self, *a):
            self.t = time.perf_counter()

        def on_train_batch_end(self, *a):
            self.steps.append(time.perf_counter() - self.t)

        def on_validation_start(self, *a):
            self.v = time.perf_counter()

        def on_validation_end(self, *a):
            self.val.append(time.perf_counter() - self.v)

    rows = []
    points = (
        POINTS
        if not args.points
        else [
            (c, int(n), int(r), int(k), float(b))
            for c, n, r, k, b in (p.split(":") for p in args.points.split(","))
        ]
    )
    for kind, n, r, k, beta in points:
        timer = StepTimer()
        over = {
            "model.backbone": backbone,
            "model.circuit": kind,
            "model.window": n,
            "model.rank": r,
            "model.lora_depth": k,
            "model.lora_start_epoch": 0,
            "model.kl_beta": beta,
            "trainer.max_steps": args.steps,
            "run.tracking": False,
            "run.checkpoint_every_n_steps": 0,
        }
        t0 = time.perf_counter()
        res = train_head("default", over, run_dir=tmp / f"{kind}{n}{k}{beta}", callbacks=[timer])
        train_wall = time.perf_counter() - t0
        t1 = time.perf_counter()
        model = load_for_eval(res.head_dir, res.config)
        load_s = time.perf_counter() - t1
        t2 = time.perf_counter()
        online = EvalConfig(
            modes=DECODE_MODES, max_new_tokens=GEN_BYTES, acceptance="online"
        )  # every prompt timed
        evaluate_heads({"head": model}, prompts, online, progress=False)
        eval_s = time.perf_counter() - t2
        t3 = time.perf_counter()
        evaluate_heads({"head": model}, prompts, replace(online, stp=False), progress=False)
        head_s = time.perf_counter() - t3
        step_s = statistics.median(timer.steps[1:])
        row = {
            "circuit": kind,
            "window": n,
            "rank": r,
            "lora_depth": k,
            "kl_beta": beta,
            "step_s": step_s,
            "steps_timed": len(timer.steps) - 1,
            "validation_s": statistics.median(timer.val),
            "overhead_s": train_wall - sum(timer.steps) - sum(timer.val) + load_s,
            "generation_pair_s": eval_s / (2 * args.generations),  # STP + head, per 128-byte answer
            "generation_head_s": head_s / (2 * args.generations),  # the head alone (eval.stp: false)
            "val_window_nll": res.metrics.get("val_window_nll"),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {
        "backbone": label,
        "hardware": hardware(),
        "threads": 1,
        "steps": args.steps,
        "generations": args.generations,
        "generation_bytes": GEN_BYTES,
        "load_average_at_end": os.getloadavg(),
        "note": "shared 2-core CPU; other jobs were running (see load average)",
        "points": rows,
    }


RATE_POINTS = (("btree", 4, 4, 0.0), ("btree", 8, 16, 0.5))  # the demo's head, the bench head


def rate(args: argparse.Namespace) -> dict:
    """The training-rate figure (module docstring) for RATE_POINTS at k = 0 (with and without the cache)
    and k = 1."""
    import torch

    from experiments.evaluation.decoding import hardware
    from experiments.training.config import load_config
    from experiments.training.datamodule import ChatDataModule
    from experiments.training.hidden_cache import HiddenCache
    from experiments.training.module import MtpcTrainModule
    from mtpc.losses import window_loss

    torch.set_num_threads(1)
    base = load_config("default")
    data = ChatDataModule(base.data)
    data.setup("fit")
    loader = iter(data.train_dataloader())
    batches = [next(loader) for _ in range(args.rate_steps)]
    tmp = Path(tempfile.mkdtemp(prefix="mtpc-rate-bench-"))
    rows = []
    for kind, n, r, beta in RATE_POINTS:
        for k in (0, 1):
            cfg = {
                **vars(base.model),
                "circuit": kind,
                "window": n,
                "rank": r,
                "kl_beta": beta,
                "lora_depth": k,
            }
            arms = ["trunk", "cache"] if k == 0 else ["trunk"]
            modules = {}
            for arm in arms:
                torch.manual_seed(0)
                m = MtpcTrainModule(**cfg)
                m.train()
                if arm == "cache":
                    m.hidden_cache = HiddenCache(tmp / "hidden", m.backbone)
                    for b in batches:  # the fill, reported apart
                        m.hidden_cache.get(b[0], lambda b=b, m=m: m.backbone(b[0]).verify_hidden)
                params = [*m.head.parameters(), *m.lora_params]
                modules[arm] = (m, torch.optim.Adam(params, lr=1e-3))
            parts = {
                arm: {p: [] for p in ("trunk", "teacher", "loss_forward", "backward", "adam", "step")}
                for arm in arms
            }
            for _ in range(args.rate_rounds):
                for arm in arms:
                    m, opt = modules[arm]
                    for i, (ids, mask, doc, *_) in enumerate(batches):
                        t = [time.thread_time()]
                        if m.hidden_cache is not None:
                            h = m.hidden_cache.get(ids, lambda m=m, ids=ids: m.backbone(ids).verify_hidden)
                            e = verify = h
                        else:
                            with torch.set_grad_enabled(k > 0):
                                out = m.backbone(ids)
                            e, verify = out.draft_hidden, out.verify_hidden
                        t.append(time.thread_time())
                        logits = None
                        if beta > 0:
                            with torch.no_grad():
                                logits = m.backbone.stp_logits(verify.detach())
                        t.append(time.thread_time())
                        res = window_loss(
                            m.head,
                            e,
                            ids,
                            mask,
                            doc,
                            chunk_size=m.config.chunk_size,
                            teacher_logits=logits,
                            kl_beta=beta,
                        )
                        t.append(time.thread_time())
                        res.loss.backward()
                        t.append(time.thread_time())
                        opt.step()
                        opt.zero_grad(set_to_none=True)
                        t.append(time.thread_time())
                        if i == 0:
                            continue  # the first step of a round warms allocations
                        for name, a, b in zip(
                            ("trunk", "teacher", "loss_forward", "backward", "adam"), t, t[1:], strict=False
                        ):
                            parts[arm][name].append(b - a)
                        parts[arm]["step"].append(t[-1] - t[0])
            positions = batches[0][0].numel()
            for arm in arms:
                med = {p: statistics.median(v) for p, v in parts[arm].items()}
                row = {
                    "circuit": kind,
                    "window": n,
                    "rank": r,
                    "kl_beta": beta,
                    "lora_depth": k,
                    "arm": arm,
                    "positions_per_step": positions,
                    "step_cpu_s": med["step"],
                    "positions_per_cpu_s": positions / med["step"],
                    "share": {p: med[p] / med["step"] for p in med if p != "step"},
                    "steps_timed": len(parts[arm]["step"]),
                }
                if arm == "cache":
                    hc = modules[arm][0].hidden_cache
                    row.update(
                        cache_fill_s=hc.fill_s,
                        cache_fill_batches=hc.misses,
                        speedup_vs_trunk=statistics.median(parts["trunk"]["step"]) / med["step"],
                    )
                rows.append(row)
                print(json.dumps(row), flush=True)
    return {
        "figure": "trained byte positions per thread-CPU second of the optimizer step (validation, set-up "
        "and the cache fill excluded)",
        "backbone": "default (shipped)",
        "hardware": hardware(),
        "threads": 1,
        "steps_per_round": args.rate_steps - 1,
        "rounds": args.rate_rounds,
        "load_average_at_end": os.getloadavg(),
        "points": rows,
    }


def _nearest(rows: list[dict], point: dict) -> dict:
    """The measured head most like `point`: same circuit, then window, rank, distillation on/off, k."""

    def score(r):
        return (
            (r["circuit"] != point["circuit"]) * 1000
            + (r["window"] != point["window"]) * 100
            + abs(math.log2(r["rank"]) - math.log2(point["rank"])) * 10
            + ((r["kl_beta"] > 0) != (point.get("kl_beta", 0.0) > 0)) * 5
            + abs(r["lora_depth"] - point["lora_depth"])
        )

    return min(rows, key=score)


def estimate(measured: Path, spec_path: str, overrides: list[str]) -> dict:
    import yaml

    from sweeps.spec import load_spec

    data = json.loads(measured.read_text())
    over = {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in overrides)}
    spec = load_spec(spec_path, env={}, overrides=over)
    trainer = spec.train.trainer
    steps = trainer.get("max_steps", 200)
    every = trainer.get("val_check_interval", steps)
    validations = max(1, steps // every)
    e = spec.eval
    passes = sum(1 for i, _ in enumerate(e.temperatures) for m in e.modes if m == "sample" or i == 0)
    gens = (
        passes
        * len(e.eos)
        * (e.sets + e.dev_sets)
        * e.n_prompts
        * (e.max_new_tokens / data["generation_bytes"])
    )
    per_slice: dict[str, float] = {}
    total = 0.0
    from sweeps.spec import grid_key

    for p in spec.grid:
        r = _nearest(data["points"], p)
        per_answer = r["generation_pair_s"] if e.stp else r.get("generation_head_s", r["generation_pair_s"])
        s = steps * r["step_s"] + validations * r["validation_s"] + r["overhead_s"] + gens * per_answer
        total += s
        for sl in spec.grid_slices[grid_key(p)][:1]:  # charged to its first slice
            per_slice[sl] = per_slice.get(sl, 0.0) + s
    return {
        "points": len(spec.grid),
        "cpu_minutes": total / 60,
        "per_slice_cpu_minutes": {k: v / 60 for k, v in per_slice.items()},
        "steps": steps,
        "validations": validations,
        "generations_per_trial": gens,
        "measured": str(measured),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per head (the first is not timed)")
    p.add_argument("--generations", type=int, default=2, help="held-out prompts evaluated per head and mode")
    p.add_argument("--points", default=None, help="circuit:n:r:k:kl_beta,... instead of the built-in list")
    p.add_argument("--merge", type=Path, default=None, help="append the measured points to this earlier JSON")
    p.add_argument(
        "--estimate", nargs=2, metavar=("MEASURED_JSON", "SPEC"), help="estimate a spec's CPU time"
    )
    p.add_argument("--set", action="append", default=[], help="spec override key=value (with --estimate)")
    p.add_argument(
        "--rate", action="store_true", help="the head-training rate figure instead (module docstring)"
    )
    p.add_argument(
        "--rate-steps", type=int, default=6, help="batches per round with --rate (the first warms)"
    )
    p.add_argument(
        "--rate-rounds", type=int, default=3, help="rounds with --rate (arms interleaved by round)"
    )
    args = p.parse_args()
    if args.estimate:
        print(json.dumps(estimate(Path(args.estimate[0]), args.estimate[1], args.set), indent=2))
        return
    report = rate(args) if args.rate else measure(args)
    if args.merge is not None and args.merge.is_file():
        old = json.loads(args.merge.read_text())
        report["points"] = old["points"] + report["points"]
        report["earlier_run"] = {k: v for k, v in old.items() if k != "points"}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    from experiments.plumbing.timing_lock import timing

    with timing(progress=True):  # one timer on the machine; the background pre-training paused
        main()
