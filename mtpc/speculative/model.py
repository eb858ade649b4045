"""`MtpcModel`: a backbone plus an MtPC head behind a `generate` call; `GenerationOutput` and its stats.

Holds the public API of issue 7:

    m = MtpcModel.from_pretrained(head_dir, backbone=None)
    m = MtpcModel.from_components(backbone, head)
    out = m.generate(prompt, max_new_tokens=256, mode="greedy" | "sample", temperature=1.0, top_p=1.0,
                     seed=None, extra_token="keep" | "drop", ban_eos=False)
    out = m.generate_plain(prompt, ...)    # the single-token baseline, same output type

Prompts: a 1-D LongTensor of ids is used as is; `bytes` are encoded raw by the backbone's
tokenizer (no special ids); a `str` is rendered as a one-turn chat ending in the assistant marker
(`tokenizer.render_prompt`), so the model answers it. str/bytes need a tokenizer.

Engines: each model keeps one engine for speculative decoding and one (verifier only) for the
plain baseline (`mtpc.backbones.make_engine`: the compact Llama forward with preallocated caches
when the backbone's `engine` is "compact", else the HF layers), reset per generation to the
prompt + max_new_tokens + window positions it needs. On CUDA with the compact engine,
`cuda_graphs` (default on) captures the 1-byte step, the n-byte verify and head + draft
(`GraphedDraft`) as CUDA graphs on first use — unverified here (no GPU).

Leaves out: the cycle itself (loop.py) and the acceptance maths (acceptance.py); batching
(batch 1 only, as the paper).
"""

from __future__ import annotations

import resource
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from mtpc.backbones.engine import cuda_sync, make_engine
from mtpc.names import MIN_DECODE_WINDOW
from mtpc.speculative.acceptance import TorchChooser
from mtpc.speculative.loop import (
    CircuitDrafter,
    DecodeConfig,
    DecodeStats,
    plain_decode,
    speculative_decode,
)

HEAD_DICT_KEYS = ("kind", "window", "rank", "lora_depth", "seed", "leaf_delta_rank")


@dataclass
class GenerationStats:
    """Metrics of one generation, named as in DESIGN section 3 (plain decoding: one 'cycle' per byte)."""

    mu_lat: float  # mean seconds per cycle, prefill excluded
    mu_acc: float  # mean accepted drafted bytes per cycle (0 for plain decoding)
    tokens_per_cycle: float  # mean bytes emitted per cycle
    throughput: float  # bytes emitted by cycles / decode seconds (measured)
    max_throughput: float  # window / mu_lat
    cycles: int
    generated: int  # bytes returned (the prefill byte included)
    decode_generated: int  # bytes returned that came from cycles
    prefill_s: float
    decode_s: float
    backbone_calls: int
    peak_mem_bytes: int
    window: int
    extra_token: str  # keep | drop | plain
    mode: str
    per_position_acceptance: list[float | None] = field(default_factory=list)  # (n,) None = never tested
    tested_at: list[int] = field(default_factory=list)  # (n,)
    accepted_at: list[int] = field(default_factory=list)  # (n,)
    accepted_length_histogram: list[int] = field(default_factory=list)  # (n+1,) cycles with s = i
    cycle_s: list[float] = field(default_factory=list)

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_run(cls, st: DecodeStats, mode: str, peak_mem_bytes: int) -> GenerationStats:
        cycles = len(st.cycle_s)
        decode_s = float(sum(st.cycle_s))
        mu_lat = decode_s / cycles if cycles else 0.0
        hist = [0] * (st.window + 1)
        for s in st.accepted:
            hist[s] += 1
        if st.extra_token == "plain":
            mu_acc, tpc = 0.0, 1.0
        else:
            mu_acc = sum(st.accepted) / cycles if cycles else 0.0
            tpc = sum(st.emitted) / cycles if cycles else 0.0
        return cls(
            mu_lat=mu_lat,
            mu_acc=mu_acc,
            tokens_per_cycle=tpc,
            throughput=st.decode_generated / decode_s if decode_s > 0 else 0.0,
            max_throughput=st.window / mu_lat if mu_lat > 0 else 0.0,
            cycles=cycles,
            generated=st.generated,
            decode_generated=st.decode_generated,
            prefill_s=st.prefill_s,
            decode_s=decode_s,
            backbone_calls=st.backbone_calls,
            peak_mem_bytes=peak_mem_bytes,
            window=st.window,
            extra_token=st.extra_token,
            mode=mode,
            per_position_acceptance=[
                a / t if t else None for a, t in zip(st.accepted_at, st.tested_at, strict=True)
            ],
            tested_at=list(st.tested_at),
            accepted_at=list(st.accepted_at),
            accepted_length_histogram=hist if st.extra_token != "plain" else [],
            cycle_s=list(st.cycle_s),
        )


@dataclass
class GenerationOutput:
    ids: Tensor  # (T,) generated ids only (no prompt)
    text: str  # decoded with the backbone's tokenizer ("" without one); special ids dropped
    stats: GenerationStats


def _peak_mem_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_mem(device: torch.device) -> int:
    """Peak device memory on CUDA; on CPU the process's peak resident set (never reset)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _wrap_backbone(backbone: Any, lora_depth: int) -> Any:
    from mtpc.backbones.registry import wrap

    if isinstance(backbone, nn.Module) and hasattr(backbone, "new_cache") and hasattr(backbone, "stp_logits"):
        if backbone.lora_depth != lora_depth:
            raise ValueError(
                f"backbone: the adapter has lora_depth={backbone.lora_depth} but the head needs lora_depth={lora_depth}"
            )
        return backbone
    if isinstance(backbone, nn.Module) and hasattr(backbone, "get_output_embeddings"):
        return wrap(backbone, lora_depth=lora_depth)
    raise ValueError(
        f"backbone: expected a transformers causal LM or a backbone adapter, got {type(backbone).__name__}"
    )


def _fresh_head(spec: dict, backbone: Any) -> nn.Module:
    """A random head from {"kind", "window", "rank", "lora_depth", "seed"} (seeded leaves and sums)."""
    from mtpc.heads import HeadConfig, MtpcHead
    from mtpc.names import default_rank

    unknown = sorted(set(spec) - set(HEAD_DICT_KEYS))
    missing = [k for k in ("kind", "window") if k not in spec]
    if unknown or missing:
        raise ValueError(
            f"head: dict keys must be a subset of {HEAD_DICT_KEYS} including 'kind' and 'window'; "
            f"unknown {unknown}, missing {missing}"
        )
    kind = spec["kind"]
    cfg = HeadConfig(
        kind=kind,
        window=spec["window"],
        rank=spec.get("rank", default_rank(kind)),
        vocab=backbone.vocab_size,
        hidden=backbone.hidden_size,
        lora_depth=spec.get("lora_depth", backbone.lora_depth),
        backbone=str(getattr(backbone, "name", "")),
        leaf_delta_rank=spec.get("leaf_delta_rank", 0),
    )
    head = MtpcHead(cfg, device=backbone.device, dtype=backbone.dtype)
    gen = torch.Generator(device=backbone.device).manual_seed(int(spec.get("seed", 0)))
    head.reset_parameters(generator=gen)
    with torch.no_grad():  # random sum units too, so cp/hmm/btree differ from ff
        for name in head.sum_names:
            head.sum_bias[name].normal_(0.0, 1.0, generator=gen)
    return head


class GraphedDraft:
    """head + draft captured as one CUDA graph per (greedy, prefix) case (CUDA only).

    Plugs into the loop as its head_fn (`head`: passes the hidden state through) and drafter
    (`__call__`: replays head_fn + circuit._draft on it). A capture that fails (an op that reads
    the host, say) falls back to running eagerly; `errors` records why.
    """

    def __init__(self, head_fn: Any, circuit: Any, generator: torch.Generator | None):
        self.head_fn, self.circuit, self.generator = head_fn, circuit, generator
        self.graphs: dict[tuple[bool, bool], Any] = {}
        self.errors: dict[tuple[bool, bool], str] = {}

    def head(self, hidden: Tensor) -> dict[str, Tensor]:
        return {"hidden": hidden}

    def _eager(self, hidden: Tensor, prefix: Tensor | None, greedy: bool):
        return self.circuit._draft(self.head_fn(hidden), prefix, generator=self.generator, greedy=greedy)

    def __call__(
        self, theta: dict[str, Tensor], prefix: Tensor | None, greedy: bool
    ) -> tuple[Tensor, Tensor]:
        from mtpc.backbones.graphs import CapturedFn

        key, hidden = (greedy, prefix is None), theta["hidden"]
        args = (hidden,) if prefix is None else (hidden, prefix)
        if key not in self.graphs and key not in self.errors:
            try:
                self.graphs[key] = CapturedFn(
                    lambda h, *pre: self._eager(h, pre[0] if pre else None, greedy),
                    args,
                    generator=None if greedy else self.generator,
                )
            except Exception as e:  # noqa: BLE001 - any capture failure: run eagerly, say why
                self.errors[key] = f"{type(e).__name__}: {e}"
        if key in self.graphs:
            return self.graphs[key](*args)
        return self._eager(hidden, prefix, greedy)


class CompiledDraft:
    """head + greedy draft through torch.compile (static shapes, inductor's C++ wrapper on the
    CPU; `compile_static`): a graph per (prefix or not) case, compiled on first use.

    Plugs into the loop as head_fn (`head`: passes the hidden state through) and drafter. Only
    greedy drafts are compiled: a sampled draft draws from the model's generator, which stays
    eager. Any draft is valid for exactness (the verifier decides), so the ~1e-6 rounding of the
    fused kernels cannot change the output; the conditionals a greedy cycle returns are unused.
    """

    def __init__(self, head_fn: Any, circuit: Any, generator: torch.Generator | None, device: torch.device):
        self.head_fn, self.circuit, self.generator = head_fn, circuit, generator
        from mtpc.backbones.graphs import compile_static

        self._fn = compile_static(self._greedy, device)

    def head(self, hidden: Tensor) -> dict[str, Tensor]:
        return {"hidden": hidden}

    def _greedy(self, hidden: Tensor, prefix: Tensor | None):
        return self.circuit._draft(self.head_fn(hidden), prefix, generator=None, greedy=True)

    def __call__(
        self, theta: dict[str, Tensor], prefix: Tensor | None, greedy: bool
    ) -> tuple[Tensor, Tensor]:
        if greedy:
            return self._fn(theta["hidden"], prefix)
        return self.circuit._draft(self.head_fn(theta["hidden"]), prefix, generator=self.generator, greedy=False)


class MtpcModel:
    """A frozen backbone, an MtPC head and exact self-speculative decoding (batch 1).

    cuda_graphs: capture step, verify and head + draft on CUDA with the compact engine
    (None: on when the backbone is on CUDA and its engine is "compact"). compile: the compact
    engine's decoding calls and, without CUDA graphs, the greedy head + draft (`CompiledDraft`)
    through torch.compile with static shapes (each new shape compiles for seconds).
    weights: the compact engine's weight layout ("views", "packed" or "onednn"; None: oneDNN's
    on the CPU in float32 / bf16 without compile, else views; see mtpc/backbones/llama.py). Both
    are passed to every engine this model builds.
    """

    def __init__(
        self, backbone: Any, head: nn.Module, cuda_graphs: bool | None = None, compile: bool = False,
        weights: str | None = None,
    ):  # fmt: skip
        cfg = head.config
        if cfg.window < MIN_DECODE_WINDOW:
            raise ValueError(f"head: speculative decoding needs window >= {MIN_DECODE_WINDOW}, got {cfg.window}")
        head.check_compatible(backbone.hidden_size, backbone.vocab_size)
        from mtpc.backbones.shipped import check_backbone_label

        check_backbone_label(cfg.backbone, getattr(backbone, "name", ""))
        if cfg.lora_depth != backbone.lora_depth:
            raise ValueError(f"head lora_depth={cfg.lora_depth} != backbone lora_depth={backbone.lora_depth}")
        self.backbone = backbone
        self.head = head.to(device=backbone.device).eval()
        self.circuit = head.circuit
        self.window = cfg.window
        compact_cuda = getattr(backbone, "engine", "hf") == "compact" and backbone.device.type == "cuda"
        self.cuda_graphs = compact_cuda if cuda_graphs is None else bool(cuda_graphs and compact_cuda)
        compact = getattr(backbone, "engine", "hf") == "compact"
        if weights is not None and not compact:
            raise ValueError(f"weights={weights!r}: only the compact engine has a weight layout (this backbone's is 'hf')")
        self._engine_kw = ({"compile": True} if compile and compact else {}) | ({"weights": weights} if weights else {})
        self._engines: dict[bool, Any] = {}  # draft top or not -> engine (caches kept between calls)
        self._head_onednn = False if compile else None  # inductor does not lower oneDNN's blocked weights
        self._gen = torch.Generator(device=backbone.device)  # re-seeded per call; captured graphs advance it
        self._graphed_draft = (
            GraphedDraft(self._head_fn, self.circuit, self._gen) if self.cuda_graphs else None
        )
        self._compiled_draft = (
            CompiledDraft(self._head_fn, self.circuit, self._gen, backbone.device)
            if compile and not self.cuda_graphs
            else None
        )

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls, head_dir: str | Path, backbone: Any = None, *, cuda_graphs: bool | None = None, compile: bool = False,
        weights: str | None = None, **load_kw: Any,
    ) -> MtpcModel:  # fmt: skip
        """Load a `save_head` export; the backbone is its recorded name/path unless one is given.

        load_kw go to `mtpc.backbones.load_backbone` when the backbone is loaded here (e.g.
        engine="hf" to decode through the HF layers); cuda_graphs / compile / weights: see the class.
        """
        from mtpc.backbones import load_backbone
        from mtpc.heads import load_head

        head, lora_state = load_head(head_dir)
        k = head.config.lora_depth
        if backbone is None:
            if not head.config.backbone:
                raise ValueError(f"{head_dir}: the head records no backbone; pass backbone=")
            backbone = load_backbone(head.config.backbone, lora_depth=k, **load_kw)
        elif isinstance(backbone, (str, Path)):
            backbone = load_backbone(str(backbone), lora_depth=k, **load_kw)
        else:
            backbone = _wrap_backbone(backbone, k)
        if lora_state:
            backbone.load_lora_state_dict(lora_state)
        elif k > 0:
            raise ValueError(f"{head_dir}: lora_depth={k} but the export has no lora.safetensors")
        head = head.to(dtype=backbone.dtype)
        return cls(backbone, head, cuda_graphs=cuda_graphs, compile=compile, weights=weights)

    @classmethod
    def from_components(
        cls, backbone: Any, head: nn.Module | dict, *, cuda_graphs: bool | None = None, compile: bool = False,
        weights: str | None = None,
    ) -> MtpcModel:  # fmt: skip
        """backbone: a transformers causal LM or an adapter; head: an MtpcHead or a dict for a fresh one;
        cuda_graphs / compile / weights: see the class."""
        if isinstance(head, dict):
            lora_depth = int(head.get("lora_depth", 0))
            backbone = _wrap_backbone(backbone, lora_depth)
            head = _fresh_head(head, backbone)
        elif isinstance(head, nn.Module) and hasattr(head, "config") and hasattr(head, "circuit"):
            backbone = _wrap_backbone(backbone, head.config.lora_depth)
        else:
            raise ValueError(f"head: expected an MtpcHead or a dict spec, got {type(head).__name__}")
        return cls(backbone, head, cuda_graphs=cuda_graphs, compile=compile, weights=weights)

    # -- helpers --------------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.backbone.tokenizer

    @property
    def device(self) -> torch.device:
        return self.backbone.device

    def encode_prompt(self, prompt: str | bytes | Tensor) -> Tensor:  # -> (P,) int64
        """ids as given; bytes raw; str as a one-turn chat (see the module docstring)."""
        if isinstance(prompt, Tensor):
            if prompt.dim() != 1 or prompt.dtype.is_floating_point or prompt.numel() == 0:
                raise ValueError(
                    f"prompt: expected a non-empty 1-D integer tensor, got {prompt.dtype} {tuple(prompt.shape)}"
                )
            if int(prompt.min()) < 0 or int(prompt.max()) >= self.backbone.vocab_size:
                raise ValueError(f"prompt: ids must lie in [0, {self.backbone.vocab_size})")
            return prompt.to(device=self.device, dtype=torch.long)
        if not isinstance(prompt, (str, bytes, bytearray)):
            raise ValueError(f"prompt: expected str, bytes or a 1-D LongTensor, got {type(prompt).__name__}")
        tok = self.tokenizer
        if tok is None:
            raise ValueError("prompt: this backbone has no tokenizer; pass a 1-D LongTensor of ids")
        if isinstance(prompt, str) and hasattr(tok, "render_prompt"):
            ids = tok.render_prompt(prompt)
        else:
            ids = tok.encode(bytes(prompt) if isinstance(prompt, bytearray) else prompt)
        if not ids:
            raise ValueError("prompt: encodes to no ids")
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def _config(self, prompt: Tensor, window: int, **kw: Any) -> DecodeConfig:
        stops = tuple(getattr(self.backbone, "stop_token_ids", ()) or ())
        cfg = DecodeConfig(eos_id=stops if len(stops) > 1 else self.backbone.eos_token_id, **kw)
        need = prompt.shape[0] + cfg.max_new_tokens + window
        if need > self.backbone.max_context:
            raise ValueError(
                f"max_new_tokens={cfg.max_new_tokens}: prompt ({prompt.shape[0]}) + max_new_tokens + window "
                f"({window}) = {need} exceeds the backbone's max_context={self.backbone.max_context}"
            )
        return cfg

    def _sync(self):
        return cuda_sync(self.device)

    def _generator(self, seed: int | None) -> torch.Generator:
        gen = self._gen
        if seed is None:
            gen.seed()
        else:
            gen.manual_seed(int(seed))
        return gen

    def _output(self, ids: list[int], st: DecodeStats, mode: str) -> GenerationOutput:
        tok = self.tokenizer
        text = tok.decode_text(ids) if tok is not None and hasattr(tok, "decode_text") else ""
        stats = GenerationStats.from_run(st, mode, _peak_mem(self.device))
        return GenerationOutput(torch.tensor(ids, dtype=torch.long), text, stats)

    def _head_fn(self, hidden: Tensor) -> dict[str, Tensor]:
        """Normalised circuit parameters for one context through the head's batch-1 decoding path
        (`MtpcHead.decoder`, equal to `circuit.normalize(head(e))`; built once per weights)."""
        return self.head.decoder(self._head_onednn).params(hidden)

    def engine_label(self) -> str:
        """How this model decodes: "compact/<weight layout>" (e.g. "compact/onednn") or "hf". Latencies
        compare only within one (an evaluation appends it to its hardware setting). Reads the verifier
        engine a generation built (else builds it)."""
        eng = self._engines.get(False) or self._engines.get(True) or self.engine(False, 0)
        layout = getattr(eng, "layout", None)
        return f"compact/{layout}" if layout else "hf"

    def engine(self, draft: bool = True, capacity: int = 0) -> Any:
        """This model's engine (draft top or verifier only), reset to hold `capacity` positions."""
        eng = self._engines.get(draft)
        if eng is None:
            eng = self._engines[draft] = make_engine(
                self.backbone, capacity, draft=draft, cuda_graphs=self.cuda_graphs, **self._engine_kw
            )
        eng.reset(capacity)
        return eng

    # -- generation -----------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(
        self,
        prompt: str | bytes | Tensor,
        max_new_tokens: int = 256,
        mode: str = "greedy",
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        extra_token: str = "keep",
        ban_eos: bool = False,
    ) -> GenerationOutput:
        """Self-speculative decoding; the output is distributed exactly as `generate_plain`'s
        (greedy: identical) for extra_token="keep"; "drop" is the paper's Algorithm 2 (biased when sampling)."""
        ids = self.encode_prompt(prompt)
        cfg = self._config(
            ids,
            self.window,
            max_new_tokens=max_new_tokens,
            mode=mode,
            temperature=temperature,
            top_p=top_p,
            extra_token=extra_token,
            ban_eos=ban_eos,
        )
        gen = self._generator(seed)
        _peak_mem_reset(self.device)
        engine = self.engine(True, ids.shape[0] + cfg.max_new_tokens + self.window)
        head_fn, drafter = self.head.decoder(self._head_onednn).params, CircuitDrafter(self.circuit, gen)  # checked once per call
        if self._graphed_draft is not None:
            head_fn, drafter = self._graphed_draft.head, self._graphed_draft
        elif self._compiled_draft is not None:  # it holds self._gen, the generator `gen` is
            head_fn, drafter = self._compiled_draft.head, self._compiled_draft
        out, st = speculative_decode(
            engine, head_fn, drafter, self.window, ids, cfg, TorchChooser(gen), self._sync()
        )
        return self._output(out, st, mode)

    @torch.inference_mode()
    def generate_plain(
        self,
        prompt: str | bytes | Tensor,
        max_new_tokens: int = 256,
        mode: str = "greedy",
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        extra_token: str = "keep",  # accepted for a uniform call signature; unused
        ban_eos: bool = False,
    ) -> GenerationOutput:
        """The plain single-token baseline on the same backbone (verifier only), one call per byte."""
        ids = self.encode_prompt(prompt)
        cfg = self._config(
            ids,
            1,
            max_new_tokens=max_new_tokens,
            mode=mode,
            temperature=temperature,
            top_p=top_p,
            extra_token=extra_token,
            ban_eos=ban_eos,
        )
        gen = self._generator(seed)
        _peak_mem_reset(self.device)
        engine = self.engine(False, ids.shape[0] + cfg.max_new_tokens + 1)
        out, st = plain_decode(engine, ids, cfg, TorchChooser(gen), self._sync())
        return self._output(out, st, mode)
