"""`MtpcModel`: a backbone plus an MtPC head behind a `generate` call.

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

Leaves out: the cycle itself (loop.py), the acceptance maths (acceptance.py), what a generation
returns (stats.py: `GenerationOutput`, `GenerationStats`), the captured / compiled head + draft
(drafters.py); batching (batch 1 only, as the paper).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from mtpc.backbones.common import Backbone
from mtpc.backbones.engine import cuda_sync, make_engine
from mtpc.names import check_decode_window, check_draft_len
from mtpc.speculative.acceptance import TorchChooser
from mtpc.speculative.drafters import CompiledDraft, GraphedDraft
from mtpc.speculative.fused_cycle import FusedKeepCycle
from mtpc.speculative.loop import (
    CircuitDrafter,
    DecodeConfig,
    DecodeStats,
    fused_speculative_decode,
    plain_decode,
    speculative_decode,
)
from mtpc.speculative.stats import GenerationOutput, GenerationStats, peak_memory_bytes, reset_peak_memory

HEAD_DICT_KEYS = ("kind", "window", "rank", "lora_depth", "seed", "leaf_delta_rank", "known_byte")


def _wrap_backbone(backbone: Backbone | nn.Module, lora_depth: int) -> Backbone:
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


def _fresh_head(spec: dict, backbone: Backbone) -> nn.Module:
    """A random head from {"kind", "window", "rank", "lora_depth", "seed", "leaf_delta_rank",
    "known_byte"} (seeded leaves, sums and known-byte table)."""
    from mtpc.heads import HeadConfig, random_head
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
        known_byte=spec.get("known_byte", False),
    )
    # random sum units too, so cp/hmm/btree differ from ff
    return random_head(cfg, spec.get("seed", 0), device=backbone.device, dtype=backbone.dtype, sum_std=1.0)


class MtpcModel:
    """A frozen backbone, an MtPC head and exact self-speculative decoding (batch 1).

    cuda_graphs: capture step, verify and head + draft on CUDA with the compact engine
    (None: on when the backbone is on CUDA and its engine is "compact"). compile: the compact
    engine's decoding calls and, without CUDA graphs, the greedy head + draft (`CompiledDraft`)
    through torch.compile with static shapes (each new shape compiles for seconds).
    weights: the compact engine's weight layout ("views", "packed", "onednn" or "rowdot"; None:
    the row-dot kernel on an x86 CPU in float32, else oneDNN's on the CPU in float32 / bf16, in
    both cases without compile, else views; see mtpc/backbones/llama.py). Both are passed to every
    engine this model builds.
    draft_len: bytes each cycle feeds, names.MIN_DECODE_WINDOW <= draft_len <= the head's window n (None: n);
    the cycle drafts n and feeds the first draft_len (mtpc/speculative/loop.py, "The draft length"):
    fewer verify rows when the head's late positions are rarely accepted. `generate` can override it.
    fused_cycle: run each keep cycle as one call (`FusedKeepCycle`: head + draft, verify and accept
    from device inputs, one CUDA graph per setting with cuda_graphs) on the compact engine with static
    shapes (which plain decoding then uses too); off by default: unverified on a GPU.
    """

    def __init__(
        self, backbone: Backbone, head: nn.Module, cuda_graphs: bool | None = None, compile: bool = False,
        weights: str | None = None, draft_len: int | None = None, fused_cycle: bool = False,
    ):  # fmt: skip
        cfg = head.config
        check_decode_window(cfg.window, "head: speculative decoding")
        head.check_compatible(backbone.hidden_size, backbone.vocab_size)
        from mtpc.backbones.shipped import check_backbone_label

        check_backbone_label(cfg.backbone, getattr(backbone, "name", ""))
        if cfg.lora_depth != backbone.lora_depth:
            raise ValueError(f"head lora_depth={cfg.lora_depth} != backbone lora_depth={backbone.lora_depth}")
        self.backbone = backbone
        self.head = head.to(device=backbone.device).eval()
        self.circuit = head.circuit
        self.window = cfg.window
        self.draft_len = check_draft_len(draft_len, self.window)
        compact_cuda = getattr(backbone, "engine", "hf") == "compact" and backbone.device.type == "cuda"
        self.cuda_graphs = compact_cuda if cuda_graphs is None else bool(cuda_graphs and compact_cuda)
        compact = getattr(backbone, "engine", "hf") == "compact"
        if weights is not None and not compact:
            raise ValueError(
                f"weights={weights!r}: only the compact engine has a weight layout (this backbone's is 'hf')"
            )
        if fused_cycle and not compact:
            raise ValueError("fused_cycle=True: needs the compact engine (this backbone's is 'hf')")
        self.fused_cycle = bool(fused_cycle)
        self._engine_kw = (
            ({"compile": True} if compile and compact else {})
            | ({"weights": weights} if weights else {})
            | ({"static": True} if fused_cycle else {})
        )
        self._fused: dict[tuple, FusedKeepCycle] = {}  # decoding setting -> its fused cycle
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
        cls, head_dir: str | Path, backbone: Backbone | nn.Module | str | Path | None = None, *, cuda_graphs: bool | None = None, compile: bool = False,
        weights: str | None = None, allow_unverified: bool = False, draft_len: int | None = None,
        fused_cycle: bool = False, **load_kw: Any,
    ) -> MtpcModel:  # fmt: skip
        """Load a `save_head` export — or a shipped head: `"default"` (the default backbone's default
        head) or `"shipped:<name>"` (`mtpc.shipped_heads`; a local folder named so is given as a path,
        `./default`); the backbone is its recorded name/path unless one is given.

        load_kw go to `mtpc.backbones.load_backbone` when the backbone is loaded here (e.g.
        engine="hf" to decode through the HF layers); cuda_graphs / compile / weights / draft_len /
        fused_cycle: see the class (a shipped head's draft_len defaults to the one its index records).
        allow_unverified: accept an export without SHA-256s (`load_head`; `migrate_head` adds them).
        """
        from mtpc.backbones import load_backbone
        from mtpc.heads import load_head
        from mtpc.shipped_heads import decode_defaults, resolve_head

        if draft_len is None:  # a shipped head's recorded default, else the head's window
            draft_len = decode_defaults(head_dir).get("draft_len")
        head_dir = resolve_head(head_dir)
        head, lora_state = load_head(head_dir, allow_unverified=allow_unverified)
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
        return cls(
            backbone, head, cuda_graphs=cuda_graphs, compile=compile, weights=weights, draft_len=draft_len,
            fused_cycle=fused_cycle,
        )  # fmt: skip

    @classmethod
    def from_components(
        cls, backbone: Backbone | nn.Module, head: nn.Module | dict, *, cuda_graphs: bool | None = None, compile: bool = False,
        weights: str | None = None, draft_len: int | None = None, fused_cycle: bool = False,
    ) -> MtpcModel:  # fmt: skip
        """backbone: a transformers causal LM or an adapter; head: an MtpcHead or a dict for a fresh one;
        cuda_graphs / compile / weights / draft_len / fused_cycle: see the class."""
        if isinstance(head, dict):
            lora_depth = int(head.get("lora_depth", 0))
            backbone = _wrap_backbone(backbone, lora_depth)
            head = _fresh_head(head, backbone)
        elif isinstance(head, nn.Module) and hasattr(head, "config") and hasattr(head, "circuit"):
            backbone = _wrap_backbone(backbone, head.config.lora_depth)
        else:
            raise ValueError(f"head: expected an MtpcHead or a dict spec, got {type(head).__name__}")
        return cls(
            backbone, head, cuda_graphs=cuda_graphs, compile=compile, weights=weights, draft_len=draft_len,
            fused_cycle=fused_cycle,
        )  # fmt: skip

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
        stats = GenerationStats.from_run(st, mode, peak_memory_bytes(self.device))
        return GenerationOutput(torch.tensor(ids, dtype=torch.long), text, stats)

    def _head_fn(self, hidden: Tensor, known: Tensor | None = None) -> dict[str, Tensor]:
        """Normalised circuit parameters for one context (hidden (d,), the known byte (1,): read by a
        known-byte head only) through the head's batch-1 decoding path (`MtpcHead.decoder`, equal to
        `circuit.normalize(head(e, c))`; built once per weights)."""
        return self.head.decoder(self._head_onednn).params(hidden, known)

    def engine_label(self) -> str:
        """How this model decodes: "compact/<weight layout>" (e.g. "compact/onednn"; "compact/rowdot-bf16"
        when the row-dot layout reads its weights from bf16 storage, `LlamaEngine.bf16_storage`) or "hf".
        Latencies compare only within one (an evaluation appends it to its hardware setting). Reads the
        verifier engine a generation built (else builds it)."""
        eng = self._engines.get(False) or self._engines.get(True) or self.engine(False, 0)
        layout = getattr(eng, "layout", None)
        if not layout:
            return "hf"
        return f"compact/{layout}" + ("-bf16" if getattr(eng, "bf16_storage", False) else "")

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
        draft_len: int | None = None,
    ) -> GenerationOutput:
        """Self-speculative decoding; the output is distributed exactly as `generate_plain`'s
        (greedy: identical) for extra_token="keep"; "drop" is the paper's Algorithm 2 (biased when
        sampling; refused for a known-byte head, which needs the window's first byte).
        draft_len: bytes fed per cycle (None: the model's `draft_len`; see the class)."""
        if extra_token == "drop" and self.head.config.known_byte:
            raise ValueError(
                'extra_token="drop": this head has known_byte=True (it needs the kept byte c); use "keep"'
            )
        m = self.draft_len if draft_len is None else check_draft_len(draft_len, self.window)
        ids = self.encode_prompt(prompt)
        cfg = self._config(
            ids,
            m,
            max_new_tokens=max_new_tokens,
            mode=mode,
            temperature=temperature,
            top_p=top_p,
            extra_token=extra_token,
            ban_eos=ban_eos,
        )
        gen = self._generator(seed)
        reset_peak_memory(self.device)
        engine = self.engine(True, ids.shape[0] + cfg.max_new_tokens + m)
        if self.fused_cycle and extra_token == "keep":
            key = (m, cfg.mode, cfg.temperature, cfg.top_p, tuple(cfg.stop_ids), repr(cfg.banned))
            cycle = self._fused.get(key)
            if cycle is None or cycle.engine is not engine:
                cycle = self._fused[key] = FusedKeepCycle(
                    engine, self._head_fn, self.circuit, m, cfg, gen, graphs=self.cuda_graphs
                )
            out, st = fused_speculative_decode(engine, cycle, m, ids, cfg, TorchChooser(gen), self._sync())
            return self._output(out, st, mode)
        head_fn, drafter = (
            self.head.decoder(self._head_onednn).params,
            CircuitDrafter(self.circuit, gen),
        )  # checked once per call
        if self._graphed_draft is not None:
            head_fn, drafter = self._graphed_draft.head, self._graphed_draft
        elif self._compiled_draft is not None:  # it holds self._gen, the generator `gen` is
            head_fn, drafter = self._compiled_draft.head, self._compiled_draft
        out, st = speculative_decode(engine, head_fn, drafter, m, ids, cfg, TorchChooser(gen), self._sync())
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
        reset_peak_memory(self.device)
        engine = self.engine(False, ids.shape[0] + cfg.max_new_tokens + 1)
        out, st = plain_decode(engine, ids, cfg, TorchChooser(gen), self._sync())
        return self._output(out, st, mode)
