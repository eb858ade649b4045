"""CPU benchmark of decoding: the engine bars of issue 13, bf16 divergence, and every circuit's speedup.

    python bench/bench_decode.py --out bench/results/decode_cpu.json     (make bench-decode)
    python bench/bench_decode.py --sections engine,bf16                  (no trained heads needed)

Sections (each run in this process, 1 intra-op thread; the JSON keeps sections not re-run):

- `engine`: on the default model (its weights with `--model default` or a directory; else a
  random-weight Llama of its shape, vocab 320, d 512, 4 layers, 8 heads, 2 kv heads,
  intermediate 1024), side by side, interleaved round by round: the weight-read floor of a step
  (one matrix-vector product per weight), our plain step (compact engine, k = 0, and with the k = 1
  LoRA draft top, low-rank and merged; the default views weight layout and the packed one side
  by side for the step, the verify and the cycle), the HF-layer adapter's step, one step of Hugging Face
  `generate` (greedy, EOS suppressed), the verify pass at n = 8 / 16, head + draft per circuit,
  and the speculative cycle of a btree head n = 8, r = 8, App. G leaves, k = 0; greedy outputs of
  HF generate, our plain decoding and our speculative decoding compared byte for byte; and the loop's
  cycle in its parts (verify = feed + crop, head, draft, accept, Python) beside the plain step
  (`generate_plain` per byte), same rounds, same clock, for a random btree n = 8, r = 16, App. G 16
  head (float32 weights, and rounded to bf16 numbers as a shipped head is stored) and the shipped
  default head when `--model default`, that one also with the cycle's native calls off
  (`$MTPC_NATIVE_CYCLE=0`: head, draft and accept as torch ops) (`cycle_parts`). Times are
  this thread's CPU time by default (`--clock cpu`: a shared core's other jobs drop out; memory
  contention does not); generations are timed as (n bytes - 1 byte) / steps or cycles, the same
  way for HF `generate`. `--compile` adds the compact engine under torch.compile.
- `bf16`: the fraction of prompts whose bf16 greedy speculative output differs from the same
  engine's bf16 plain greedy output, and the mean position of the first difference.
- `heads`: for each window n and circuit kind a trained head export when one exists
  (`<heads-dir>/default-<kind>-n<n>-r*`, as experiments/training/nll_table.py writes them; default
  heads-dir = mtpc.paths.cache_dir()/heads), else a fresh random head (rank 8, seed 0, labelled
  `"source": "random"`); all heads of one n share one backbone and run, with STP, on the same
  held-out prompts (experiments.evaluate.evaluate_heads), greedy and sampling, keep and drop.
  Reports mu_acc, tokens_per_cycle, mu_lat, throughput, speedup_vs_stp, speedup_vs_ff.

Absolute times on a shared CPU are not meaningful; the ratios are measured side by side.
Leaves out: GPU measurements (bench/bench_gpu.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_timing as et  # noqa: E402  (bench/engine_timing.py)

from experiments.evaluation.config import EvalConfig  # noqa: E402
from experiments.evaluation.decoding import evaluate_heads, hardware  # noqa: E402
from experiments.evaluation.prompts import load_prompt_sets  # noqa: E402
from mtpc import MtpcModel  # noqa: E402
from mtpc.names import CIRCUIT_KINDS, DECODE_MODES, EXTRA_TOKEN_OPTIONS, point_rank  # noqa: E402
from mtpc.paths import cache_dir  # noqa: E402

SECTIONS = ("engine", "bf16", "heads")
BARS = {"step_over_floor": 1.15, "k1_draft_top_adds": 0.15, "cycle_over_hf_generate_step": 1.15}

REPORT = (
    "mu_acc",
    "tokens_per_cycle",
    "mu_lat",
    "throughput",
    "speedup_vs_stp",
    "speedup_vs_ff",
    "degenerate_fraction",
    "distinct_4gram_ratio",
)  # degeneracy beside every acceptance figure


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


# ------------------------------------------------------------------------------------ engine section


def default_shape() -> dict:
    """The default model's shape: mtpc/default_model/config.json when the repo ships it, else DEFAULT_SHAPE."""
    path = Path(__file__).resolve().parents[1] / "mtpc" / "default_model" / "config.json"
    if not path.is_file():
        return dict(et.DEFAULT_SHAPE)
    cfg = json.loads(path.read_text())
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings")  # fmt: skip
    return {k: cfg[k] for k in keys if k in cfg}


def load_engine_model(spec: str, dtype=torch.float32):
    """(HF LlamaForCausalLM, label): 'random' (random weights, the default shape), 'default' or a directory."""
    if spec == "random":
        return et.random_llama(default_shape(), dtype=dtype), f"random weights, shape {default_shape()}"
    from mtpc.backbones import load_backbone

    bb = load_backbone(spec, dtype=dtype, engine="hf")
    return bb.model, bb.name  # the default's verified label (default@<sha8>): what its shipped heads record


def _eos(model) -> int:
    eos = model.config.eos_token_id
    return int(eos[0] if isinstance(eos, (list, tuple)) else (eos if eos is not None else 257))


LAYOUTS = (
    "rowdot",
    "onednn",
    "views",
    "packed",
)  # the compact engine's weight layouts; the first is the CPU default


def usable_layouts(model) -> tuple[str, ...]:
    """LAYOUTS less those that cannot run for this model's weights here (the row-dot kernel off x86 or
    without a compiler; oneDNN off the CPU)."""
    from mtpc.kernels import onednn_unsupported, rowdot_unsupported

    w = model.get_output_embeddings().weight
    why = {"rowdot": rowdot_unsupported(w.device, w.dtype), "onednn": onednn_unsupported(w.device, w.dtype)}
    return tuple(lay for lay in LAYOUTS if why.get(lay) is None)


def _shipped_head(label: str):
    """(name, head) of the shipped default head when `label` is the shipped default backbone, else None."""
    from mtpc.backbones.shipped import SHIPPED_DIR, verify_shipped
    from mtpc.heads import load_head
    from mtpc.shipped_heads import read_index, resolve_head, shipped_head_names

    if not shipped_head_names() or label not in ("default", verify_shipped(SHIPPED_DIR)):
        return None
    head, _ = load_head(resolve_head("default"))
    return read_index()["default"], head.float()


@contextlib.contextmanager
def _native_cycle(on: bool):
    """The cycle's native calls on (as configured) or off ($MTPC_NATIVE_CYCLE=0) inside the block."""
    old = os.environ.get("MTPC_NATIVE_CYCLE")
    if not on:
        os.environ["MTPC_NATIVE_CYCLE"] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("MTPC_NATIVE_CYCLE", None)
        else:
            os.environ["MTPC_NATIVE_CYCLE"] = old


def engine_section(args) -> dict:
    from mtpc.backbones import AdapterEngine, BackboneAdapter, LlamaEngine
    from mtpc.shipped_heads import decode_defaults

    model, label = load_engine_model(args.model)
    layouts = usable_layouts(model)
    eos, P, new, R = _eos(model), args.context, args.new_tokens, args.rounds
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    prompt = et.random_prompts(1, P, seed=args.seed)[0]
    cap = P + new + 64
    bb0 = BackboneAdapter.from_hf(model, lora_depth=0, name=label)
    bb1 = BackboneAdapter.from_hf(model, lora_depth=1, lora_rank=16, name=label)
    et.randomize_lora(bb1, scale=0.02)  # a non-zero LoRA: the draft top's matmuls all run
    hf0 = BackboneAdapter.from_hf(model, lora_depth=0, engine="hf")
    hf1 = BackboneAdapter.from_hf(model, lora_depth=1, lora_rank=16, engine="hf")
    hf1.load_lora_state_dict(bb1.lora_state_dict())
    default = LlamaEngine(bb0, cap).layout
    engines = {"hf_k0": AdapterEngine(hf0), "hf_k1": AdapterEngine(hf1)}
    for lay in layouts:  # compact_k0 / _k1 / _k1_merged: the default layout; other layouts suffixed
        sfx = "" if lay == default else f"_{lay}"
        engines[f"compact_k0{sfx}"] = LlamaEngine(bb0, cap, weights=lay)
        engines[f"compact_k1{sfx}"] = LlamaEngine(bb1, cap, weights=lay)
        engines[f"compact_k1_merged{sfx}"] = LlamaEngine(bb1, cap, lora="merged", weights=lay)
    if args.compile:  # torch.compile runs the views layout (oneDNN's blocked weights do not lower)
        engines["compact_k0_compiled"] = LlamaEngine(bb0, cap, compile=True)
        engines["compact_k1_compiled"] = LlamaEngine(bb1, cap, compile=True)
    for e in engines.values():
        et.prefilled(e, prompt, cap)
    one, g = torch.tensor([65]), torch.Generator().manual_seed(1)
    out: dict = {"model": label, "context": P, "new_tokens": new, "rounds": R, "clock": args.clock,
                 "weight_mb": et.weight_bytes(model) / 1e6, "default_layout": default}  # fmt: skip
    floors = et.weight_floors(model)  # one product per weight, per kernel; a plain read
    with torch.inference_mode():
        steps = et.timed(
            floors | {k: et.engine_call(e, one, P) for k, e in engines.items()}, args.reps, R, clock=clock
        )
        best = min((k for k in floors if not k.startswith("read")), key=lambda k: steps["ms"][k])
        steps["rounds_ms"]["floor"] = steps["rounds_ms"][best]  # the fastest product kernel: the floor
        out["step_ms"] = steps["ms"] | {"floor": steps["ms"][best]}
        out["floor_kernel"] = best
        ids_n = {n: torch.randint(0, 256, (n,), generator=g) for n in (2, 4, 8, 16)}
        ver = {}
        for lay in layouts:
            sfx = "" if lay == default else f"_{lay}"
            e = engines[f"compact_k0{sfx}"]
            ver[f"step{sfx}"] = et.engine_call(e, one, P)
            rows = (2, 4, 8, 16) if lay == default else (8, 16)  # short verifies: the draft length's cost
            ver |= {f"verify_{n}{sfx}": et.engine_call(e, ids_n[n], P) for n in rows}
        vres = et.timed(ver, args.reps, R, clock=clock)
        out["verify_ms"] = vres["ms"]
        out["short_verify_over_step"] = {n: et.ratio(vres, f"verify_{n}", "step") for n in (2, 4)}
        for lay in layouts:
            sfx = "" if lay == default else f"_{lay}"
            out[f"verify_over_step{sfx}"] = {
                n: et.ratio(vres, f"verify_{n}{sfx}", f"step{sfx}") for n in (8, 16)
            }
        for lay in layouts:
            if lay != default:
                out[f"{lay}_verify_over_{default}_verify"] = {
                    n: et.ratio(vres, f"verify_{n}_{lay}", f"verify_{n}") for n in (8, 16)
                }  # fmt: skip
        if args.compile:  # compiled step and verifies beside the default layout's eager ones
            comp = engines["compact_k0_compiled"]
            ver_c = {"step_compiled": et.engine_call(comp, one, P), "step": ver["step"]}
            ver_c |= {f"verify_{n}_compiled": et.engine_call(comp, ids_n[n], P) for n in (8, 16)}
            ver_c |= {f"verify_{n}": ver[f"verify_{n}"] for n in (8, 16)}
            cres = et.timed(ver_c, args.reps, R, clock=clock)
            out["verify_ms_compiled"] = cres["ms"]
            out["verify_over_step_compiled"] = {
                n: et.ratio(cres, f"verify_{n}_compiled", "step_compiled") for n in (8, 16)
            }
            out["compiled_verify_over_eager_verify"] = {
                n: et.ratio(cres, f"verify_{n}_compiled", f"verify_{n}") for n in (8, 16)
            }
        hidden = engines["compact_k0"].feed(one).draft_hidden[-1].clone()
        engines["compact_k0"].crop(P)
        hd = {}
        for n in (8, 16):
            for kind in CIRCUIT_KINDS:
                m = MtpcModel(bb0, et.make_head(bb0, kind, n, 8, 16))
                hd[f"{kind}_n{n}"] = et.head_draft(m, hidden, one)
        out["head_draft_ms_r8_appG16"] = et.timed(hd, args.reps, R, clock=clock)["ms"]
        # why the head costs more in the loop: its forward hot, right after a verify of 8 bytes (as in
        # the loop), and after sweeping a buffer larger than the last-level cache
        shipped = _shipped_head(label)
        probe = shipped[1] if shipped is not None else et.make_head(bb0, "btree", 8, 16, 16)
        out["head_forward_cache_ms"] = et.head_cache_probe(
            probe, hidden, engines["compact_k0"], ids_n[8], P, args.reps * 4, clock
        )

    # the cycle, our plain step and one HF generate step, interleaved per round
    head = et.make_head(bb0, "btree", 8, 8, 16)
    models = {"compact": MtpcModel(bb0, head)}
    models |= {f"compact_{lay}": MtpcModel(bb0, head, weights=lay) for lay in layouts if lay != default}
    models["hf"] = MtpcModel(hf0, head)
    if args.compile:
        models["compact_compiled"] = MtpcModel(bb0, head, compile=True)
    hf_fns = et.hf_generate_step(model, prompt, new, eos)
    rounds: dict[str, list[float]] = {"hf_generate_step": []}
    for name, m in models.items():  # warm-up (and compile)
        (
            m.generate(prompt, max_new_tokens=new, ban_eos=True),
            m.generate_plain(prompt, max_new_tokens=new, ban_eos=True),
        )
        rounds[f"cycle_{name}"], rounds[f"plain_step_{name}"] = [], []
    for fn in hf_fns.values():
        fn()

    def cost(fn) -> float:  # ms of `clock` spent in fn()
        t0 = clock()
        fn()
        return (clock() - t0) * 1e3

    with torch.inference_mode():
        for _ in range(R):  # each: (a generation of `new` bytes - one of 1 byte) / its cycles or steps
            t_long, t_one = cost(hf_fns["hf_generate_long"]), cost(hf_fns["hf_generate_1"])
            rounds["hf_generate_step"].append((t_long - t_one) / (new - 1))
            for name, m in models.items():
                gen: list = []
                t_long = cost(
                    lambda m=m, gen=gen: gen.append(m.generate(prompt, max_new_tokens=new, ban_eos=True))
                )
                t_one = cost(lambda m=m: m.generate(prompt, max_new_tokens=1, ban_eos=True))
                rounds[f"cycle_{name}"].append((t_long - t_one) / gen[0].stats.cycles)
                t_long = cost(lambda m=m: m.generate_plain(prompt, max_new_tokens=new, ban_eos=True))
                t_one = cost(lambda m=m: m.generate_plain(prompt, max_new_tokens=1, ban_eos=True))
                rounds[f"plain_step_{name}"].append((t_long - t_one) / (new - 1))
    med = {k: statistics.median(v) for k, v in rounds.items()}
    per_round = lambda a, b: statistics.median(x / y for x, y in zip(rounds[a], rounds[b], strict=True))  # noqa: E731
    out["cycle_btree_n8_r8_appG16_k0_ms"] = {k: v for k, v in med.items() if k.startswith("cycle")}
    out["plain_step_ms"] = {k: v for k, v in med.items() if k.startswith("plain_step")}
    out["hf_generate_step_ms"] = med["hf_generate_step"]
    out["rounds_ms"] = {"steps": steps["rounds_ms"], "cycles": rounds}

    # the loop's cycle and its parts beside the plain step, same rounds, same clock (default layout, k = 0):
    # a random btree n = 8, r = 16, App. G 16 head, and the shipped default head when this is its backbone
    # the random head twice: float32 weights, and rounded to bf16 numbers as a shipped head is stored
    # (the decoder then reads them from bf16 storage: half the bytes, the same arithmetic)
    rounded = et.make_head(bb0, "btree", 8, 16, 16)
    with torch.no_grad():
        for prm in rounded.parameters():
            prm.copy_(prm.to(torch.bfloat16).to(prm.dtype))
    cycle_heads = {
        "random_btree_n8_r16_appG16": MtpcModel(bb0, et.make_head(bb0, "btree", 8, 16, 16)),
        "random_btree_n8_r16_appG16_bf16_stored": MtpcModel(bb0, rounded),
    }
    if shipped is not None:  # with its full window and with its recorded draft length
        cycle_heads[f"shipped_{shipped[0]}"] = MtpcModel(bb0, shipped[1])
        m = decode_defaults("default").get("draft_len")
        if m is not None and m != shipped[1].config.window:
            cycle_heads[f"shipped_{shipped[0]}_draft{m}"] = MtpcModel(bb0, shipped[1], draft_len=m)
        # and with the cycle's native calls off ($MTPC_NATIVE_CYCLE=0: head, draft and accept as torch ops)
        cycle_heads[f"shipped_{shipped[0]}_torch_cycle"] = MtpcModel(bb0, shipped[1])
    parts_rounds: dict[str, list[dict[str, float]]] = {name: [] for name in cycle_heads}
    step_rounds: list[float] = []
    plain = models["compact"]
    with torch.inference_mode():
        for name, m in cycle_heads.items():  # warm-up
            with _native_cycle(not name.endswith("_torch_cycle")):
                et.cycle_parts(m, prompt, 8, clock)
        for _ in range(R):
            t_long = cost(lambda: plain.generate_plain(prompt, max_new_tokens=new, ban_eos=True))
            t_one = cost(lambda: plain.generate_plain(prompt, max_new_tokens=1, ban_eos=True))
            step_rounds.append((t_long - t_one) / (new - 1))
            for name, m in cycle_heads.items():
                with _native_cycle(not name.endswith("_torch_cycle")):
                    parts_rounds[name].append(et.cycle_parts(m, prompt, new, clock))
    step_med = statistics.median(step_rounds)
    out["cycle_parts"] = {"plain_step_ms": step_med, "rounds_plain_step_ms": step_rounds}
    for name, rows in parts_rounds.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        out["cycle_parts"][name] = {
            "ms": med,
            "over_plain_step": {k: statistics.median(r[k] / s for r, s in zip(rows, step_rounds, strict=True)) for k in med},
            "cycle_minus_verify_over_step": statistics.median(
                (r["cycle"] - r["verify"]) / s for r, s in zip(rows, step_rounds, strict=True)),
        }  # fmt: skip

    # ratios and bars (each variant against the floor / HF step timed in the same rounds)
    r = {"step_over_floor": et.ratio(steps, "compact_k0", "floor"),
         "step_over_read": et.ratio(steps, "compact_k0", "read"),
         "step_over_read_bf16": et.ratio(steps, "compact_k0", "read_bf16") if "read_bf16" in steps["ms"] else None,
         "k1_draft_top_adds": et.ratio(steps, "compact_k1", "compact_k0") - 1,
         "k1_merged_draft_top_adds": et.ratio(steps, "compact_k1_merged", "compact_k0") - 1,
         "step_over_adapter_step": et.ratio(steps, "compact_k0", "hf_k0"),
         "adapter_step_over_floor": et.ratio(steps, "hf_k0", "floor"),
         "adapter_k1_step_over_floor": et.ratio(steps, "hf_k1", "floor"),
         "plain_step_over_hf_generate_step": per_round("plain_step_compact", "hf_generate_step"),
         "cycle_over_hf_generate_step": per_round("cycle_compact", "hf_generate_step"),
         "cycle_over_plain_step": per_round("cycle_compact", "plain_step_compact"),
         "hf_engine_cycle_over_hf_generate_step": per_round("cycle_hf", "hf_generate_step")}  # fmt: skip
    r |= {f"floor_{k}_over_floor": et.ratio(steps, k, "floor") for k in floors}
    for lay in layouts:
        if lay == default:
            continue
        r[f"{lay}_step_over_floor"] = et.ratio(steps, f"compact_k0_{lay}", "floor")
        r[f"{lay}_k1_draft_top_adds"] = et.ratio(steps, f"compact_k1_{lay}", f"compact_k0_{lay}") - 1
        r[f"{lay}_step_over_{default}_step"] = et.ratio(steps, f"compact_k0_{lay}", "compact_k0")
        r[f"{lay}_cycle_over_hf_generate_step"] = per_round(f"cycle_compact_{lay}", "hf_generate_step")
        r[f"{lay}_cycle_over_{default}_cycle"] = per_round(f"cycle_compact_{lay}", "cycle_compact")
        r[f"{lay}_plain_step_over_hf_generate_step"] = per_round(
            f"plain_step_compact_{lay}", "hf_generate_step"
        )
    if args.compile:
        r["compiled_step_over_floor"] = et.ratio(steps, "compact_k0_compiled", "floor")
        r["compiled_k1_draft_top_adds"] = et.ratio(steps, "compact_k1_compiled", "compact_k0_compiled") - 1
        r["compiled_cycle_over_hf_generate_step"] = per_round("cycle_compact_compiled", "hf_generate_step")
        r["compiled_plain_step_over_hf_generate_step"] = per_round(
            "plain_step_compact_compiled", "hf_generate_step"
        )
    out["ratios"] = r
    out["bars"] = {k: {"bar": b, "value": r[k], "met": r[k] <= b} for k, b in BARS.items()}
    if args.compile:
        for k, b in BARS.items():
            out["bars"][f"compiled_{k}"] = {
                "bar": b,
                "value": r[f"compiled_{k}"],
                "met": r[f"compiled_{k}"] <= b,
            }

    # greedy outputs: HF generate == our plain == our speculative (keep and drop), every engine
    prompts = et.random_prompts(args.identity_prompts, 64, seed=args.seed + 1)
    out["identity"] = {
        name: et.greedy_identity(m, prompts, new, hf_model=model, eos=eos) for name, m in models.items()
    }
    return out


# -------------------------------------------------------------------------------------- bf16 section


def bf16_section(args) -> dict:
    """bf16 greedy speculative vs bf16 plain on the same engine (and the float32 control)."""
    from mtpc.backbones import BackboneAdapter

    out = {}
    prompts = et.random_prompts(args.bf16_prompts, 64, seed=args.seed + 2)
    for dtype, tag in ((torch.bfloat16, "bfloat16"), (torch.float32, "float32_control")):
        model, label = load_engine_model(args.model, dtype=dtype)
        # compact: its default layout (oneDNN's products on the CPU), compact_views: the HF weights
        for engine, weights in (("compact", None), ("compact_views", "views"), ("hf", None)):
            bb = BackboneAdapter.from_hf(model, name=label, engine=engine.split("_")[0])
            for window in (8, 16):
                m = MtpcModel(bb, et.stp_copy_head(bb, window), weights=weights)  # drafts what the model says
                res = et.bf16_divergence(m, prompts, args.new_tokens)
                if engine == "compact":
                    res["layout"] = m.engine(True, 8).layout
                out[f"{tag}_{engine}_n{window}"] = res
                print(
                    f"bf16 section: {tag} {engine} n={window}: {res['fraction_differ']:.2f} differ",
                    flush=True,
                )
    out["model"] = label
    out["head"] = "cp r = 2 initialised from the lm_head (noise 0.5), k = 0"
    return out


# ------------------------------------------------------------------------------------- heads section


def heads_section(args) -> dict:
    from mtpc.backbones import load_backbone

    backbone = load_backbone("default")
    prompt_sets = load_prompt_sets("heldout", args.num_prompts, args.sets, args.seed)
    out = {"backbone": "default", "windows": {},
           "settings": {k: getattr(args, k) for k in ("num_prompts", "sets", "max_new_tokens", "seed")}}  # fmt: skip
    for window in (int(w) for w in args.windows.split(",")):
        models, sources = build_models(backbone, Path(args.heads_dir), window, args.random_rank)
        # online: every prompt timed through the loop, and drop (online-only) beside keep, one evaluation each
        per_extra = {extra: evaluate_heads(models, prompt_sets, EvalConfig(
            modes=DECODE_MODES, max_new_tokens=args.max_new_tokens, seed=args.seed, eos=("banned",), extra_token=extra,
            acceptance="online"), ff_name="ff") for extra in EXTRA_TOKEN_OPTIONS}  # fmt: skip
        res = {"summary": [s for r in per_extra.values() for s in r["summary"]],
               "runs": [x for r in per_extra.values() for x in r["runs"]],
               "stp": {extra: r["stp"] for extra, r in per_extra.items()}}  # fmt: skip
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
                f"speedup_vs_stp={row['speedup_vs_stp']:.2f} speedup_vs_ff={row['speedup_vs_ff']:.2f} "
                f"degenerate={row['degenerate_fraction']:.2f} distinct4={row['distinct_4gram_ratio']:.2f} ({row['source'][:7]})",
                flush=True,
            )
        out["windows"][str(window)] = {"rows": rows, "stp": res["stp"], "runs": res["runs"]}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/decode_cpu.json")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    ap.add_argument(
        "--model",
        default="auto",
        help="engine/bf16 sections: random | default | <dir> (auto: default if trained)",
    )
    ap.add_argument("--context", type=int, default=256, help="engine section: cached bytes before each step")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--identity-prompts", type=int, default=4)
    ap.add_argument("--bf16-prompts", type=int, default=20)
    ap.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="engine section: this thread's CPU time (robust to other jobs on the core) or wall time",
    )
    ap.add_argument(
        "--compile", action="store_true", help="engine section: also the compact engine under torch.compile"
    )
    ap.add_argument("--windows", default="8,16")
    ap.add_argument("--heads-dir", default=str(cache_dir() / "heads"))
    ap.add_argument("--random-rank", type=int, default=8)
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--sets", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (1: steadier on a shared CPU)"
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    sections = [s for s in args.sections.split(",") if s]
    bad = sorted(set(sections) - set(SECTIONS))
    if bad:
        ap.error(f"--sections: unknown {bad}; expected a subset of {SECTIONS}")
    if args.model == "auto":  # the shipped default model when it loads, else random weights of its shape
        from mtpc.backbones import load_backbone

        try:
            load_backbone("default")
            args.model = "default"
        except ValueError as e:
            print(f"--model auto: random weights ({e})", flush=True)
            args.model = "random"
    out = Path(args.out)
    report = json.loads(out.read_text()) if out.is_file() else {}
    if "windows" in report:  # the earlier layout held only the heads table
        report = {"heads": report}
    meta = {
        "hardware": hardware(),
        "command": "python bench/bench_decode.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "threads": args.threads,
        "note": "shared 2-core CPU; ratios are measured side by side in this process, absolute times mean little",
    }
    run = {"engine": engine_section, "bf16": bf16_section, "heads": heads_section}
    for name in sections:
        t0 = time.time()
        report[name] = {**meta, **run[name](args), "wall_s": time.time() - t0}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        if name == "engine":
            for k, b in report[name]["bars"].items():
                print(
                    f"bar {k}: {b['value']:.3f} (<= {b['bar']}: {'met' if b['met'] else 'MISSED'})",
                    flush=True,
                )
        print(f"{name}: wrote {out} ({time.time() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    from experiments.plumbing.timing_lock import timing

    with timing(progress=True):  # one timer on the machine; the background pre-training paused
        rc = main()
    raise SystemExit(rc)
