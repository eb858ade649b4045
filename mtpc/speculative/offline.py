"""Offline acceptance: the keep cycle's counts from one teacher-forced pass, without decoding.

Speculative output is the plain model's output (greedy: the same bytes; sampling: the same
distribution), so given the plain continuation y of a prompt every keep cycle (DESIGN section 3:
state i, c = y_i emitted, draft [c, d_2..d_n] from theta = head(draft-top state before c), s
accepted, next state i + 1 + s) follows from quantities one teacher-forced pass over prompt + y
gives at every position at once:

- greedy: s = leading matches of greedy(theta_i, prefix=[y_i]) (the circuit's fused greedy
  draft, as the loop drafts) with y_{i+1}, y_{i+2}, ... Deterministic: the loop's cycles, cycle
  for cycle.
- sampling (temperature, top-p on p only): given y, the loop's acceptances are independent with
  P(s >= j | y) = prod_{w=1..j} min(1, q_w / p_w), q_w the circuit's conditional of y_{i+w} given
  y_i..y_{i+w-1} (from theta_i), p_w the tempered / top-p / EOS-banned verifier probability of
  y_{i+w}. The cycle starts form a Markov chain along y; expected cycles, accepted drafts,
  tests and acceptances per window position and the accepted-length histogram follow exactly by
  a forward pass over the states (the draft randomness integrated out: the loop's mean, less variance).

The loop's rules are mirrored: y_0 comes from the prefill (no cycle); a cycle at i tests at most
min(n - 1, budget - 1, T - 1 - i) drafts (budget = max_new_tokens - i - 1 bytes left; T - 1 - i:
an allowed EOS ends y, and the loop tests nothing past it); the generation ends when y's last
byte is emitted. `extra_token="drop"` is not exact and stays online-only (refused here).

API (one pass per prompt set, then a cheap call per head; heads compared on the same texts):

    cfg = DecodeConfig(max_new_tokens=256, mode="sample", temperature=1.0, top_p=1.0,
                       eos_id=backbone.eos_token_id, ban_eos=True)
    ys = continuations(backbone, prompts, cfg, seeds=[seed + i for i in range(len(prompts))])
    tf = teacher_force(backbone, prompts, ys, cfg)        # one pass (k = 0: every head; else one
                                                          # per LoRA top: the draft top's states)
    for head in heads:                                    # same lora_depth (and LoRA) as `backbone`
        per_prompt = offline_acceptance(tf, head)         # [OfflineStats] in prompt order
        metrics = pool_offline(per_prompt)                # mu_acc, tokens_per_cycle, cycles,
                                                          # generated, per_position_acceptance,
                                                          # accepted_length_histogram

`OfflineStats` carries the `GenerationStats` names that do not need a clock (mu_acc,
tokens_per_cycle, cycles, generated, decode_generated, tested_at, accepted_at,
per_position_acceptance, accepted_length_histogram); under sampling they are expectations
(floats). `continuations` decodes at batch 1 with `plain_decode` (prompt i with seeds[i], as
`MtpcModel.generate_plain(seed=...)`), or `batch_size` prompts at once on the compact Llama
forward (mtpc/backbones/llama_batch.py). The pass runs on the compact Llama forward when the
backbone has it (the loop's own engine, one sequence per call), else on the adapter's HF layers
in right-padded batches sorted by length.

Leaves out: timing (mu_lat and throughput come from the online loop on a subset), the loop itself
(loop.py), the acceptance rule's online form (acceptance.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

from mtpc.backbones.common import Backbone
from mtpc.names import check_decode_window, check_draft_len
from mtpc.speculative.acceptance import TorchChooser, greedy_target, stop_hits, target_probs
from mtpc.speculative.loop import DecodeConfig, plain_decode

__all__ = ["OfflineStats", "TeacherForced", "contradiction", "continuations", "decode_and_force", "fused_pass_applies",
           "offline_acceptance", "pool_offline", "teacher_force", "token_conditionals"]  # fmt: skip


@dataclass
class TeacherForced:
    """One teacher-forced pass over a prompt set's continuations (reused by every head evaluated on it).

    Per prompt with T continuation bytes: `hidden` (T - 1, d), the draft top's state at the byte
    before y_i for each cycle start i = 0..T-2 (the prompt's last byte for i = 0), the head's
    input; `log_p` (T,) log p(y_t) under cfg's temperature / top-p / ban (sampling; None when
    greedy); `argmax_agrees` (T,) whether y_t is the argmax of the pass's verifier row (greedy:
    False marks a near-tie that rounding decided differently, or a continuation that is not
    greedy; None when sampling).
    """

    cfg: DecodeConfig
    lora_depth: int
    prompts: list[Tensor]
    continuations: list[list[int]]
    hidden: list[Tensor]
    log_p: list[Tensor] | None
    argmax_agrees: list[Tensor] | None
    contradiction: str | None = None  # teacher_force(check=True): the first byte decoding would not choose


@dataclass
class OfflineStats:
    """One prompt's keep-cycle counts (exact for greedy, expectations given y for sampling).

    Window positions are 0-based as in `DecodeStats` (position 0 holds c and is never tested).
    """

    window: int
    mode: str
    cycles: float
    accepted: float  # accepted drafts, summed over cycles
    tested_at: list[float]  # (n,)
    accepted_at: list[float]  # (n,)
    accepted_length_histogram: list[float]  # (n+1,) cycles with s = 0..n
    generated: int  # bytes of the continuation (the prefill byte included)
    decode_generated: int  # bytes the cycles emitted (generated - 1)
    accepted_per_cycle: list[int] | None = None  # greedy: s of each cycle, in order
    extra_token: str = "keep"
    per_position_acceptance: list[float | None] = field(default_factory=list)  # (n,) None = never tested

    def __post_init__(self):
        if not self.per_position_acceptance:
            self.per_position_acceptance = [
                a / t if t > 0 else None for a, t in zip(self.accepted_at, self.tested_at, strict=True)
            ]

    @property
    def mu_acc(self) -> float:
        return self.accepted / self.cycles if self.cycles else 0.0

    @property
    def tokens_per_cycle(self) -> float:
        return self.decode_generated / self.cycles if self.cycles else 0.0

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"mu_acc": self.mu_acc, "tokens_per_cycle": self.tokens_per_cycle}


def _refuse_drop(cfg: DecodeConfig) -> None:
    if cfg.extra_token != "keep":
        raise ValueError(
            f"extra_token={cfg.extra_token!r}: offline acceptance mirrors the keep cycle only (drop is not "
            "exact, so the plain model's text does not determine its cycles); evaluate drop online"
        )


# ----------------------------------------------------------------------------- continuations


@torch.inference_mode()
def continuations(
    backbone: Backbone,
    prompts: list[Tensor],
    cfg: DecodeConfig,
    seeds: list[int] | None = None,
    batch_size: int = 1,
    slot_budget: int | None = None,
) -> list[list[int]]:
    """The plain model's continuation of each prompt (the verifier alone).

    slot_budget: at most this many key slots allocated a batch (default: `KV_BUDGET_BYTES` of them).
    seeds: one per prompt for sampling (prompt i draws from a generator seeded with seeds[i], as
    `MtpcModel.generate_plain(seed=seeds[i])`); ignored when greedy. batch_size: prompts decoded
    at once on the compact Llama forward (`LlamaBatchEngine`; equal to batch 1 in float64, near-ties
    may differ in float32); 1 (default) runs `plain_decode` per prompt, as `generate_plain` does.
    A backbone without the compact forward (EvaByte, engine="hf") decodes at batch 1 and warns.
    """
    import warnings

    from mtpc.backbones.engine import make_engine

    if cfg.mode == "sample" and (seeds is None or len(seeds) != len(prompts)):
        raise ValueError(f"seeds: sampling needs one seed per prompt ({len(prompts)}), got {seeds!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if batch_size > 1 and getattr(backbone, "engine", "hf") != "compact":
        warnings.warn(f"continuations: batch_size={batch_size} needs the compact Llama forward; this backbone "
                      f"decodes through {getattr(backbone, 'engine', 'hf')!r}: batch 1", stacklevel=2)  # fmt: skip
        batch_size = 1
    dev = backbone.device

    def chooser(i: int) -> TorchChooser:
        return _chooser(dev, seeds, i)

    if batch_size > 1:
        from mtpc.backbones.llama_batch import LlamaBatchEngine
        from mtpc.speculative.loop import plain_decode_batch

        engine = LlamaBatchEngine(backbone)
        out: list[list[int]] = [[] for _ in prompts]
        plan = _engine_plan(engine, prompts, batch_size, cfg.max_new_tokens, slot_budget)
        for groups in plan:
            rows = [i for g in groups for i in g]
            ys = plain_decode_batch(engine, [prompts[i].to(dev) for i in rows], cfg, [chooser(i) for i in rows],
                                    groups=[len(g) for g in groups])  # fmt: skip
            for i, y in zip(rows, ys, strict=True):
                out[i] = y
        return out
    out = []
    for i, prompt in enumerate(prompts):
        engine = make_engine(backbone, prompt.shape[0] + cfg.max_new_tokens + 1, draft=False)
        ids, _ = plain_decode(engine, prompt.to(dev), cfg, chooser(i))
        out.append(ids)
    return out


def _chooser(dev: Any, seeds: list[int] | None, i: int) -> TorchChooser:
    """Prompt i's sampler: a generator seeded with seeds[i] (unseeded when greedy: it is never drawn from)."""
    gen = torch.Generator(device=dev)
    if seeds is not None:
        gen.manual_seed(int(seeds[i]))
    return TorchChooser(gen)


# Memory for one batch's keys and values (`LlamaBatchEngine.kv_bytes_per_slot` a slot): the
# default model holds 6 KiB a slot in float32, so ~170 k slots (a 225-prompt set fits in one batch);
# a 3B byte Llama in bfloat16 ~114 KiB, ~9 k slots. `slot_budget` overrides it in slots.
KV_BUDGET_BYTES = 1 << 30
# Prompts a batch by default: on the 2-core Xeon 64 beat both 32 (one group a batch) and all 225 of
# a held-out set in one batch (docs/decoding.md, "Speed of the offline evaluation").
CONTINUATION_BATCH = 64
# On the CPU the rows of one batch are grouped by length: a group's slots (longest prompt + new
# bytes) are at most this factor of its shortest row's, so left padding stays under a fifth of the
# keys it reads. On a GPU one group a batch (each group is one more attention launch a layer; the
# H200 figures in docs/decoding.md were measured that way).
GROUP_SPREAD = 1.25


def _spread(engine: Any) -> float:
    return GROUP_SPREAD if engine.device.type == "cpu" else math.inf


def _slot_budget(engine: Any, slot_budget: int | None) -> int:
    return slot_budget if slot_budget is not None else max(1, KV_BUDGET_BYTES // engine.kv_bytes_per_slot)


def _length_batches(prompts: list[Tensor], batch_size: int, new_tokens: int = 0,
                    slot_budget: int | None = None, spread: float = GROUP_SPREAD) -> list[list[list[int]]]:  # fmt: skip
    """Prompt indices sorted by length (stable), as batches of groups: a batch runs its rows'
    products together (at most batch_size rows; with slot_budget, at most that many key slots
    allocated, sum over groups of rows x (longest + new_tokens)), a group attends over its own
    caches (`LlamaBatchEngine`), its longest prompt + new_tokens at most `spread` x its first's."""
    batches: list[list[list[int]]] = []
    slots = 0  # allocated in the current batch
    for i in sorted(range(len(prompts)), key=lambda i: prompts[i].shape[0]):
        width = prompts[i].shape[0] + new_tokens  # i is the longest yet: its group is padded to it
        if batches:
            batch, group = batches[-1], batches[-1][-1]
            joins = width <= spread * (prompts[group[0]].shape[0] + new_tokens)
            grown = slots - len(group) * (prompts[group[-1]].shape[0] + new_tokens) + (len(group) + 1) * width
            fits = sum(map(len, batch)) < batch_size and (
                slot_budget is None or (grown if joins else slots + width) <= slot_budget
            )
            if fits:
                if joins:
                    group.append(i)
                    slots = grown
                else:
                    batch.append([i])
                    slots += width
                continue
        batches.append([[i]])
        slots = width
    return batches


def _engine_plan(engine: Any, prompts: list[Tensor], batch_size: int, new_tokens: int,
                 slot_budget: int | None) -> list[list[list[int]]]:  # fmt: skip
    """`_length_batches` with this engine's defaults: its KV budget in slots and its device's group spread."""
    return _length_batches(
        prompts, batch_size, new_tokens, _slot_budget(engine, slot_budget), _spread(engine)
    )


def fused_pass_applies(backbone: Backbone, batch_size: int) -> bool:
    """Whether `decode_and_force` can serve this backbone: the compact Llama forward, no LoRA top
    (k = 0: the draft top's state is the verifier's final state, which plain decoding computes)."""
    return batch_size > 1 and getattr(backbone, "engine", "hf") == "compact" and backbone.lora_depth == 0


@torch.inference_mode()
def decode_and_force(
    backbone: Backbone,
    prompts: list[Tensor],
    cfg: DecodeConfig,
    seeds: list[int] | None = None,
    batch_size: int = CONTINUATION_BATCH,
    slot_budget: int | None = None,
) -> TeacherForced:
    """`continuations` and `teacher_force` in one: batched plain decoding (as `continuations` with
    this batch_size: the same bytes) that keeps, at every step, the verifier's final state (the
    head's input when k = 0) and p(y_t) from the very logits y_t was chosen from. No second pass
    over prompt + y: on this CPU that pass cost as much as the decoding. k = 0 on the compact
    forward only (`fused_pass_applies`); in float64 equal to `teacher_force` on the same texts
    (tests/mtpc/test_offline_acceptance.py), in float32 the batched products round differently,
    as batched decoding's near-ties do."""
    from mtpc.backbones.llama_batch import LlamaBatchEngine
    from mtpc.speculative.loop import plain_decode_batch

    _refuse_drop(cfg)
    if not fused_pass_applies(backbone, batch_size):
        raise ValueError("decode_and_force needs the compact Llama forward, lora_depth 0 and batch_size > 1 "
                         f"(got engine={getattr(backbone, 'engine', 'hf')!r}, lora_depth={backbone.lora_depth}, "
                         f"batch_size={batch_size}); use continuations + teacher_force")  # fmt: skip
    if cfg.mode == "sample" and (seeds is None or len(seeds) != len(prompts)):
        raise ValueError(f"seeds: sampling needs one seed per prompt ({len(prompts)}), got {seeds!r}")
    dev = backbone.device
    greedy = cfg.mode == "greedy"
    n = len(prompts)
    ys: list[list[int]] = [[] for _ in prompts]
    hidden: list[Tensor | None] = [None] * n
    scores: list[Tensor | None] = [None] * n  # greedy: argmax agrees; sampling: log p(y_t)
    engine = LlamaBatchEngine(backbone)
    plan = _engine_plan(engine, prompts, batch_size, cfg.max_new_tokens, slot_budget)
    for groups in plan:
        rows = [i for g in groups for i in g]
        states: list[Tensor] = []  # per step (B, d): the state before the byte chosen at that step
        marks: list[Tensor] = []  # per step (B,)

        def observe(
            logits: Tensor, picked: Tensor, states: list[Tensor] = states, marks: list[Tensor] = marks
        ) -> None:
            states.append(engine.hidden[:, -1].clone())
            if greedy:
                marks.append(greedy_target(logits, cfg.banned) == picked)
            else:
                p = target_probs(logits, cfg.temperature, cfg.top_p, cfg.banned)
                marks.append(p.gather(-1, picked.view(-1, 1))[:, 0].log())

        choosers = [_chooser(dev, seeds, i) for i in rows]
        out = plain_decode_batch(engine, [prompts[i].to(dev) for i in rows], cfg, choosers, observe=observe,
                                 groups=[len(g) for g in groups])  # fmt: skip
        st, mk = torch.stack(states, 1), torch.stack(marks, 1)  # (B, steps, d), (B, steps)
        for r, i in enumerate(rows):
            T = len(out[r])
            ys[i] = out[r]
            hidden[i] = st[r, : T - 1].clone()
            scores[i] = mk[r, :T].clone()
    return TeacherForced(
        cfg=cfg,
        lora_depth=0,
        prompts=[p.clone() for p in prompts],
        continuations=ys,
        hidden=hidden,  # type: ignore[arg-type]
        log_p=None if greedy else scores,  # type: ignore[arg-type]
        argmax_agrees=scores if greedy else None,  # type: ignore[arg-type]
    )


# ----------------------------------------------------------------------------- the pass


def _check_continuations(prompts: list[Tensor], ys: list[list[int]], cfg: DecodeConfig, vocab: int,
                         max_context: int) -> None:  # fmt: skip
    if len(prompts) != len(ys):
        raise ValueError(f"continuations: {len(ys)} for {len(prompts)} prompts")
    for b, (prompt, y) in enumerate(zip(prompts, ys, strict=True)):
        if prompt.dim() != 1 or prompt.numel() == 0 or prompt.dtype.is_floating_point:
            raise ValueError(f"prompts[{b}]: expected a non-empty 1-D integer tensor, got {prompt.dtype} "
                             f"{tuple(prompt.shape)}")  # fmt: skip
        if not 1 <= len(y) <= cfg.max_new_tokens:
            raise ValueError(
                f"continuations[{b}]: {len(y)} bytes; expected 1..max_new_tokens={cfg.max_new_tokens}"
            )
        if min(y) < 0 or max(y) >= vocab:
            raise ValueError(f"continuations[{b}]: ids must lie in [0, {vocab})")
        stops = stop_hits(torch.tensor(y), cfg.stop_ids).nonzero().flatten().tolist()
        if stops and stops[0] != len(y) - 1:
            raise ValueError(f"continuations[{b}]: the stop id {y[stops[0]]} at byte {stops[0]} is not the last "
                             f"byte ({len(y)}); decoding ends there")  # fmt: skip
        if len(y) < cfg.max_new_tokens and not stops:
            raise ValueError(f"continuations[{b}]: {len(y)} < max_new_tokens={cfg.max_new_tokens} bytes and no "
                             f"stop id at the end: not a finished generation under this config")  # fmt: skip
        if prompt.shape[0] + len(y) > max_context:
            raise ValueError(f"continuations[{b}]: prompt ({prompt.shape[0]}) + {len(y)} bytes exceed the "
                             f"backbone's max_context={max_context}")  # fmt: skip


def _passes(backbone: Backbone, seqs: list[Tensor], batch_size: int):
    """Yield (index, verifier logits (S, v), draft hidden (S, d)) per sequence: on the compact Llama forward one sequence per call (the loop's own engine: no
    padding, its products and rounding), else the adapter's HF layers on right-padded batches
    sorted by length (causal attention never reads the padding)."""
    if getattr(backbone, "engine", "hf") == "compact":
        from mtpc.backbones.engine import make_engine

        engine = make_engine(backbone, max(s.shape[0] for s in seqs), draft=backbone.lora_depth > 0)
        for b, seq in enumerate(seqs):
            engine.reset(seq.shape[0])
            step = engine.feed(seq)
            yield b, step.p_logits, step.draft_hidden
        return
    order = sorted(range(len(seqs)), key=lambda b: seqs[b].shape[0])
    for start in range(0, len(seqs), batch_size):
        rows = order[start : start + batch_size]
        ids = torch.zeros(
            len(rows), max(seqs[b].shape[0] for b in rows), dtype=torch.long, device=seqs[0].device
        )
        for r, b in enumerate(rows):
            ids[r, : seqs[b].shape[0]] = seqs[b]
        out = backbone(ids)
        for r, b in enumerate(rows):
            yield b, backbone.stp_logits(out.verify_hidden[r]), out.draft_hidden[r]


# How far a cached byte may score below its row's choice and still count as that choice: the check's
# pass rounds its products otherwise than the decoding did (float32 near-ties; bf16 far more), so a
# byte within this share of the row's largest |logit| (+1) is accepted. A rewritten text misses by more.
NEAR_TIE = {torch.float64: 1e-9, torch.float32: 1e-3}
NEAR_TIE_LOW = 5e-2  # float16 / bfloat16 logits


@torch.inference_mode()
def contradiction(backbone: Backbone, prompts: list[Tensor], continuations: list[list[int]], cfg: DecodeConfig,
                  seeds: list[int] | None = None, batch_size: int = 8) -> str | None:  # fmt: skip
    """Whether these can be the plain model's continuations, from one verifier pass over prompt + y:
    None when every byte is the one decoding would choose there, else where the first one is not.

    Greedy: y_t must be the argmax of its row (after the ban), within `NEAR_TIE`. Sampling: y_t must
    be the draw of prompt i's generator seeded with seeds[i] (`TorchChooser`: the race
    `torch.multinomial` runs, one draw per byte, argmax p / q with q ~ Exp(1) from the generator;
    the check replays q and accepts y_t when its p / q is the row's largest within `NEAR_TIE`, over temperature). A
    continuation the config cannot produce at all (ids outside the vocabulary, too long, bytes after
    a stop id, unfinished) is reported the same way. Costs one pass: `teacher_force(..., seeds,
    check=True)` does the same check on the pass it computes anyway (`TeacherForced.contradiction`).
    """
    try:
        _check_continuations(prompts, continuations, cfg, backbone.vocab_size, backbone.max_context)
    except ValueError as e:
        return str(e)
    _check_seeds(cfg, seeds, len(prompts))
    dev = backbone.device
    for b, all_logits, _ in _passes(backbone, _forced_inputs(prompts, continuations, dev), batch_size):
        L, T = prompts[b].shape[0], len(continuations[b])
        why = _contradicted(all_logits[L - 1 : L + T - 1], continuations[b], cfg, seeds, b)
        if why is not None:
            return why
    return None


def _check_seeds(cfg: DecodeConfig, seeds: list[int] | None, n: int) -> None:
    if cfg.mode == "sample" and (seeds is None or len(seeds) != n):
        raise ValueError(f"seeds: sampling needs one seed per prompt ({n}), got {seeds!r}")


def _forced_inputs(prompts: list[Tensor], continuations: list[list[int]], dev: Any) -> list[Tensor]:
    """prompt + y without y's last byte (it needs no state) per prompt, on `dev`."""
    return [torch.cat([p.to(dev, torch.long), torch.tensor(y[:-1], dtype=torch.long, device=dev)])
            for p, y in zip(prompts, continuations, strict=True)]  # fmt: skip


def _contradicted(
    logits: Tensor, ys: list[int], cfg: DecodeConfig, seeds: list[int] | None, b: int
) -> str | None:
    """The first byte of prompt b's continuation `ys` that its verifier rows `logits` (T, v) contradict
    (`contradiction`), or None."""
    sample = cfg.mode == "sample"
    y = torch.tensor(ys, dtype=torch.long, device=logits.device).unsqueeze(-1)  # (T, 1)
    tol = NEAR_TIE.get(logits.dtype, NEAR_TIE_LOW) * (1 + logits.double().abs().amax(-1))  # (T,)
    if sample:
        p = target_probs(logits, cfg.temperature, cfg.top_p, cfg.banned)  # (T, v) as the chooser saw them
        gen = torch.Generator(device=logits.device)
        gen.manual_seed(int(seeds[b]))  # type: ignore[index]
        q = torch.stack([torch.empty_like(p[t]).exponential_(1, generator=gen) for t in range(len(ys))])
        score, tol = p.double().log() - q.double().log(), tol / cfg.temperature  # (T, v) log p / q
    else:
        score = logits.double()
        if cfg.banned is not None:
            score[:, cfg.banned] = float("-inf")
    gap = score.amax(-1) - score.gather(-1, y)[:, 0]  # (T,) inf for a byte of probability 0
    bad = (gap > tol).nonzero().flatten()
    if not bad.numel():
        return None
    t = int(bad[0])
    what = f"seed {int(seeds[b])}'s draw" if sample else "the greedy choice"  # type: ignore[index]
    return f"prompt {b}, byte {t}: id {ys[t]} is not {what} (scores {float(gap[t]):.3g} below it)"


@torch.inference_mode()
def teacher_force(
    backbone: Backbone,
    prompts: list[Tensor],
    continuations: list[list[int]],
    cfg: DecodeConfig,
    batch_size: int = 8,
    seeds: list[int] | None = None,
    check: bool = False,
) -> TeacherForced:
    """One forward pass (trunk, verifier top, draft top) over every prompt + continuation.

    check: also check on this pass that every byte is the one plain decoding (with `seeds` when
    sampling) chooses there, as `contradiction` does; the first one that is not goes to
    `TeacherForced.contradiction` (None: all are).

    On the compact Llama forward (the loop's engine) one sequence per call; else the adapter's
    HF layers, batch_size sequences per call (sorted by length, right-padded: causal attention
    never reads the padding). Raises ValueError for a continuation the config could not have produced
    (too long, unfinished, bytes after a stop id, a byte of probability 0 when sampling).
    """
    _refuse_drop(cfg)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    _check_continuations(prompts, continuations, cfg, backbone.vocab_size, backbone.max_context)
    if check:
        _check_seeds(cfg, seeds, len(prompts))
    dev = backbone.device
    n_prompts = len(prompts)
    hidden: list[Tensor | None] = [None] * n_prompts
    log_p: list[Tensor | None] = [None] * n_prompts
    agrees: list[Tensor | None] = [None] * n_prompts
    found: dict[int, str] = {}  # prompt -> its first contradicted byte (check)
    for b, all_logits, draft_hidden in _passes(
        backbone, _forced_inputs(prompts, continuations, dev), batch_size
    ):
        L, T = prompts[b].shape[0], len(continuations[b])
        hidden[b] = draft_hidden[L - 1 : L + T - 2].clone()  # (T-1, d)
        logits = all_logits[L - 1 : L + T - 1]  # (T, v): the rows for y_0..y_{T-1}
        if check and (why := _contradicted(logits, continuations[b], cfg, seeds, b)) is not None:
            found[b] = why
        y = torch.tensor(continuations[b], dtype=torch.long, device=dev)
        if cfg.mode == "greedy":
            agrees[b] = greedy_target(logits, cfg.banned) == y
        else:
            p = target_probs(logits, cfg.temperature, cfg.top_p, cfg.banned)
            p = p.gather(-1, y.unsqueeze(-1))[:, 0]  # (T,) p(y_t)
            if bool((p <= 0).any()) and b not in found:  # (check: reported, not raised)
                t = int((p <= 0).nonzero()[0])
                raise ValueError(
                    f"continuations[{b}]: byte {t} (id {int(y[t])}) has probability 0 under temperature="
                    f"{cfg.temperature}, top_p={cfg.top_p}, ban_eos={cfg.ban_eos}: not sampled with this config"
                )
            log_p[b] = p.log()
    greedy = cfg.mode == "greedy"
    return TeacherForced(
        cfg=cfg,
        lora_depth=backbone.lora_depth,
        prompts=[p.clone() for p in prompts],
        continuations=[list(y) for y in continuations],
        hidden=hidden,  # type: ignore[arg-type]
        log_p=None if greedy else log_p,  # type: ignore[arg-type]
        argmax_agrees=agrees if greedy else None,  # type: ignore[arg-type]
        contradiction=found[min(found)] if found else None,
    )


# ----------------------------------------------------------------------------- per head


def token_conditionals(circuit: Any, q: dict[str, Tensor], x: Tensor) -> Tensor:  # (..., n) -> (..., n)
    """log q(x_i | x_<i) at the given tokens: `circuit._conditionals(q, x)` gathered at x, without
    forming the (..., n, v) rows (from the circuit's leaf context: logsumexp of the state posterior
    plus the leaf scores of x). q normalised, as `circuit.normalize` returns it."""
    w, _, scores = circuit._leaf_context(q, x)
    return torch.logsumexp(w.log_softmax(-1) + scores, dim=-1)


def _windows(y: Tensor, n: int) -> Tensor:  # (T,) -> (T-1, n): row i = y_i..y_{i+n-1}, 0 past the end
    T = y.shape[0]
    padded = torch.cat([y, y.new_zeros(n)])
    return padded.unfold(0, n, 1)[: T - 1]


def _caps(T: int, max_new_tokens: int, n: int, device) -> Tensor:  # -> (T-1,)
    """Drafts the cycle at each start i may test, as the loop's `testable_drafts`: n - 1, the
    budget's max_new_tokens - i - 2 (it emits s + 1 bytes), and T - 1 - i (y ends there: at the
    budget, or at an allowed EOS, past which the loop tests nothing)."""
    i = torch.arange(T - 1, device=device)
    return torch.minimum(torch.minimum(max_new_tokens - 2 - i, T - 1 - i), torch.full_like(i, n - 1))


def _alphas(tf: TeacherForced, head: Any, chunk: int) -> list[tuple[Tensor, Tensor]]:
    """Per prompt (alpha (T-1, n-1) float64, cap (T-1,)): alpha[i, w-1] is the probability that the
    cycle starting at i accepts its w-th draft given it accepted the ones before (greedy: 0 or 1),
    0 past the cycle's last test; cap[i] the number of drafts it may test."""
    circuit, n = head.circuit, head.config.window
    cfg, greedy = tf.cfg, tf.cfg.mode == "greedy"
    dev = next(head.parameters()).device
    ys = [torch.tensor(y, dtype=torch.long, device=dev) for y in tf.continuations]
    starts = [b for b, y in enumerate(ys) if y.shape[0] >= 2]
    if not starts:
        return [(torch.zeros(0, n - 1, dtype=torch.float64), torch.zeros(0, dtype=torch.long)) for _ in ys]
    win = torch.cat([_windows(ys[b], n) for b in starts])  # (N, n)
    h = torch.cat([tf.hidden[b].to(dev) for b in starts])  # (N, d)
    cap = torch.cat([_caps(ys[b].shape[0], cfg.max_new_tokens, n, dev) for b in starts])  # (N,)
    if not greedy:  # log p of the drafts each window tests: row i = log p(y_{i+1}..y_{i+n-1})
        lp = torch.cat([_windows(tf.log_p[b].to(dev, torch.float64), n)[:, 1:] for b in starts])  # (N, n-1)
    out = torch.empty(win.shape[0], n - 1, dtype=torch.float64, device=dev)
    for lo in range(0, win.shape[0], chunk):
        sl = slice(lo, lo + chunk)
        theta = circuit.normalize(head(h[sl], win[sl, 0]))  # c = y_i, the cycle's known byte
        if greedy:
            x, _ = circuit._draft(theta, win[sl, :1], greedy=True, conditionals=False)  # (c, n)
            out[sl] = (x[:, 1:] == win[sl, 1:]).to(torch.float64)
        else:
            log_q = token_conditionals(circuit, theta, win[sl])[:, 1:].to(torch.float64)  # (c, n-1)
            # min(1, q / p); a row after a byte of q = 0 is undefined (NaN) and never reached: 0
            out[sl] = torch.exp(torch.clamp(log_q - lp[sl], max=0.0)).nan_to_num(nan=0.0)
    out = torch.where(torch.arange(n - 1, device=dev) < cap.unsqueeze(-1), out, torch.zeros_like(out))
    split = iter(out.cpu().split([ys[b].shape[0] - 1 for b in starts]))
    caps = iter(cap.cpu().split([ys[b].shape[0] - 1 for b in starts]))
    result, caps_out = [], []
    for y in ys:
        if y.shape[0] >= 2:
            result.append(next(split))
            caps_out.append(next(caps))
        else:
            result.append(torch.zeros(0, n - 1, dtype=torch.float64))
            caps_out.append(torch.zeros(0, dtype=torch.long))
    return list(zip(result, caps_out, strict=True))


def _chain(alpha: Tensor, cap: Tensor, n: int) -> dict[str, Any]:
    """The Markov chain of cycle starts along one continuation: alpha (starts, n-1), cap (starts,)
    with starts = T - 1 possible cycle starts -> expected counts (exact 0/1 paths when alpha is 0/1)."""
    import numpy as np

    a = alpha.numpy()
    starts, m = a.shape
    surv = np.concatenate([np.ones((starts, 1)), np.cumprod(a, -1)], -1)  # (starts, m+1) P(s >= k)
    p_s = surv - np.concatenate([surv[:, 1:], np.zeros((starts, 1))], -1)  # (starts, m+1) P(s = k)
    visit = np.zeros(starts + m + 1)
    visit[0] = 1.0 if starts else 0.0
    for i in range(starts):  # a cycle at i moves to i + 1 + s; states >= T - 1 end the generation
        if visit[i] != 0.0:
            visit[i + 1 : i + m + 2] += visit[i] * p_s[i]
    v = visit[:starts, None]
    tested_mask = (
        np.arange(1, m + 1)[None, :] <= cap.numpy()[:, None]
    )  # window position w tested iff w <= cap
    tested = (v * surv[:, :m] * tested_mask).sum(0)  # position w: tested when s >= w - 1
    acc_at = (v * surv[:, 1:]).sum(0)  # position w: accepted when s >= w
    hist = (v * p_s).sum(0)
    return {
        "cycles": float(v.sum()),
        "accepted": float(acc_at.sum()),
        "tested_at": [0.0, *tested.tolist()],
        "accepted_at": [0.0, *acc_at.tolist()],
        "accepted_length_histogram": [*hist.tolist(), 0.0],  # s = 0..n-1 (and n, reached by drop only)
    }


def _greedy_path(alpha: Tensor) -> list[int]:
    """s of each cycle along the deterministic path (alpha 0/1)."""
    out, i = [], 0
    lead = torch.cumprod(alpha, -1).sum(-1).round().long().tolist()  # leading acceptances per start
    while i < alpha.shape[0]:
        out.append(lead[i])
        i += 1 + lead[i]
    return out


@torch.inference_mode()
def offline_acceptance(
    tf: TeacherForced, head: Any, chunk: int = 2048, draft_len: int | None = None
) -> list[OfflineStats]:
    """Per prompt (in order) the keep cycle's counts for `head` on the pass's continuations.

    head: an `MtpcHead` with the pass's lora_depth (its LoRA must be the one the pass ran with);
    chunk: cycle starts per head call (bounds the (chunk, n, r, v) leaves in memory);
    draft_len: bytes each cycle feeds (None: the head's window n), as `MtpcModel.generate`'s: the
    window's first draft_len positions, the rest never tested.
    """
    _refuse_drop(tf.cfg)
    cfg_h = head.config
    if cfg_h.lora_depth != tf.lora_depth:
        raise ValueError(f"head: lora_depth={cfg_h.lora_depth}, but the pass ran with lora_depth={tf.lora_depth} "
                         "(one pass per LoRA top)")  # fmt: skip
    check_decode_window(cfg_h.window, "head: speculative decoding")
    if tf.hidden and tf.hidden[0].shape[-1] != cfg_h.hidden:
        raise ValueError(f"head: hidden={cfg_h.hidden}, but the pass's states have {tf.hidden[0].shape[-1]}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    n, greedy = cfg_h.window, tf.cfg.mode == "greedy"
    n = check_draft_len(draft_len, n)
    stats = []
    for y, (alpha, cap) in zip(tf.continuations, _alphas(tf, head, chunk), strict=True):
        alpha, cap = alpha[:, : n - 1], cap.clamp(max=n - 1)  # the drafts a cycle feeds
        c = _chain(alpha, cap, n)
        stats.append(OfflineStats(window=n, mode=tf.cfg.mode, generated=len(y), decode_generated=len(y) - 1,
                                  accepted_per_cycle=_greedy_path(alpha) if greedy else None, **c))  # fmt: skip
    return stats


def pool_offline(stats: list[OfflineStats]) -> dict[str, Any]:
    """One prompt set's acceptance metrics under the evaluation's names (ratios of sums over prompts,
    as the online pooling): mu_acc, tokens_per_cycle, cycles, generated, decode_generated,
    per_position_acceptance, accepted_length_histogram (expected counts under sampling)."""
    if not stats:
        raise ValueError("stats: need at least one prompt")
    n = stats[0].window
    cycles = sum(s.cycles for s in stats)
    tested = [sum(s.tested_at[i] for s in stats) for i in range(n)]
    accepted = [sum(s.accepted_at[i] for s in stats) for i in range(n)]
    return {
        "mu_acc": sum(s.accepted for s in stats) / cycles if cycles else float("nan"),
        "tokens_per_cycle": sum(s.decode_generated for s in stats) / cycles if cycles else float("nan"),
        "cycles": cycles,
        "generated": sum(s.generated for s in stats),
        "decode_generated": sum(s.decode_generated for s in stats),
        "per_position_acceptance": [a / t if t > 0 else None for a, t in zip(accepted, tested, strict=True)],
        "accepted_length_histogram": [
            sum(s.accepted_length_histogram[k] for s in stats) for k in range(n + 1)
        ],
    }
