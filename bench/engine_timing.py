"""Timing pieces shared by bench_decode.py (CPU) and bench_gpu.py (CUDA): models, floors, steps, cycles.

Every time is the median over `rounds` of the mean over `reps` calls, the variants of one
measurement interleaved round by round so that drifting load on a shared machine hits all of
them alike; ratios are taken per round, then the median. CUDA is synchronised around each timed
block. Holds: random-weight Llamas of a named shape (`random_llama`), the weight-read floor of a
decoding step (`weight_floor`), the Hugging Face `generate` step (`hf_generate_step`), engine
step / verify (`engine_call`), head + draft (`head_draft`), the speculative cycle (`cycle`),
greedy identity against plain decoding and HF generate (`greedy_identity`), the bf16 divergence
measurement (`bf16_divergence`) and a device copy bandwidth (`copy_bandwidth`).
Leaves out: the command lines and JSON layout (the two bench scripts).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F

from mtpc.backbones.engine import cuda_sync

# the embedded default model's shape (docs/backbones.md) and Llama-3.2-3B's with a byte vocabulary
DEFAULT_SHAPE = dict(
    vocab_size=320, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=2, max_position_embeddings=4096,
)  # fmt: skip
LLAMA32_3B_SHAPE = dict(
    vocab_size=320, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
)  # fmt: skip
TINY_SHAPE = dict(
    vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=2048,
)  # fmt: skip


def random_llama(shape: dict, dtype=torch.float32, device="cpu", seed: int = 0, eos: int = 257):
    """A LlamaForCausalLM of `shape` with transformers' random initialisation, built on `device`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**shape, bos_token_id=256, eos_token_id=eos, pad_token_id=None)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def _sync(device) -> None:
    sync = cuda_sync(torch.device(device))
    if sync is not None:
        sync()


def timed(
    fns: dict[str, Callable[[], Any]],
    reps: int,
    rounds: int,
    device="cpu",
    warmup: int = 2,
    clock=time.perf_counter,
) -> dict:
    """{name: median ms per call} and {name: list of per-round ms}; variants interleaved per round.

    clock: time.perf_counter (wall) or time.thread_time (this thread's CPU time: on a shared CPU it
    leaves out the time other processes held the core; CPU only)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    per: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            _sync(device)
            t0 = clock()
            for _ in range(reps):
                fn()
            _sync(device)
            per[name].append((clock() - t0) / reps * 1e3)
    return {"ms": {k: statistics.median(v) for k, v in per.items()}, "rounds_ms": per}


def ratio(res: dict, num: str, den: str) -> float:
    """Median over rounds of num / den (both timed in the same round)."""
    r = res["rounds_ms"]
    return statistics.median(a / b for a, b in zip(r[num], r[den], strict=True))


def step_weights(model) -> list[torch.Tensor]:
    """Every matrix a decoding step reads once: q k v o gate up down of each layer and the lm_head."""
    out = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        out += [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight]
        out += [m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight]
    return out + [model.get_output_embeddings().weight]


def weight_floor(model) -> Callable[[], None]:
    """One matrix-vector product per step weight: the time to read every weight once (the step's floor)."""
    ws = step_weights(model)
    xs = {w.shape[1]: torch.randn(1, w.shape[1], dtype=w.dtype, device=w.device) for w in ws}

    def run():
        for w in ws:
            F.linear(xs[w.shape[1]], w)

    return run


def _layer_weights(model) -> list[dict[str, torch.Tensor]]:
    """Per decoder layer, its HF weights by name (q k v o gate up down)."""
    from mtpc.backbones.llama import _ATTN, _GROUPS

    return [
        {
            n: getattr(layer.self_attn if n in _ATTN else layer.mlp, n).weight.detach()
            for g in _GROUPS.values()
            for n in g
        }
        for layer in model.model.layers
    ]


def weight_floors(model) -> dict[str, Callable[[], None]]:
    """Floors of a step, each reading every step weight once: "mkl_mv" (`weight_floor`: one
        F.linear of one row per HF weight), "onednn_mv" (one oneDNN product of one row per fused
        group, q|k|v o gate|up down and the lm_head, as the "onednn" engine layout holds them; where
        oneDNN runs), "rowdot_mv" (the same groups through the row-dot kernel, as the "rowdot" layout
        holds them; where it runs), "read" (a sum over each weight: a plain read, no product) and, when
    every weight is a bf16 number, "read_bf16" (the same over their bf16 copies, as the row-dot layout
    stores them)."""
    from mtpc.backbones.llama import _GROUPS, _onednn_pack, _rowdot_pack
    from mtpc.kernels import onednn_linear, onednn_unsupported, rowdot_linear, rowdot_unsupported

    ws = step_weights(model)
    out = {"mkl_mv": weight_floor(model)}
    kernels = {  # name -> (why it cannot run here, the layout's group copy, its product)
        "onednn_mv": (onednn_unsupported, _onednn_pack, onednn_linear),
        "rowdot_mv": (rowdot_unsupported, _rowdot_pack, rowdot_linear),
    }
    for name, (unsupported, pack, linear) in kernels.items():
        if unsupported(ws[0].device, ws[0].dtype) is not None:
            continue
        mats = [pack([w[n] for n in ms]) for w in _layer_weights(model) for ms in _GROUPS.values()]
        mats.append(pack([model.get_output_embeddings().weight.detach()]))
        xs = [torch.randn(1, m.shape[1], dtype=ws[0].dtype) for m in mats]

        def product(xs=xs, mats=mats, linear=linear):
            for x, m in zip(xs, mats, strict=True):
                linear(x, m)

        out[name] = product

    def read():
        for w in ws:
            w.sum()

    out["read"] = read
    narrow = [w.to(torch.bfloat16) for w in ws]
    if all(torch.equal(n.to(w.dtype), w) for n, w in zip(narrow, ws, strict=True)):
        # every weight a bf16 number (a bf16 checkpoint): the row-dot layout reads them from bf16
        # storage, so its step also compares with a plain read of that copy (half the bytes)

        def read_bf16():
            for w in narrow:
                w.sum()

        out["read_bf16"] = read_bf16
    return out


def weight_bytes(model) -> int:
    return sum(w.numel() * w.element_size() for w in step_weights(model))


def kv_bytes(model, context: int) -> int:
    """Keys + values a step at `context` positions reads (all layers, one sequence)."""
    c = model.config
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return (
        2 * c.num_hidden_layers * c.num_key_value_heads * hd * context * model.lm_head.weight.element_size()
    )


def engine_call(engine, ids: torch.Tensor, context: int) -> Callable[[], None]:
    """One feed of `ids` at `context` cached positions, then a crop back (a step or a verify pass)."""

    def run():
        engine.feed(ids)
        engine.crop(context)

    return run


def prefilled(engine, prompt: torch.Tensor, capacity: int):
    with torch.inference_mode():
        engine.reset(capacity)
        engine.feed(prompt)
    return engine


def hf_generate_step(model, prompt: torch.Tensor, new: int, eos: int) -> dict[str, Callable[[], Any]]:
    """HF `generate` (greedy, EOS suppressed) for `new` bytes and for 1: their difference / (new - 1) is a step."""
    kw = dict(do_sample=False, suppress_tokens=[eos], pad_token_id=eos, eos_token_id=None)
    ids = prompt.unsqueeze(0)

    def gen(n):
        return lambda: model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)

    return {"hf_generate_long": gen(new), "hf_generate_1": gen(1)}


def hf_generate_ids(model, prompt: torch.Tensor, new: int, eos: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            prompt.unsqueeze(0), max_new_tokens=new, min_new_tokens=new, do_sample=False, suppress_tokens=[eos],
            pad_token_id=eos, eos_token_id=None,
        )  # fmt: skip
    return out[0, prompt.shape[0] :].tolist()


def make_head(backbone, kind: str, window: int, rank: int, leaf_delta_rank: int, seed: int = 0):
    """A random MtpcHead of the backbone's dtype and device (App. G leaves when leaf_delta_rank > 0)."""
    from mtpc.heads import HeadConfig, random_head
    from mtpc.names import point_rank

    cfg = HeadConfig(kind, window, point_rank(kind, rank), backbone.vocab_size, backbone.hidden_size,
                     lora_depth=backbone.lora_depth, leaf_delta_rank=leaf_delta_rank)  # fmt: skip
    return random_head(cfg, seed, device=backbone.device, dtype=backbone.dtype)


def head_draft(model, hidden: torch.Tensor, prefix: torch.Tensor, greedy: bool = True) -> Callable[[], Any]:
    """head forward + normalise + fused draft of one window, as the decoding loop calls them."""
    gen = torch.Generator(device=hidden.device).manual_seed(0)

    def run():
        with torch.inference_mode():
            return model.circuit._draft(model._head_fn(hidden, prefix), prefix, generator=gen, greedy=greedy)

    return run


def head_bytes(head) -> int:
    return sum(p.numel() * p.element_size() for p in head.parameters())


def cycle_ms(model, prompt: torch.Tensor, new: int, **gen_kw) -> tuple[float, Any]:
    """Mean cycle latency (head + draft + verify + accept + crop) of one greedy generation, and its output."""
    out = model.generate(prompt, max_new_tokens=new, ban_eos=True, **gen_kw)
    return out.stats.mu_lat * 1e3, out


def head_cache_probe(
    head: Any,
    hidden: torch.Tensor,
    engine: Any,
    verify_ids: torch.Tensor,
    context: int,
    reps: int,
    clock: Callable[[], float] = time.thread_time,
    flush_mib: int = 80,
) -> dict[str, float]:
    """ms of one head forward (`HeadDecoder.params`) and one greedy draft on `clock`: hot (right after
    the same call), right after a verify of `verify_ids` on `engine` (as in the loop), and after
    sweeping `flush_mib` MiB (beyond the last-level cache). Only the head's call is timed."""
    dec = head.decoder()
    c = torch.tensor([65])
    theta = dec.params(hidden, c)
    sweep = torch.empty(flush_mib * 2**20 // 4)
    verify = engine_call(engine, verify_ids, context)
    calls = {"head": lambda: dec.params(hidden, c),
             "draft": lambda: head.circuit._draft(theta, c, greedy=True, conditionals=False)}  # fmt: skip
    before = {"hot": lambda: None, "after_verify": verify, "after_sweep": lambda: sweep.add_(1.0)}
    out = {}
    for name, fn in calls.items():
        for when, pre in before.items():
            total = 0.0
            for _ in range(reps):
                pre()
                t0 = clock()
                fn()
                total += clock() - t0
            out[f"{name}_{when}"] = total / reps * 1e3
    return out


def plain_byte_ms(model, prompt: torch.Tensor, new: int) -> float:
    """Plain decoding's mean time per byte (`generate_plain`'s per-step latency, prefill excluded):
    what a user compares a cycle with, beside the bare step (which leaves out pick, host read and Python)."""
    out = model.generate_plain(prompt, max_new_tokens=new, ban_eos=True)
    return out.stats.mu_lat * 1e3


CYCLE_PARTS = ("verify", "head", "draft", "accept", "python")


@contextlib.contextmanager
def part_clocks(clock: Callable[[], float] = time.thread_time):
    """Inside the block every decoding loop's parts are timed on `clock` into the yielded dict (seconds):
    verify (engine.feed + crop), head (HeadDecoder.params), draft (CircuitDrafter), accept (the loop's
    verify / target / testable functions). What a generation takes beyond them is its Python."""
    from unittest import mock

    from mtpc.heads import HeadDecoder
    from mtpc.speculative import loop
    from mtpc.speculative.model import MtpcModel

    acc = dict.fromkeys(CYCLE_PARTS[:-1], 0.0)

    def timed_fn(fn: Callable, part: str) -> Callable:
        def run(*a: Any, **k: Any) -> Any:
            t0 = clock()
            try:
                return fn(*a, **k)
            finally:
                acc[part] += clock() - t0

        return run

    make_engine = MtpcModel.engine

    def engine(self: Any, *a: Any, **k: Any) -> Any:
        eng = make_engine(self, *a, **k)
        eng.feed, eng.crop = timed_fn(eng.feed, "verify"), timed_fn(eng.crop, "verify")
        return eng

    accept = [
        n
        for n in (
            "greedy_accept",
            "greedy_accept_native",
            "sample_accept",
            "sample_verify",
            "greedy_target",
            "target_probs",
            "testable_drafts",
        )
        if hasattr(loop, n)
    ]
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(MtpcModel, "engine", engine))
        stack.enter_context(mock.patch.object(HeadDecoder, "params", timed_fn(HeadDecoder.params, "head")))
        stack.enter_context(
            mock.patch.object(
                loop.CircuitDrafter, "__call__", timed_fn(loop.CircuitDrafter.__call__, "draft")
            )
        )
        for name in accept:
            stack.enter_context(mock.patch.object(loop, name, timed_fn(getattr(loop, name), "accept")))
        yield acc


def cycle_parts(
    model: Any, prompt: torch.Tensor, new: int, clock: Callable[[], float] = time.thread_time, **gen_kw: Any
) -> dict[str, float]:
    """ms per cycle of each part of the loop (CYCLE_PARTS) and of the whole cycle, on `clock`: a
    generation of `new` bytes minus one of 1 byte (the prefill and set-up cancel), divided by its
    cycles. The parts' timers cost a little time themselves (in `python`)."""

    def run(n: int) -> tuple[dict[str, float], float, Any]:
        with part_clocks(clock) as acc:
            t0 = clock()
            out = model.generate(prompt, max_new_tokens=n, ban_eos=True, **gen_kw)
            total = clock() - t0
        return dict(acc), total, out

    long_parts, long_total, out = run(new)
    one_parts, one_total, one = run(1)
    cycles = out.stats.cycles - one.stats.cycles
    res = {k: (long_parts[k] - one_parts[k]) * 1e3 / cycles for k in long_parts}
    res["cycle"] = (long_total - one_total) * 1e3 / cycles
    res["python"] = res["cycle"] - sum(res[k] for k in CYCLE_PARTS[:-1])
    return res


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing byte (None: identical)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def greedy_identity(
    model, prompts: list[torch.Tensor], new: int, hf_model=None, eos: int | None = None
) -> dict:
    """generate vs generate_plain (keep and drop) and, with hf_model, vs HF generate: counts of identical outputs."""
    res = {
        "prompts": len(prompts),
        "spec_eq_plain": 0,
        "drop_eq_plain": 0,
        "plain_eq_hf": None,
        "first_diffs": [],
    }
    if hf_model is not None:
        res["plain_eq_hf"] = 0
    for p in prompts:
        plain = model.generate_plain(p, max_new_tokens=new, ban_eos=True).ids.tolist()
        keep = model.generate(p, max_new_tokens=new, ban_eos=True).ids.tolist()
        drop = model.generate(p, max_new_tokens=new, ban_eos=True, extra_token="drop").ids.tolist()
        res["spec_eq_plain"] += keep == plain
        res["drop_eq_plain"] += drop == plain
        res["first_diffs"].append(first_difference(keep, plain))
        if hf_model is not None:
            res["plain_eq_hf"] += hf_generate_ids(hf_model, p, new, eos) == plain
    return res


def bf16_divergence(model, prompts: list[torch.Tensor], new: int) -> dict:
    """Fraction of prompts whose greedy speculative output differs from the same engine's plain greedy
    output, and the mean position of the first difference (over the prompts that differ)."""
    diffs, mu_acc = [], []
    for p in prompts:
        plain = model.generate_plain(p, max_new_tokens=new, ban_eos=True).ids.tolist()
        spec = model.generate(p, max_new_tokens=new, ban_eos=True)
        diffs.append(first_difference(spec.ids.tolist(), plain))
        mu_acc.append(spec.stats.mu_acc)
    differ = [d for d in diffs if d is not None]
    return {
        "prompts": len(prompts),
        "new_bytes": new,
        "fraction_differ": len(differ) / len(prompts),
        "mean_first_difference": statistics.mean(differ) if differ else None,
        "first_differences": diffs,
        "mean_mu_acc": statistics.mean(mu_acc),
    }


def stp_copy_head(backbone, window: int, rank: int = 2, noise: float = 0.5, seed: int = 0):
    """A cp head whose leaves start from the backbone's own lm_head (it drafts what the model would say:
    high acceptance, like a trained head), for greedy-identity and bf16 measurements."""
    from mtpc.heads import HeadConfig, MtpcHead

    cfg = HeadConfig(
        "cp", window, rank, backbone.vocab_size, backbone.hidden_size, lora_depth=backbone.lora_depth
    )
    head = MtpcHead(cfg, device=backbone.device, dtype=backbone.dtype)
    torch.manual_seed(seed)
    head.init_from_unembeddings(backbone.lm_head_weight.detach(), noise=noise)
    return head.eval()


def random_prompts(
    count: int, length: int, vocab: int = 256, seed: int = 0, device="cpu"
) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(32, min(vocab, 127), (length,), generator=g).to(device) for _ in range(count)]


def copy_bandwidth(device, gib: float = 4.0, reps: int = 10) -> float:
    """Bytes read + written per second by a device-to-device copy of a `gib` GiB buffer."""
    n = int(gib * 2**30) // 4
    a = torch.empty(n, dtype=torch.float32, device=device).uniform_()
    b = torch.empty_like(a)
    for _ in range(2):
        b.copy_(a)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        b.copy_(a)
    _sync(device)
    dt = (time.perf_counter() - t0) / reps
    del a, b
    return 2 * n * 4 / dt


def randomize_lora(backbone, seed: int = 1, scale: float = 0.02) -> None:
    """Non-zero LoRA A and B (peft starts B at 0, i.e. a draft top equal to the verifier)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in backbone.lora_parameters():
            p.copy_((torch.randn(p.shape, generator=g) * scale).to(p.dtype))
