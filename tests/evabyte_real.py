"""Tiny EvaByte checkpoints written from EvaByte's own code, and the test-only triton workaround.

`write_tiny_evabyte(dir)` writes what a user's EvaByte directory holds: config.json with `auto_map`,
EvaByte's unchanged code files copied from `$MTPC_THIRD_PARTY/evabyte_hf/` (never into this
repository), random weights. `load_tiny_evabyte(dir)` loads it as a user's run would
(`AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`) through `load_backbone`.

TEST-ONLY WORKAROUND — `triton_shim()`: EvaByte's `modeling_evabyte.py` imports `triton` (through
`multibyte_decoding_evabyte` -> `eva_prep_kv_kernel`) and without it cannot be imported at all; with
it, it runs its EVA attention in two triton kernels that need CUDA. The shim puts a `triton`
stand-in module into `sys.modules` while the code is imported (enough for its decorators and
`tl.constexpr` annotations to evaluate) and replaces the two kernels' launchers,
`triton_eva_prep_kv_fwd` and `triton_eva_agg_fwd`, wherever EvaByte's modules bound them, by
`eva_prep_kv_port` / `eva_agg_port` below: pure-PyTorch ports of the kernels `_fwd_eva_prep_kv_kernel`
and `_fwd_eva_agg_kernel` (same masks, same all-masked-row rule). Everything else (EvaAttention's
triton path, EvaStaticCacheForTriton, the multi-byte routines) is EvaByte's own code. The ports are
checked against EvaByte's pure-PyTorch reference `eva_pt_ref.py` (prefill and 1-byte steps) and, for
multi-byte steps, against full uncached forwards (tests/mtpc/test_evabyte_real.py).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import types
from pathlib import Path

import torch

CODE_FILES = (
    "configuration_evabyte.py",
    "modeling_evabyte.py",
    "eva.py",
    "eva_cache.py",
    "eva_agg_kernel.py",
    "eva_prep_kv_kernel.py",
    "eva_pt_ref.py",
    "multibyte_decoding_evabyte.py",
    "tokenization_evabyte.py",
)
AUTO_MAP = {
    "AutoConfig": "configuration_evabyte.EvaByteConfig",
    "AutoModelForCausalLM": "modeling_evabyte.EvaByteForCausalLM",
}
TINY = dict(
    vocab_size=320,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=2,
    max_position_embeddings=256,
    window_size=16,
    chunk_size=4,
    num_pred_heads=8,
    bos_token_id=1,
    eos_token_id=2,
    mixedp_attn=False,
    fp32_skip_add=False,
    fp32_logits=False,
    fp32_ln=False,
    norm_add_unit_offset=False,
    rope_theta=10000.0,
    rope_scaling=None,
    return_dict=True,
)


def oracle() -> Path:
    """EvaByte's own code folder (`$MTPC_THIRD_PARTY/evabyte_hf`); skips when the variable is unset."""
    from tests.third_party import third_party

    return third_party("evabyte_hf", required=CODE_FILES)


# -- the pure-PyTorch ports of the two triton kernels ----------------------------------------------
def eva_prep_kv_port(k, v, param_mu, param_phi, mask, softmax_scale, chunksize):
    """`_fwd_eva_prep_kv_kernel`: per chunk of `chunksize` keys, the mu-weighted key summary and the
    phi-feature-weighted value summary (masked keys excluded; an all-masked chunk gives zeros)."""
    b, h, n, d = k.shape
    assert n % chunksize == 0, "seqlen must be divisible by chunksize"
    scale = softmax_scale or d**-0.5
    kc, vc = k.view(b, h, n // chunksize, chunksize, d), v.view(b, h, n // chunksize, chunksize, d)
    logit_k = (kc * param_mu.to(k.dtype)).sum(-1).float()  # (b, h, c, m)
    logit_v = ((kc * param_phi.to(k.dtype)).sum(-1).float() - 0.5 * (kc * kc).sum(-1).float()) * scale
    if mask is not None:
        m = mask.view(b, 1, n // chunksize, chunksize)
        logit_k, logit_v = logit_k.masked_fill(m, float("-inf")), logit_v.masked_fill(m, float("-inf"))

    def weights(logit):
        top = logit.amax(-1, keepdim=True)
        p = torch.exp(logit - torch.where(torch.isinf(top), torch.zeros_like(top), top))
        den = p.sum(-1, keepdim=True)
        return p / torch.where(den == 0, torch.ones_like(den), den)

    rfa_k = (kc * weights(logit_k)[..., None].to(k.dtype)).sum(-2)
    rfa_v = (vc * weights(logit_v)[..., None].to(v.dtype)).sum(-2)
    return rfa_k, rfa_v


def eva_agg_port(
    q, k, v, rfa_k, rfa_v, window_mask, chunk_mask, softmax_scale, window_size, chunks_per_window
):
    """`_fwd_eva_agg_kernel`: query i attends the keys of its own window (positions from
    `window_size * (i // window_size)`; causal, or `window_mask` True = masked, indexed within the
    window) and the chunk summaries of the windows before its own (`chunk_mask` True = masked)."""
    b, h, sq, d = q.shape
    sk = k.shape[-2]
    scale = softmax_scale or d**-0.5
    qi = torch.arange(sq, device=q.device)[:, None]
    kj = torch.arange(sk, device=q.device)[None, :]
    start = (qi // window_size) * window_size
    in_window = (kj >= start) & (kj < start + window_size)
    s = (q @ k.transpose(-1, -2)).float() * scale  # (b, h, sq, sk)
    if window_mask is None:
        allowed = (in_window & (kj <= qi))[None, None]
    else:
        rel = (kj - start).clamp(0, window_size - 1).expand(sq, sk)
        masked = torch.gather(
            window_mask.expand(b, 1, sq, window_size), -1, rel[None, None].expand(b, 1, sq, sk)
        )
        allowed = in_window[None, None] & ~masked
    s = s.masked_fill(~allowed, float("-inf"))
    if rfa_k is not None:
        nc = rfa_k.shape[-2]
        c = torch.arange(nc, device=q.device)[None, :]
        ok = (c < (qi // window_size) * chunks_per_window)[None, None]
        if window_mask is not None:
            ok = ok & ~chunk_mask
        sc = (q @ rfa_k.transpose(-1, -2)).float() * scale
        s = torch.cat([s, sc.masked_fill(~ok, float("-inf"))], -1)
        v = torch.cat([v, rfa_v], -2)
    top = s.amax(-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isinf(top), torch.zeros_like(top), top))
    den = p.sum(-1, keepdim=True)
    p = p / torch.where(den == 0, torch.ones_like(den), den)
    out = p.to(v.dtype) @ v
    lse = (top + den.log()).squeeze(-1)
    return out, lse


def _agg_func_port(q, k, v, rfa_k, rfa_v, window_mask, chunk_mask, softmax_scale=None, window_size=None,
                   chunks_per_window=None):  # fmt: skip
    return eva_agg_port(
        q, k, v, rfa_k, rfa_v, window_mask, chunk_mask, softmax_scale, window_size, chunks_per_window
    )[0]


def _prep_kv_func_port(k, v, param_mu, param_phi, mask, softmax_scale=None, chunksize=None):
    return eva_prep_kv_port(k, v, param_mu, param_phi, mask, softmax_scale, chunksize)


# the launchers (forward only) and their autograd wrappers (whose backward kernels are triton too;
# the ports differentiate through PyTorch instead, so LoRA training runs on the CPU)
PORTS = {
    "triton_eva_prep_kv_fwd": eva_prep_kv_port,
    "triton_eva_agg_fwd": eva_agg_port,
    "eva_agg_func_triton": _agg_func_port,
    "eva_prep_kv_func_triton": _prep_kv_func_port,
}


def _stand_in_triton() -> types.ModuleType:
    """Just enough `triton` for EvaByte's kernel files to import (decorators and annotations)."""

    def identity_decorator(*args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return lambda fn: fn

    triton = types.ModuleType("triton")
    triton.__mtpc_stand_in__ = True
    triton.jit = identity_decorator
    triton.heuristics = identity_decorator
    triton.autotune = identity_decorator
    triton.Config = lambda *a, **k: None
    triton.cdiv = lambda a, b: -(-a // b)
    triton.next_power_of_2 = lambda n: 1 << (int(n) - 1).bit_length()
    language = types.ModuleType("triton.language")
    language.constexpr = type("constexpr", (), {})
    triton.language = language
    return triton


def patch_kernels() -> int:
    """Replace the kernels' launchers in every loaded EvaByte module; returns how many were replaced."""
    n = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("transformers_modules.") or module is None:
            continue
        for attr, port in PORTS.items():
            if getattr(module, attr, None) not in (None, port):
                setattr(module, attr, port)
                n += 1
    return n


@contextlib.contextmanager
def triton_shim():
    """TEST-ONLY: import EvaByte's code with the `triton` stand-in, swapping in the kernel ports as
    soon as each remote-code class is loaded (so a load and its use can share one `with`)."""
    import torch._dynamo  # noqa: F401  (imported first: it probes `triton` and must not see the stand-in)
    from transformers import dynamic_module_utils as dmu

    saved = {m: sys.modules.pop(m) for m in ("triton", "triton.language") if m in sys.modules}
    stand_in = _stand_in_triton()
    sys.modules["triton"], sys.modules["triton.language"] = stand_in, stand_in.language
    original = dmu.get_class_in_module

    def get_class_in_module(*args, **kwargs):
        cls = original(*args, **kwargs)
        patch_kernels()
        return cls

    dmu.get_class_in_module = get_class_in_module
    try:
        yield
    finally:
        dmu.get_class_in_module = original
        for m in ("triton", "triton.language"):
            sys.modules.pop(m, None)
        sys.modules.update(saved)
        patch_kernels()


# -- checkpoints -----------------------------------------------------------------------------------
def write_tiny_evabyte(
    out: Path, seed: int = 0, tokenizer: bool = True, shim: bool = True, src: Path | None = None, **overrides
) -> Path:
    """A random-weight EvaByte checkpoint from the real code (config.json with auto_map, code files,
    EvaByte's own tokenizer class and chat template through tokenizer_config.json's auto_map).
    shim=False: import EvaByte's code with the real triton (a CUDA machine; bench/bench_evabyte_gpu.py)."""
    src = oracle() if src is None else Path(src)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in CODE_FILES:
        shutil.copy(src / f, out / f)
    cfg = {
        **TINY,
        **overrides,
        "model_type": "evabyte",
        "architectures": ["EvaByteForCausalLM"],
        "auto_map": AUTO_MAP,
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    tok = {
        "auto_map": {"AutoTokenizer": ["tokenization_evabyte.EvaByteTokenizer", None]},
        "tokenizer_class": "EvaByteTokenizer",
    }
    if tokenizer:
        (out / "tokenizer_config.json").write_text(json.dumps(tok, indent=1))
    from transformers import AutoConfig, AutoModelForCausalLM

    from mtpc.backbones.evabyte import prepare_config

    with triton_shim() if shim else contextlib.nullcontext():
        config = prepare_config(AutoConfig.from_pretrained(out, trust_remote_code=True))
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=True)
    state = {n: t.detach().clone() for n, t in model.state_dict().items()}
    g = torch.Generator().manual_seed(seed + 1)
    for n, t in state.items():  # norms off one, so a wrong norm would show
        if n.endswith("layernorm.weight") or n.endswith("norm.weight"):
            t.add_(0.2 * torch.randn(t.shape, generator=g))
    from safetensors.torch import save_file

    save_file(
        {n: t.contiguous() for n, t in state.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    return out


def load_tiny_evabyte(path: Path, lora_depth: int = 0, shim: bool = True, **kw):
    """The adapter on a tiny checkpoint, loaded as a user's run would (`trust_remote_code=True`)."""
    from mtpc.backbones import load_backbone

    with triton_shim() if shim else contextlib.nullcontext():
        return load_backbone(str(path), lora_depth=lora_depth, trust_remote_code=True, **kw)


def real_logits(model, ids: torch.Tensor, all_heads: bool = False) -> torch.Tensor:
    """EvaByte's own uncached forward (its `forward` in eval mode; return_dict either way)."""
    out = model(ids, use_cache=False, return_all_pred_logits=all_heads)
    return out[0] if isinstance(out, tuple) else out.logits


def real_greedy(model, prompt: torch.Tensor, n: int) -> list[int]:
    """EvaByte's own greedy decoding: its `generate` where transformers gives it one (4.x), else
    the same calls `generate` makes (prefill, then 1-byte steps on its own cache) — transformers 5
    drops `generate` from models that do not inherit GenerationMixin, as EvaByte's does not."""
    x = prompt[None]
    if hasattr(model, "generate"):
        return model.generate(x, max_new_tokens=n, do_sample=False)[0, len(prompt) :].tolist()
    pos = torch.arange(len(prompt) + n, device=prompt.device)[None]
    out, cache, got = None, None, []
    with torch.no_grad():
        out = model(x, position_ids=pos[:, : x.shape[1]], use_cache=True)
        for t in range(n):
            nxt = int((out[0] if isinstance(out, tuple) else out.logits)[0, -1].argmax())
            got.append(nxt)
            cache = out[1] if isinstance(out, tuple) else out.past_key_values
            p = len(prompt) + t
            out = model(
                torch.tensor([[nxt]], device=prompt.device),
                position_ids=pos[:, p : p + 1],
                past_key_values=cache,
                use_cache=True,
            )
    return got
