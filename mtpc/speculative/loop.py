"""The decoding cycle: prefill, draft, one verifying call, accept, crop (batch 1).

Holds: `plain_decode` (the single-token baseline), `speculative_decode` (extra_token "keep":
one backbone call per cycle, exact; "drop": the paper's Algorithm 2 as written, not
distribution-preserving when sampling), the circuit drafter, and per-run statistics. The
`Engine` protocol that owns the caches lives in mtpc/backbones/engine.py (re-exported here).

One host read per cycle: draft and verify run on the device; a sampled cycle accepts there too and
reads back one small tensor [s, extra, drafted bytes] (`.tolist()`), from which the host learns how
far to crop and what was emitted; a greedy cycle reads back the verifier's choices and the draft
instead and applies the greedy rule on the host (`greedy_accept`: a few comparisons, where the
device rule is ~10 small tensor ops), the next known byte staying a device view of the choices.
On the CPU either accept is one native call (mtpc.kernels; `MTPC_NATIVE_CYCLE=0` turns it off).
Fixed shapes per window (n bytes fed per verify, 1 per plain step) let the engine capture its
calls as CUDA graphs.

The keep cycle (DESIGN section 3). The caches hold bytes up to a; c = x_{a+1} is emitted but
has no state. theta_a = head(e_a, c) drafts the window [c, d_2..d_n] with prefix [c] (c reaches
a known-byte head's input too; other heads ignore it: either way theta_a depends only on bytes
fixed before the draft, so exactness holds); one call
feeds it; verifier row j is p for window position j+2, tested against row j+2 of the draft's
conditionals; the extra token (residual after a rejection, bonus after full acceptance)
becomes the next c; every cache is cropped to a + 1 + s.

The end of a generation. A cycle tests only the drafts it could emit (`testable_drafts`): at most
budget - 1 of them (keep; budget for drop), budget = max_new_tokens - bytes emitted so far, and
none after an allowed EOS; after accepting all of those the extra token comes from the next
verifier row (a shorter window: still exact). The window fed is always n bytes (fixed shapes);
only the test stops early. So every count (accepted, tested, emitted) is of bytes the generation
returns, and nothing is truncated afterwards. An accepted EOS ends the cycle without its extra token.

The draft length. `window` (m) may be shorter than the head's window n: the cycle drafts all n
and feeds the first m (a sampled draft's first m bytes are a draw from the circuit's marginal over
them, and its conditionals there are that marginal's, since q(x_i | x_<i) does not read later
positions; a greedy draft is any draft). Both cycles stay exact; a shorter verify costs less when
the head's late positions are rarely accepted (`MtpcModel.generate(draft_len=)`).

The drop cycle (Algorithm 2). The caches hold bytes up to a and the verifier row for x_{a+1}
is known. The draft d_1..d_n is sampled from theta_a = head(e_a, None) without prefix (no known
byte: a known-byte head cannot run it); d_1 is tested against
that row, d_{j+1} against row j of the call; after s >= 1 acceptances the extra token is
thrown away (caches cropped to a + s); after s = 0 the correction token is kept and fed in
an extra call.

Leaves out: the acceptance maths (acceptance.py), model loading and the public API
(model.py), batching (batch 1 only, as the paper).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from mtpc.backbones.engine import AdapterEngine, Engine, StepOutput
from mtpc.kernels import greedy_accept_native, native_cycle_unsupported, sample_accept
from mtpc.names import DECODE_MODES, EXTRA_TOKEN_OPTIONS, check_decode_window
from mtpc.speculative.acceptance import (
    Chooser,
    TorchChooser,
    as_index,
    greedy_accept,
    greedy_target,
    sample_verify,
    target_probs,
    testable_drafts,
)

__all__ = ["AdapterEngine", "CircuitDrafter", "DecodeConfig", "DecodeStats", "Engine", "StepOutput",
           "fused_speculative_decode", "plain_decode", "plain_decode_batch", "speculative_decode"]  # fmt: skip


# head_fn: (draft hidden (d,), the known byte c (1,) or None in the drop cycle) -> normalised
# circuit parameters for that context
HeadFn = Callable[[Tensor, Tensor | None], dict[str, Tensor]]
# drafter: (params, prefix (k,) or None, greedy) -> (window (n,) int64, log conditionals (n, v); a
# greedy draft may return None for them: greedy verification does not read them)
Drafter = Callable[[dict[str, Tensor], Tensor | None, bool], tuple[Tensor, Tensor | None]]


class CircuitDrafter:
    """Drafts a window from a circuit with its fused `_draft` (the window and its conditionals in one
    call; every circuit kind implements it)."""

    def __init__(self, circuit: Any, generator: torch.Generator | None = None):
        self.circuit = circuit
        self.generator = generator
        self.window = circuit.window

    def __call__(
        self, q: dict[str, Tensor], prefix: Tensor | None, greedy: bool
    ) -> tuple[Tensor, Tensor | None]:
        # (n,), (n, v); a greedy cycle never reads the conditionals: not formed (None)
        return self.circuit._draft(
            q, prefix, generator=self.generator, greedy=greedy, conditionals=not greedy
        )


@dataclass
class DecodeConfig:
    """Options shared by plain and speculative decoding."""

    max_new_tokens: int = 256
    mode: str = "greedy"  # greedy | sample
    temperature: float = 1.0
    top_p: float = 1.0
    extra_token: str = "keep"  # keep | drop (speculative only)
    eos_id: int | tuple[int, ...] | None = (
        None  # stop after emitting it, or any of several (None: never early)
    )
    ban_eos: bool = False  # give EOS (every one of them) probability 0 instead

    def __post_init__(self):
        if self.mode not in DECODE_MODES:
            raise ValueError(f"mode must be one of {DECODE_MODES}, got {self.mode!r}")
        if self.extra_token not in EXTRA_TOKEN_OPTIONS:
            raise ValueError(f"extra_token must be one of {EXTRA_TOKEN_OPTIONS}, got {self.extra_token!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.mode == "sample":
            target_probs(torch.zeros(2), self.temperature, self.top_p)  # validates both

    @property
    def eos_ids(self) -> list[int]:
        """The stop ids: a backbone can have several (eos and a chat turn's end, e.g. <|eot_id|>)."""
        return (
            []
            if self.eos_id is None
            else [self.eos_id]
            if isinstance(self.eos_id, int)
            else list(self.eos_id)
        )

    @property
    def banned(self) -> int | list[int] | None:
        ids = self.eos_ids
        return None if not (self.ban_eos and ids) else ids[0] if len(ids) == 1 else ids

    @property
    def stop_ids(self) -> list[int]:
        return [] if self.ban_eos else self.eos_ids


@dataclass
class DecodeStats:
    """Per-generation counts and times. Window positions are 1-based in the docs, 0-based here."""

    window: int  # n (1 for plain decoding)
    extra_token: str  # keep | drop | plain
    prefill_s: float = 0.0
    cycle_s: list[float] = field(default_factory=list)  # one entry per cycle (prefill excluded)
    accepted: list[int] = field(default_factory=list)  # s per cycle
    emitted: list[int] = field(default_factory=list)  # bytes each cycle added to the output
    tested_at: list[int] = field(default_factory=list)  # (n,) tests at each window position
    accepted_at: list[int] = field(default_factory=list)  # (n,) acceptances at each window position
    generated: int = 0  # bytes returned, prefill byte included
    decode_generated: int = 0  # bytes returned that came from cycles (throughput numerator)
    backbone_calls: int = 0

    def __post_init__(self):
        if not self.tested_at:
            self.tested_at = [0] * self.window
            self.accepted_at = [0] * self.window

    def record_cycle(self, seconds: float, s: int, emitted: int, first_tested: int, tested: int) -> None:
        """`tested` window positions from `first_tested` (0-based) were tested; the first s passed."""
        self.cycle_s.append(seconds)
        self.accepted.append(s)
        self.emitted.append(emitted)
        for i in range(first_tested, first_tested + tested):
            self.tested_at[i] += 1
        for i in range(first_tested, first_tested + s):
            self.accepted_at[i] += 1

    def close(self, out: list[int], prefill_out: int, engine: Engine) -> None:
        """The generation's totals: bytes returned, those the cycles emitted (all but the `prefill_out`
        the prefill emitted), the backbone calls."""
        self.generated = len(out)
        self.decode_generated = len(out) - prefill_out
        self.backbone_calls = engine.calls


def _clock(sync: Callable[[], None] | None) -> float:
    if sync is not None:
        sync()
    return time.perf_counter()


def _pick(logits: Tensor, cfg: DecodeConfig, choose: Chooser) -> int | Tensor:
    """One token from verifier logits (v,), exactly as plain decoding chooses it (on the device)."""
    if cfg.mode == "greedy":
        return greedy_target(logits, cfg.banned)
    return choose(target_probs(logits, cfg.temperature, cfg.top_p, cfg.banned))


def _finish(out: list[int], new: list[int], cfg: DecodeConfig) -> bool:
    """Append `new` to `out` up to max_new_tokens and the first stop id (the host side of the stop
    rule; `acceptance.stop_hits` is the device side); True when generation ends."""
    for t in new:
        out.append(t)
        if len(out) >= cfg.max_new_tokens or t in cfg.stop_ids:
            return True
    return False


def _prefill(
    engine: Engine, prompt: Tensor, cfg: DecodeConfig, choose: Chooser, out: list[int], pick: bool = True
) -> tuple[StepOutput, Tensor | None, bool]:
    """Feed the prompt; with `pick` (plain decoding, the keep cycle) choose the first byte c (1,) from
    its last row as plain decoding does and apply the stop rule -> (step, c or None, done)."""
    step = engine.feed(prompt)
    if not pick:
        return step, None, False
    c = as_index(_pick(step.p_logits[-1], cfg, choose), prompt.device)
    return step, c, _finish(out, c.tolist(), cfg)


def plain_decode(
    engine: Engine,
    prompt: Tensor,  # (P,)
    cfg: DecodeConfig,
    choose: Chooser,
    sync: Callable[[], None] | None = None,
) -> tuple[list[int], DecodeStats]:
    """The single-token baseline: prefill, then one call per byte (one host read per byte)."""
    stats = DecodeStats(window=1, extra_token="plain")
    out: list[int] = []
    t0 = _clock(sync)
    _, c, done = _prefill(engine, prompt, cfg, choose, out)
    stats.prefill_s = _clock(sync) - t0
    while not done:
        t0 = _clock(sync)
        step = engine.feed(c)
        c = as_index(_pick(step.p_logits[-1], cfg, choose), prompt.device)
        done = _finish(out, c.tolist(), cfg)  # the step's one host read
        stats.record_cycle(_clock(sync) - t0, 0, 1, 0, 0)
    stats.close(out, 1, engine)
    return out, stats


def plain_decode_batch(
    engine: Any,
    prompts: list[Tensor],  # each (P_b,)
    cfg: DecodeConfig,
    choosers: list[Chooser],
    observe: Callable[[Tensor, Tensor], None] | None = None,
    groups: list[int] | None = None,
) -> list[list[int]]:
    """Plain decoding of several prompts at once (a `LlamaBatchEngine`: `prefill(prompts, new_tokens)`
    and `step(ids (B,))`, each -> p logits (B, v)). Row b draws with choosers[b] (one per row, as
    batch-1 `plain_decode` with its own chooser); every row stops as batch 1 does (max_new_tokens,
    the first stop id) and is ignored after that while the others run on. One host read per step.
    observe(logits (B, v), picked (B,)), if given, sees every step's logits and choices (before the
    rows' stop checks; finished rows included). groups: sizes of consecutive row groups with caches
    of their own (the engine's `prefill`; default one group)."""
    if len(choosers) != len(prompts):
        raise ValueError(f"choosers: one per prompt ({len(prompts)}), got {len(choosers)}")
    out: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    logits = engine.prefill(prompts, cfg.max_new_tokens, groups)
    while True:
        if cfg.mode == "greedy":
            picked = greedy_target(logits, cfg.banned)  # (B,)
        else:
            probs = target_probs(logits, cfg.temperature, cfg.top_p, cfg.banned)
            picked = torch.cat(
                [as_index(choose(probs[b]), logits.device) for b, choose in enumerate(choosers)]
            )
        if observe is not None:
            observe(logits, picked)
        for b, t in enumerate(picked.tolist()):  # the step's one host read
            if not done[b]:
                done[b] = _finish(out[b], [t], cfg)
        if all(done):
            return out
        logits = engine.step(picked)


def speculative_decode(
    engine: Engine,
    head_fn: HeadFn,
    drafter: Drafter,
    window: int,
    prompt: Tensor,  # (P,)
    cfg: DecodeConfig,
    choose: Chooser,
    sync: Callable[[], None] | None = None,
) -> tuple[list[int], DecodeStats]:
    """Self-speculative decoding with a circuit head; see the module docstring for the cycle.

    Draft, verify and accept stay on the device; each cycle reads back one small tensor
    [s, extra, drafts] (the accepted count and the bytes it emits), nothing else.
    """
    check_decode_window(window)
    greedy = cfg.mode == "greedy"
    stats = DecodeStats(window=window, extra_token=cfg.extra_token)
    out: list[int] = []
    dev = prompt.device

    def verify(
        draft: Tensor, p_logits: Tensor, log_q: Tensor | None, budget: int
    ) -> tuple[list[int], Tensor]:
        """draft (m,), p_logits (m+1, v), log_q (m, v) (None: greedy); test at most `budget` drafts and none past an
        allowed EOS -> ([s, extra, testable count, *draft] on the host, extra (1,) on the device)."""
        if greedy and native and p_logits.dtype == torch.float32:  # the CPU: one native call
            got = greedy_accept_native(p_logits, draft, budget, cfg.stop_ids, banned)
            return got.tolist(), got[1:2]  # the cycle's one host read
        if greedy:  # the verifier's choices and the draft in the one host read, the rule on the host
            m = draft.shape[0]
            targets = greedy_target(p_logits, cfg.banned)  # (m+1,)
            got = torch.cat([targets, draft]).tolist()  # the cycle's one host read
            s, count = greedy_accept(got[: m + 1], got[m + 1 :], budget, cfg.stop_ids)
            return [s, got[s], count, *got[m + 1 :]], targets[s : s + 1]
        p = target_probs(p_logits, cfg.temperature, cfg.top_p, cfg.banned)
        if native and type(choose) is TorchChooser and p.dtype == torch.float32:  # two uniforms
            u = torch.rand(2, generator=choose.generator, dtype=torch.float64)
            got = sample_accept(p, log_q.exp(), draft, budget, cfg.stop_ids, u)
            return got.tolist(), got[1:2]  # the cycle's one host read
        ok = testable_drafts(draft, budget, cfg.stop_ids)  # (m,)
        s, extra = sample_verify(draft, p, log_q.exp().to(p.dtype), choose, ok)
        extra = as_index(extra, dev)
        count = ok.sum().view(1)
        return torch.cat([as_index(s, dev), extra, count, draft]).tolist(), extra  # the cycle's one host read

    # on the CPU a cycle accepts in one native call (mtpc/csrc/accept.cpp): greedy, the same choices
    # as greedy_target + greedy_accept; sampling with the generator's chooser, sample_verify's
    # distribution from two uniforms of the same generator
    native = dev.type == "cpu" and native_cycle_unsupported(dev, torch.float32) is None
    banned = cfg.eos_ids if cfg.ban_eos else []
    t0 = _clock(sync)
    step, c, done = _prefill(engine, prompt, cfg, choose, out, pick=cfg.extra_token == "keep")
    last_p = step.p_logits[-1].clone()  # (v,) verifier row for the next position (kept across feeds)
    last_h = step.draft_hidden[-1]  # (d,) head input at the last byte with state
    stats.prefill_s = _clock(sync) - t0
    prefill_out = len(out)

    while not done:
        t0 = _clock(sync)
        a1 = engine.length  # a + 1 bytes have state
        if cfg.extra_token == "keep":
            theta = head_fn(last_h, c)
            x, log_q = drafter(theta, c, greedy)  # (n,), (n, v)
            x, log_q = x[:window], None if log_q is None else log_q[:window]  # the first `window` bytes
            step = engine.feed(x)
            got, c = verify(
                x[1:], step.p_logits, None if log_q is None else log_q[1:], cfg.max_new_tokens - len(out) - 1
            )
            s, extra, testable = got[0], got[1], got[2]
            engine.crop(a1 + 1 + s)
            new = got[3 : 3 + s] + [extra]
            last_h = step.draft_hidden[s]
            tested_from, tested = 1, min(s + 1, testable)
        else:
            theta = head_fn(last_h, None)
            x, log_q = drafter(theta, None, greedy)  # (n,), (n, v)
            x, log_q = x[:window], None if log_q is None else log_q[:window]
            step = engine.feed(x)
            p_logits = torch.cat([last_p.unsqueeze(0), step.p_logits])  # (n+1, v)
            got, extra_t = verify(x, p_logits, log_q, cfg.max_new_tokens - len(out))
            s, extra, testable = got[0], got[1], got[2]
            if s >= 1:  # Algorithm 2: keep the accepted drafts, throw the extra token away
                engine.crop(a1 + s)
                new = got[3 : 3 + s]
                last_p, last_h = step.p_logits[s - 1].clone(), step.draft_hidden[s - 1]
            else:  # nothing accepted: keep the correction token and pay an extra call for its state
                engine.crop(a1)
                new = [extra]
                step = engine.feed(extra_t)
                last_p, last_h = step.p_logits[0].clone(), step.draft_hidden[0]
            tested_from, tested = 0, min(s + 1, testable)
        before = len(out)
        done = _finish(out, new, cfg)
        stats.record_cycle(_clock(sync) - t0, s, len(out) - before, tested_from, tested)
    stats.close(out, prefill_out, engine)
    return out, stats


def fused_speculative_decode(
    engine: Engine,
    cycle: Callable[[Tensor, Tensor, int, int], tuple[Tensor, Tensor, Tensor]],
    window: int,
    prompt: Tensor,  # (P,)
    cfg: DecodeConfig,
    choose: Chooser,
    sync: Callable[[], None] | None = None,
) -> tuple[list[int], DecodeStats]:
    """The keep cycle with the whole cycle in one call (`FusedKeepCycle`, mtpc/speculative/fused_cycle.py:
    one CUDA graph on a GPU): cycle(h, c, start, budget) -> ([s, extra, testable count, *drafts], next
    h, next c) on the device; the host reads the first (the cycle's one host read), crops to a + 1 + s
    and applies the stop rule, as `speculative_decode`'s keep cycle does with the same statistics."""
    check_decode_window(window)
    if cfg.extra_token != "keep":
        raise ValueError(f"fused cycle: the keep cycle only (got extra_token={cfg.extra_token!r})")
    stats = DecodeStats(window=window, extra_token="keep")
    out: list[int] = []
    t0 = _clock(sync)
    step, c, done = _prefill(engine, prompt, cfg, choose, out)
    h = step.draft_hidden[-1]  # (d,) head input at the last byte with state
    stats.prefill_s = _clock(sync) - t0
    while not done:
        t0 = _clock(sync)
        a1 = engine.length  # a + 1 bytes have state
        info, h, c = cycle(h, c, a1, cfg.max_new_tokens - len(out) - 1)
        got = info.tolist()  # the cycle's one host read
        s, extra, testable = got[0], got[1], got[2]
        engine.crop(a1 + 1 + s)
        before = len(out)
        done = _finish(out, got[3 : 3 + s] + [extra], cfg)
        stats.record_cycle(_clock(sync) - t0, s, len(out) - before, 1, min(s + 1, testable))
    stats.close(out, 1, engine)
    return out, stats
