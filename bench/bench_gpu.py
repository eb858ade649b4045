"""GPU benchmark of the decoding engine (issue 13): step, verify, head + draft, cycle, bounds, identity.

    python bench/bench_gpu.py --default-model DIR --out $OUT/bench_gpu.json     (on the H200, < 2.5 min)
    python bench/bench_gpu.py --tiny --out /tmp/bench_gpu.json                   (CPU dry run, tiny sizes)

Parts, each written to the JSON as soon as it is done (a killed run keeps what it measured), each
skipped once `--budget-s` seconds have passed:

1. `bandwidth`: read + write bytes per second of a >= 4 GiB device-to-device copy.
2. `llama32_3b`: a random-weight Llama with Llama-3.2-3B's shape (vocab 320, bf16, batch 1,
   1 KiB context): Hugging Face `generate`'s step (greedy, EOS suppressed: the anchor) and the
   HF-layer adapter's step; our STP step (compact engine, CUDA graph); the verify pass at n = 8, 16;
   head + draft for every circuit kind at n = 16, r = 32 with full (n, r, v, d) leaves and with
   App. G leaves (rank 16 deltas); the full greedy cycle of each; plain decoding's time per byte
   (`generate_plain`: the step plus its pick, host read and Python) and every cycle against it as
   well as against the bare step; the same with the fused norm / RoPE / cache-write kernels
   (`fused_ops`, beside split-KV); the btree keep cycles fused into one call (`fused_cycle`: one CUDA
   graph per setting, greedy and sampled, beside the loop's cycle); the step and verifies with `attention="split_kv"` (live-length
   attention, a Triton kernel) beside masked SDPA over the capacity, and their largest logit difference; the step's bandwidth bound (weight + KV bytes / the measured
   bandwidth) and the bars (`BARS_3B`).
3. `default_model`: the same on the default model (`--default-model DIR`, else the shipped
   default, else skipped), in microseconds only.
4. `fp32_identity`: float32 greedy speculative == plain decoding on CUDA (every kind, keep and
   drop, graphs on), on the default model (or a random one of its shape).
5. `graph_vs_eager`: CUDA graph replay == the same static-shape forward run eagerly (step, verify,
   head + draft), max abs difference; the sampled accept captured with its generator registered
   draws what eager draws from the same seed (`sample_accept_replay_equal`).
6. `bf16`: fraction of prompts whose bf16 greedy speculative output differs from the same engine's
   bf16 plain output, and the mean first-difference position (3B shape and default model).

`--tiny` shrinks every size and runs on the CPU (no graphs there): a dry run of the code paths.
Leaves out: training, sampling-mode timings (the cycle's shapes do not depend on the mode).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_timing as et  # noqa: E402  (bench/engine_timing.py)

from mtpc import MtpcModel  # noqa: E402
from mtpc.backbones import BackboneAdapter, LlamaEngine, make_engine  # noqa: E402
from mtpc.circuits import CIRCUIT_KINDS  # noqa: E402
from mtpc.heads import HeadConfig, random_head  # noqa: E402
from mtpc.names import DECODE_MODES  # noqa: E402

# The cycle issue's GPU targets on Llama-3.2-3B's shape (bf16, n = 16, r = 32): the step within 2x its
# bandwidth bound (1.5x the stretch), the verify of 16 bytes within 1.08 steps, the greedy cycle within
# 1.15 steps for btree with full and with App. G leaves; each cycle is also reported against plain
# decoding's per-byte time (`cycle_over_plain_byte`).
BARS_3B = {"step_over_bound": 2.0, "verify16_over_step": 1.08, "cycle_btree_full_over_step": 1.15,
           "cycle_btree_appG_over_step": 1.15}  # fmt: skip


class Budget:
    def __init__(self, seconds: float):
        self.t0, self.seconds = time.time(), seconds

    def left(self) -> float:
        return self.seconds - (time.time() - self.t0)


def hardware_info(device: torch.device) -> dict:
    from tracking.runs import machine

    return {**machine(device), "device": str(device)}


def measure_backbone(
    model, device, ctx: int, args, heads: dict[str, tuple[int, int]], budget: Budget
) -> dict:
    """Steps, verifies, head + draft and cycles on one backbone (model: an HF LlamaForCausalLM on device)."""
    eos = 257
    prompt = et.random_prompts(1, ctx, seed=0, device=device)[0]
    new, R, reps = args.new_tokens, args.rounds, args.reps
    cap = ctx + new + 64
    bb = BackboneAdapter.from_hf(model, name="bench")
    hf_bb = BackboneAdapter.from_hf(model, name="bench", engine="hf")
    graphs = device.type == "cuda"
    eng = et.prefilled(LlamaEngine(bb, cap, cuda_graphs=graphs), prompt, cap)
    hf_eng = et.prefilled(make_engine(hf_bb, cap), prompt, cap)
    one = torch.tensor([65], device=device)
    g = torch.Generator().manual_seed(1)
    win = {n: torch.randint(0, 256, (n,), generator=g).to(device) for n in (8, 16)}
    out: dict = {"context": ctx, "dtype": str(model.dtype), "weight_bytes": et.weight_bytes(model),
                 "kv_bytes": et.kv_bytes(model, ctx)}  # fmt: skip
    with torch.inference_mode():
        fns = {"step": et.engine_call(eng, one, ctx), "hf_layers_step": et.engine_call(hf_eng, one, ctx)}
        fns |= {f"verify_{n}": et.engine_call(eng, ids, ctx) for n, ids in win.items()}
        res = et.timed(fns, reps, R, device=device)
    out["ms"] = res["ms"]
    out["verify16_over_step"] = et.ratio(res, "verify_16", "step")
    out["verify8_over_step"] = et.ratio(res, "verify_8", "step")
    out["graph_errors"] = dict(eng.graph_errors)
    out["split_kv"] = split_kv_part(bb, prompt, ctx, cap, win, one, reps, R, device)
    del hf_eng
    # HF generate: (long - 1 byte) / (long - 1) per round
    hf_fns = et.hf_generate_step(model, prompt, new, eos)
    with torch.inference_mode():
        hf = et.timed(hf_fns, 1, max(2, R // 2), device=device, warmup=1)
    r = hf["rounds_ms"]
    out["ms"]["hf_generate_step"] = statistics.median(
        (a - b) / (new - 1) for a, b in zip(r["hf_generate_long"], r["hf_generate_1"], strict=True)
    )
    # head + draft and the greedy cycle for each head
    hidden = eng.feed(one).draft_hidden[-1].clone()
    eng.crop(ctx)
    (
        out["head_draft_ms"],
        out["head_bytes"],
        out["cycle_ms"],
        out["cycle_mu_acc"],
        out["draft_graph_errors"],
    ) = {}, {}, {}, {}, {}
    plain = []
    for _ in range(max(2, R // 2)):  # plain decoding per byte, through the same model API as the cycles
        with torch.inference_mode():
            plain.append(
                et.plain_byte_ms(MtpcModel(bb, et.make_head(bb, "ff", args.window, 1, 0)), prompt, new)
            )
    out["ms"]["plain_per_byte"] = statistics.median(plain)
    for name, (rank, delta) in heads.items():
        for kind in CIRCUIT_KINDS:
            if budget.left() < args.reserve_s:
                out.setdefault("skipped", []).append(f"{kind}_{name}: time budget")
                continue
            key = f"{kind}_{name}"
            head = et.make_head(bb, kind, args.window, rank, delta)
            m = MtpcModel(bb, head)
            drafter = m._graphed_draft
            with torch.inference_mode():
                fns = {"eager": et.head_draft(m, hidden, one)}
                if drafter is not None:
                    fns["graph"] = lambda d=drafter: d({"hidden": hidden}, one, True)
                hd = et.timed(fns, reps, R, device=device)["ms"]
            out["head_draft_ms"][key] = hd
            out["head_bytes"][key] = et.head_bytes(head)
            cyc = []
            for _ in range(max(2, R // 2)):
                ms, gen_out = et.cycle_ms(m, prompt, new)
                cyc.append(ms)
            out["cycle_ms"][key] = statistics.median(cyc)
            out["cycle_mu_acc"][key] = gen_out.stats.mu_acc
            if drafter is not None and drafter.errors:
                out["draft_graph_errors"][key] = dict((str(k), v) for k, v in drafter.errors.items())
            del m, head, drafter
            if device.type == "cuda":
                torch.cuda.empty_cache()
    out["fused_cycle"] = fused_cycle_part(bb, prompt, new, args, heads, budget, device)
    step = out["ms"]["step"]
    out["cycle_over_step"] = {k: v / step for k, v in out["cycle_ms"].items()}
    out["fused_cycle"]["over_step"] = {k: v / step for k, v in out["fused_cycle"]["cycle_ms"].items()}
    plain_byte = out["ms"]["plain_per_byte"]  # what a user compares with: the loop's pick, host read, Python
    out["cycle_over_plain_byte"] = {k: v / plain_byte for k, v in out["cycle_ms"].items()}
    out["plain_byte_over_step"] = plain_byte / step
    out["hf_generate_step_over_step"] = out["ms"]["hf_generate_step"] / step
    return out


def fused_cycle_part(bb, prompt, new: int, args, heads: dict, budget: Budget, device) -> dict:
    """The keep cycle as one call (`MtpcModel(fused_cycle=True)`: head + draft, verify and accept in one
    CUDA graph per setting) for the btree heads, greedy and sampled, beside the loop's cycle in the same
    rounds; whether the graph was captured (else why not), and greedy output against plain decoding."""
    out: dict = {"cycle_ms": {}, "loop_cycle_ms": {}, "graph_errors": {}, "greedy_equals_plain": {}}
    for name, (rank, delta) in heads.items():
        if budget.left() < args.reserve_s:
            out.setdefault("skipped", []).append(f"btree_{name}: time budget")
            continue
        head = et.make_head(bb, "btree", args.window, rank, delta)
        fused, loop = MtpcModel(bb, head, fused_cycle=True), MtpcModel(bb, head)
        for mode in DECODE_MODES:
            key = f"btree_{name}_{mode}"
            runs: dict[str, list[float]] = {"fused": [], "loop": []}
            for r in range(max(2, args.rounds // 2)):
                for which, m in (("fused", fused), ("loop", loop)):
                    with torch.inference_mode():
                        runs[which].append(et.cycle_ms(m, prompt, new, mode=mode, seed=r)[0])
            out["cycle_ms"][key] = statistics.median(runs["fused"])
            out["loop_cycle_ms"][key] = statistics.median(runs["loop"])
        with torch.inference_mode():
            got = fused.generate(prompt, max_new_tokens=new, ban_eos=True).ids.tolist()
            want = fused.generate_plain(prompt, max_new_tokens=new, ban_eos=True).ids.tolist()
        out["greedy_equals_plain"][name] = got == want
        out["graph_errors"][name] = {str(k): c.error for k, c in fused._fused.items() if c.error}
        out.setdefault("captured", {})[name] = sum(c.graph is not None for c in fused._fused.values())
        del fused, loop, head
    return out


def split_kv_part(bb, prompt, ctx: int, cap: int, win: dict, one, reps: int, R: int, device) -> dict:
    """The step and the verifies with attention="split_kv" (live-length attention, the Triton kernel of
    mtpc/backbones/decode_attention.py) beside the default masked SDPA over the capacity, in the same
    rounds, and the largest logit difference between the two on the same calls; or why it cannot run."""
    from mtpc.backbones.decode_attention import split_kv_unsupported

    reason = split_kv_unsupported(device, bb.dtype)
    if reason:
        return {"skipped": reason}
    graphs = device.type == "cuda"
    warmup = 2
    if not graphs:  # Triton's interpreter on the CPU (a dry run): one timed pass checks the path
        reps, R, warmup = 1, 1, 0
    variants = {"sdpa": {}, "split_kv": {"attention": "split_kv"}, "fused": {"fused_ops": True},
                "split_kv_fused": {"attention": "split_kv", "fused_ops": True}}  # fmt: skip
    engines = {a: et.prefilled(LlamaEngine(bb, cap, cuda_graphs=graphs, static=True, **kw), prompt, cap)
               for a, kw in variants.items()}  # fmt: skip
    out: dict = {"max_abs_logit_diff": {}}
    with torch.inference_mode():
        for name, ids in {"step": one, **{f"verify_{n}": w for n, w in win.items()}}.items():
            got = {}
            for a, e in engines.items():
                got[a] = e.feed(ids).p_logits.float().clone()
                e.crop(ctx)
            out["max_abs_logit_diff"][name] = float((got["sdpa"] - got["split_kv"]).abs().max())
            for a in ("fused", "split_kv_fused"):
                out["max_abs_logit_diff"][f"{name}_{a}"] = float((got["sdpa"] - got[a]).abs().max())
        fns = {f"{name}_{a}": et.engine_call(e, ids, ctx) for a, e in engines.items()
               for name, ids in {"step": one, **{f"verify_{n}": w for n, w in win.items()}}.items()}  # fmt: skip
        res = et.timed(fns, reps, R, device=device, warmup=warmup)
    out["ms"] = res["ms"]
    calls = [k[: -len("_sdpa")] for k in res["ms"] if k.endswith("_sdpa")]
    for a in ("split_kv", "fused", "split_kv_fused"):
        out[f"{a}_over_sdpa"] = {c: et.ratio(res, f"{c}_{a}", f"{c}_sdpa") for c in calls}
    out["verify16_over_step"] = et.ratio(res, "verify_16_split_kv", "step_split_kv")
    out["verify16_over_step_split_kv_fused"] = et.ratio(
        res, "verify_16_split_kv_fused", "step_split_kv_fused"
    )
    out["graph_errors"] = {a: dict(e.graph_errors) for a, e in engines.items()}
    return out


def part_3b(args, device, budget: Budget, bandwidth: float | None) -> dict:
    shape, ctx = (et.TINY_SHAPE, 64) if args.tiny else (et.LLAMA32_3B_SHAPE, args.context)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    model = et.random_llama(shape, dtype=dtype, device=device)
    heads = {"full": (args.rank, 0), "appG": (args.rank, 16)}
    out = measure_backbone(model, device, ctx, args, heads, budget)
    out["shape"] = {k: v for k, v in shape.items() if k != "rope_parameters"} | {"rope": "llama3"}
    if bandwidth:
        out["bound_ms"] = (out["weight_bytes"] + out["kv_bytes"]) / bandwidth * 1e3
        out["step_over_bound"] = out["ms"]["step"] / out["bound_ms"]
        vals = {"step_over_bound": out["step_over_bound"], "verify16_over_step": out["verify16_over_step"],
                "cycle_btree_full_over_step": out["cycle_over_step"].get("btree_full"),
                "cycle_btree_appG_over_step": out["cycle_over_step"].get("btree_appG")}  # fmt: skip
        plain = {"cycle_btree_full_over_step": out["cycle_over_plain_byte"].get("btree_full"),
                 "cycle_btree_appG_over_step": out["cycle_over_plain_byte"].get("btree_appG")}  # fmt: skip
        out["bars"] = {
            k: {"bar": b, "value": vals[k], "met": vals[k] is not None and vals[k] <= b}
            | ({"over_plain_byte": plain[k]} if k in plain else {})
            for k, b in BARS_3B.items()
        }
    return out


def load_default(args, device, dtype):
    """The default model: --default-model DIR, else the shipped one, else None."""
    from mtpc.backbones import load_backbone

    for spec in [args.default_model, "default"]:
        if not spec:
            continue
        try:
            return load_backbone(spec, dtype=dtype, device=device, engine="hf").model, spec
        except (ValueError, OSError) as e:
            print(f"default model {spec!r} not loaded: {e}", file=sys.stderr)
    if args.tiny:  # the dry run exercises the code path on a random tiny model
        return et.random_llama(et.TINY_SHAPE, dtype=dtype, device=device), "random tiny (dry run)"
    return None, None


def part_default(args, device, budget: Budget) -> dict:
    model, label = load_default(args, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    if model is None:
        return {"skipped": "no default model (--default-model failed and none is shipped)"}
    out = measure_backbone(model, device, 64 if args.tiny else args.context, args, {"appG": (8, 16)}, budget)
    out["model"] = label
    out["us"] = {k: v * 1e3 for k, v in out.pop("ms").items()}
    out["head_draft_us"] = {
        k: {m: t * 1e3 for m, t in v.items()} for k, v in out.pop("head_draft_ms").items()
    }
    out["cycle_us"] = {k: v * 1e3 for k, v in out.pop("cycle_ms").items()}
    return out


def part_fp32_identity(args, device) -> dict:
    model, label = load_default(args, device, torch.float32)
    if model is None:
        model, label = (
            et.random_llama(et.TINY_SHAPE if args.tiny else et.DEFAULT_SHAPE, device=device),
            "random",
        )
    bb = BackboneAdapter.from_hf(model, name=label)
    prompts = et.random_prompts(args.identity_prompts, 64, seed=3, device=device)
    out = {"model": label}
    for kind in CIRCUIT_KINDS:
        m = MtpcModel(bb, et.make_head(bb, kind, 8, 4, 0))
        out[kind] = et.greedy_identity(m, prompts, args.new_tokens)
    m = MtpcModel(bb, et.stp_copy_head(bb, 8))
    out["cp_lm_head_copy"] = et.greedy_identity(m, prompts, args.new_tokens)
    out["all_identical"] = all(
        v["spec_eq_plain"] == v["prompts"] and v["drop_eq_plain"] == v["prompts"]
        for v in out.values()
        if isinstance(v, dict)
    )
    out["cuda_graphs"] = m.cuda_graphs
    return out


def part_graph_vs_eager(args, device) -> dict:
    if device.type != "cuda":
        return {"skipped": "no CUDA: graphs are not captured on the CPU"}
    model = et.random_llama(et.DEFAULT_SHAPE, dtype=torch.float32, device=device)
    bb = BackboneAdapter.from_hf(model, name="random")
    prompt = et.random_prompts(1, 200, device=device)[0]
    eager = et.prefilled(LlamaEngine(bb, 400, static=True, cuda_graphs=False), prompt, 400)
    graph = et.prefilled(LlamaEngine(bb, 400, static=True, cuda_graphs=True), prompt, 400)
    g = torch.Generator().manual_seed(2)
    diffs = {}
    with torch.inference_mode():
        for i, n in enumerate([1, 8, 1, 16, 8, 1]):
            ids = torch.randint(0, 256, (n,), generator=g).to(device)
            a, b = eager.feed(ids), graph.feed(ids)
            diffs[f"call{i}_T{n}"] = max(float((a.p_logits - b.p_logits).abs().max()),
                                         float((a.draft_hidden - b.draft_hidden).abs().max()))  # fmt: skip
            keep = eager.length - n + max(1, n // 2)  # roll back part of it, as after a rejection
            eager.crop(keep)
            graph.crop(keep)
        m = MtpcModel(bb, et.make_head(bb, "btree", 8, 8, 16))
        h = eager.feed(torch.tensor([66], device=device)).draft_hidden[-1].clone()
        pre = torch.tensor([67], device=device)
        x_e, q_e = m.circuit._draft(m._head_fn(h, pre), pre, greedy=True)
        x_g, q_g = m._graphed_draft({"hidden": h}, pre, True)
        diffs["head_draft_window_equal"] = bool(torch.equal(x_e, x_g))
        diffs["head_draft_logq"] = float((q_e - q_g).abs().max())
        # a known-byte head: c is the graph's static prefix input; replays with other c must follow it
        cfg = HeadConfig("btree", 8, 8, bb.vocab_size, bb.hidden_size, leaf_delta_rank=16, known_byte=True)
        mk = MtpcModel(bb, random_head(cfg, 0, device=device, dtype=bb.dtype, sum_std=1.0))
        equal, worst = True, 0.0
        for c in (67, 10, 200):
            pre = torch.tensor([c], device=device)
            x_e, q_e = mk.circuit._draft(mk._head_fn(h, pre), pre, greedy=True)
            x_g, q_g = mk._graphed_draft({"hidden": h}, pre, True)
            equal, worst = equal and bool(torch.equal(x_e, x_g)), max(worst, float((q_e - q_g).abs().max()))
        diffs["known_byte_head_draft_window_equal"] = equal
        diffs["known_byte_head_draft_logq"] = worst
        diffs["sample_accept_replay_equal"] = sampled_accept_replays_as_eager(bb.vocab_size, device)
    return {"max_abs_diff": diffs, "graphs_captured": sorted(graph._graphs), "graph_errors": graph.graph_errors,
            "draft_graph_errors": {str(k): v for k, v in m._graphed_draft.errors.items()},
            "known_byte_draft_graph_errors": {str(k): v for k, v in mk._graphed_draft.errors.items()}}  # fmt: skip


def sampled_accept_replays_as_eager(v: int, device, n: int = 8, calls: int = 16) -> bool:
    """The sampled accept (`sample_verify` with the production chooser, an exponential race on the
    generator) captured as a CUDA graph with its generator registered: replays from a seed give the
    (s, extra) eager calls give from the same seed, call after call (no host read inside)."""
    from mtpc.backbones.graphs import CapturedFn
    from mtpc.speculative.acceptance import TorchChooser, sample_verify

    g = torch.Generator().manual_seed(3)
    p = torch.softmax(2 * torch.randn(n + 1, v, generator=g), -1).to(device)
    q = torch.softmax(2 * torch.randn(n, v, generator=g), -1).to(device)
    draft = torch.multinomial(q.cpu(), 1, generator=g).view(-1).to(device)
    gen = torch.Generator(device=device)

    def accept(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
        s, extra = sample_verify(draft, p, q, TorchChooser(gen))
        return torch.stack([s, extra])

    gen.manual_seed(5)
    graph = CapturedFn(accept, [p, q, draft], generator=gen)
    runs = {}
    for name, fn in (("eager", accept), ("replay", graph)):
        gen.manual_seed(7)
        runs[name] = [fn(p, q, draft).tolist() for _ in range(calls)]
    return runs["eager"] == runs["replay"] and len({tuple(r) for r in runs["eager"]}) > 1


def part_bf16(args, device) -> dict:
    out = {}
    prompts = et.random_prompts(args.bf16_prompts, 64, seed=4, device=device)
    dt = torch.float32 if args.tiny else torch.bfloat16
    models = {
        "llama32_3b": lambda: (
            et.random_llama(et.TINY_SHAPE if args.tiny else et.LLAMA32_3B_SHAPE, dtype=dt, device=device),
            "random",
        )
    }
    models["default_model"] = lambda: load_default(args, device, dt)
    for name, build in models.items():
        model, label = build()
        if model is None:
            out[name] = {"skipped": "no default model"}
            continue
        bb = BackboneAdapter.from_hf(model, name=label)
        m = MtpcModel(bb, et.stp_copy_head(bb, 16))
        out[name] = et.bf16_divergence(m, prompts, args.new_tokens) | {
            "dtype": str(dt),
            "head": "cp r=2 from the lm_head, n=16",
        }
        del model, bb, m
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/gpu.json")
    ap.add_argument(
        "--default-model", default="", help="directory of the default model (else the shipped one)"
    )
    ap.add_argument("--tiny", action="store_true", help="CPU dry run with tiny sizes")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--identity-prompts", type=int, default=3)
    ap.add_argument("--bf16-prompts", type=int, default=10)
    ap.add_argument("--budget-s", type=float, default=140.0, help="skip what is left after this many seconds")
    ap.add_argument(
        "--reserve-s", type=float, default=25.0, help="stop adding heads when less than this is left"
    )
    ap.add_argument("--copy-gib", type=float, default=4.0)
    args = ap.parse_args(argv)
    if args.tiny:
        torch.set_num_threads(1)  # tiny ops on a shared CPU: one thread is ~10x faster than two
        args.window, args.rank, args.rounds, args.reps, args.new_tokens = 4, 4, 2, 2, 12
        args.identity_prompts, args.bf16_prompts, args.copy_gib = 1, 2, 0.05
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    budget = Budget(args.budget_s)
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    report: dict = {"hardware": hardware_info(device), "command": "python bench/bench_gpu.py " + " ".join(sys.argv[1:]),
                    "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "tiny": args.tiny,
                    "settings": {k: v for k, v in vars(args).items() if k != "out"}}  # fmt: skip

    def save():
        report["wall_s"] = time.time() - budget.t0
        out_path.write_text(json.dumps(report, indent=2, default=str) + "\n")

    bandwidth = None
    parts = [
        (
            "bandwidth",
            lambda: {"bytes_per_s": et.copy_bandwidth(device, args.copy_gib), "gib": args.copy_gib},
        ),
        ("llama32_3b", lambda: part_3b(args, device, budget, bandwidth)),
        ("fp32_identity", lambda: part_fp32_identity(args, device)),
        ("graph_vs_eager", lambda: part_graph_vs_eager(args, device)),
        ("default_model", lambda: part_default(args, device, budget)),
        ("bf16", lambda: part_bf16(args, device)),
    ]
    for name, run in parts:
        if budget.left() <= 0:
            report[name] = {"skipped": "time budget"}
            continue
        t0 = time.time()
        try:
            report[name] = run()
        except Exception as e:  # noqa: BLE001 - record and go on: one failing part must not lose the others
            tb = traceback.extract_tb(e.__traceback__)[
                -4:
            ]  # where it broke: the device run is read afterwards
            report[name] = {
                "error": f"{type(e).__name__}: {e}",
                "where": [f"{f.filename}:{f.lineno} {f.name}" for f in tb],
            }
        report[name]["part_s"] = time.time() - t0
        if name == "bandwidth" and "bytes_per_s" in report[name]:
            bandwidth = report[name]["bytes_per_s"]
        save()
        print(f"{name}: {time.time() - t0:.1f} s", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    save()
    print(json.dumps({k: v.get("bars", v.get("skipped", v.get("error", "ok"))) if isinstance(v, dict) else v
                      for k, v in report.items() if k in dict(parts)}, default=str))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
