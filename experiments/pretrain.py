"""Pre-train the embedded default backbone: a small byte-level Llama on the ShareGPT training split.

`python -m experiments.pretrain [--config cpu|gpu|PATH] [--set KEY=VALUE] [--out DIR] [--force]
[--run-dir DIR] [--background] [--ship]` (= `make pretrain`) trains a transformers `LlamaForCausalLM`
(vocab 320, `ByteTokenizer`) on next-byte prediction over every byte of the packed, chat-templated
training chats, in a plain PyTorch loop: a main phase of `seq_len`-byte rows, then an optional final
phase of `final_seq_len`-byte rows that is also the learning-rate decay (warmup-stable-decay); it stops
at `max_steps` or `max_minutes` of active time (pauses by SIGSTOP do not count), or enters the final
phase early once the held-out gain per hour falls below `stop_gain_per_hour`. With `--run-dir` the whole
state is snapshotted there and a second start with the same config resumes it exactly; SIGTERM/SIGINT
snapshot and exit 128 + signal. `--background`: nice 19, registered as pausable background work, so the suite's
timers pause it (experiments/background.py). Reports held-out bits per byte and saves with
`save_pretrained` (safetensors, config, tokenizer files, `pretrain_metrics.json` with the loss and
held-out curves, hardware, command and git SHA) to `--out` (default `cache_dir()/models/pretrained`;
load it by that path). `--ship` then writes the repository's shipped form (`experiments.ship_default`,
which also ships a model trained earlier). Leaves out: MtPC heads and LoRA (experiments/train.py).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import random
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from experiments.config import CONFIG_DIR
from experiments.parsing import Fail, apply_overrides, parse_section, parse_sets, read_yaml
from mtpc.atomic import atomic_open
from mtpc.backbones import pretrained_model_dir
from mtpc.data import (
    STREAM_SUFFIX,
    heldout_split,
    load_messages,
    pack,
    pack_stream,
    read_stream,
    sharegpt_corpus,
)
from mtpc.losses import next_byte_nll
from mtpc.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, ByteTokenizer
from tracking.runs import git_sha, machine

CONFIGS = {"cpu": CONFIG_DIR / "pretrain_cpu.yaml", "gpu": CONFIG_DIR / "pretrain_gpu.yaml"}
METRICS_FILE = "pretrain_metrics.json"


@dataclass
class PretrainConfig:
    """One pre-training run; every field can be set in the YAML."""

    hidden_size: int = 512
    """d, the width of e_t (DESIGN D4: d >= 512 keeps an r = 8 head near the backbone's size)."""
    num_layers: int = 4
    """Decoder layers (LoRA depth k must not exceed it)."""
    num_heads: int = 8
    num_kv_heads: int = 2
    intermediate_size: int = 1024
    max_context: int = 4096
    """max_position_embeddings of the saved model (rotary; longer than seq_len)."""
    seq_len: int = 512
    """Bytes per training row in the main phase."""
    batch_size: int = 4
    final_seq_len: int | None = None
    """Rows of this length in the final phase (e.g. 2048: the context the evaluation uses); None:
    one phase. The final phase is also the learning-rate decay (warmup-stable-decay)."""
    final_batch_size: int | None = None
    """Rows per step in the final phase (None: batch_size)."""
    final_fraction: float = 0.15
    """Share of the budget (steps or active minutes) taken by the final phase / the decay."""
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    max_steps: int = 100_000
    max_minutes: float = 10.0
    """Budget of *active* minutes for the optimisation steps (evaluation and saving come on top):
    each step counts its wall time, clipped to 3x the running typical step, so a run paused with
    SIGSTOP (to time something else on the machine) does not spend its budget while stopped."""
    snapshot_minutes: float = 0.0
    """Every this many active minutes snapshot the whole run state to the run directory (0: only at
    the end and on SIGTERM/SIGINT; without a run directory: never)."""
    eval_minutes: float = 0.0
    """Every this many active minutes score the held-out slice (0: only at the end)."""
    stop_gain_per_hour: float = 0.0
    """Enter the final phase early once held-out bits per assistant byte improved by less than this
    over the last active hour (0: never; needs eval_minutes)."""
    log_every: int = 25
    """Steps between progress lines / loss-curve points."""
    train_data: str = "sharegpt"
    """'sharegpt' (the bundled corpus), a messages-format .json/.jsonl file / datasets name, or a
    `*.u8.xz` byte stream (`mtpc.data.write_stream`, what `experiments.device_prep` writes)."""
    heldout_data: str | None = None
    """Held-out conversations (or a `*.u8.xz` stream); None: the corpus's own held-out split
    (sharegpt) or the hash split."""
    heldout_rows: int = 32
    """Rows of held-out bytes (at final_seq_len, else seq_len) scored for the reported bits/byte; the
    evaluations along the way score the same bytes at the current phase's row length."""
    accelerator: str = "cpu"
    precision: str = "32-true"
    num_threads: int | None = None
    """torch threads; None = torch's default (one per core). A snapshot resumes only with the
    thread count it was written with (reductions split differently across threads)."""
    compile: bool = False
    """torch.compile the model for training (GPU; on the CPU it was not measured to help)."""
    seed: int = 0

    def validate(self, where: str = "config") -> None:
        def bad(key, why):
            raise ValueError(f"{where}: {key}={getattr(self, key)!r} {why}")

        for key in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "max_context",
                    "seq_len", "batch_size", "max_steps", "heldout_rows", "log_every"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                bad(key, "must be a positive int")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 2:
            bad("hidden_size", f"must split into num_heads={self.num_heads} heads of even size (rotary)")
        if self.num_heads % self.num_kv_heads:
            bad("num_kv_heads", f"must divide num_heads={self.num_heads}")
        if self.seq_len > self.max_context:
            bad("seq_len", f"exceeds max_context={self.max_context}")
        if not self.lr > 0 or not 0 <= self.min_lr_ratio <= 1:
            bad("lr", f"must be > 0 with min_lr_ratio in [0, 1] (got {self.min_lr_ratio})")
        if self.warmup_steps < 0 or self.weight_decay < 0:
            bad("warmup_steps", "and weight_decay must be >= 0")
        if not self.max_minutes > 0:
            bad("max_minutes", "must be > 0")
        if self.snapshot_minutes < 0:
            bad("snapshot_minutes", "must be >= 0 (0: no snapshots)")
        if self.accelerator not in ("cpu", "gpu", "cuda", "auto"):
            bad("accelerator", "must be one of cpu, gpu, cuda, auto")
        if self.precision not in ("32-true", "bf16-mixed"):
            bad("precision", "must be one of 32-true, bf16-mixed")
        if self.final_seq_len is not None and not (isinstance(self.final_seq_len, int) and 2 <= self.final_seq_len <= self.max_context):
            bad("final_seq_len", f"must be None or an int in [2, max_context={self.max_context}]")
        if self.final_batch_size is not None and not (isinstance(self.final_batch_size, int) and self.final_batch_size >= 1):
            bad("final_batch_size", "must be None or a positive int")
        if not 0 <= self.final_fraction < 1:
            bad("final_fraction", "must be in [0, 1)")
        if self.eval_minutes < 0 or self.stop_gain_per_hour < 0:
            bad("eval_minutes", f"and stop_gain_per_hour={self.stop_gain_per_hour} must be >= 0")
        if self.stop_gain_per_hour and not self.eval_minutes:
            bad("stop_gain_per_hour", "needs eval_minutes > 0 (the gain is measured on the held-out evaluations)")

    def llama_config(self) -> LlamaConfig:
        cfg = LlamaConfig(
            vocab_size=VOCAB_SIZE,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            max_position_embeddings=self.max_context,
            bos_token_id=BOS_ID,
            eos_token_id=EOS_ID,
            pad_token_id=PAD_ID,
            tie_word_embeddings=False,
        )
        cfg._attn_implementation = "sdpa"
        return cfg


def load_config(path: str | Path, **overrides) -> PretrainConfig:
    """Read a YAML into a validated `PretrainConfig` through the suite's config pieces
    (`experiments.parsing`: bounded YAML, the override rule, the typed section parser); errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"pretrain config {path}: no such file (shipped: {sorted(CONFIGS)})")
    raw = read_yaml(path, what="pretrain config") or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping of PretrainConfig fields")
    raw = apply_overrides(raw, overrides)
    known = {f.name for f in dataclasses.fields(PretrainConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:  # all of them in one message (parse_section stops at the first)
        raise ValueError(f"{path}: unknown key(s) {unknown}; expected some of {sorted(known)}")
    cfg = parse_section(PretrainConfig, raw, "", Fail(str(path)))
    cfg.validate(str(path))
    return cfg


# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------
def _conversations(cfg: PretrainConfig) -> tuple[list[dict], list[dict]]:
    if cfg.train_data.endswith(STREAM_SUFFIX):
        if cfg.heldout_data is None:
            raise ValueError(f"train_data={cfg.train_data!r} is a byte stream: set heldout_data too")
        return [], [] if cfg.heldout_data.endswith(STREAM_SUFFIX) else load_messages(cfg.heldout_data)
    train, heldout = heldout_split("sharegpt" if cfg.train_data == "sharegpt" else load_messages(cfg.train_data))
    if cfg.train_data != "sharegpt" and not heldout:
        heldout = train[-max(1, len(train) // 20):]
    if cfg.heldout_data is not None:
        heldout = [] if cfg.heldout_data.endswith(STREAM_SUFFIX) else load_messages(cfg.heldout_data)
    if not train or not (heldout or str(cfg.heldout_data).endswith(STREAM_SUFFIX)):
        raise ValueError(f"train_data={cfg.train_data!r}: need training and held-out conversations")
    return train, heldout


def _packed(source: str | None, convs: list[dict] | None, seq_len: int, max_rows: int, seed: int | None):
    """Rows of `source` if it is a byte stream, else of the conversations (shuffled by `seed`)."""
    if source is not None and source.endswith(STREAM_SUFFIX):
        return pack_stream(read_stream(source), seq_len, max_rows=max_rows)
    if seed is not None:
        random.Random(seed).shuffle(convs)
    return pack(convs, ByteTokenizer(), seq_len, max_rows=max_rows)


def summed_nll(model: LlamaForCausalLM, input_ids: torch.Tensor, doc_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed next-byte NLL (nats) over present targets (`mtpc.losses.next_byte_nll`) and their count."""
    nll, present = next_byte_nll(model(input_ids=input_ids).logits, input_ids, doc_ids)
    return nll.sum(), int(present.sum())


@torch.no_grad()
def heldout_bits_per_byte(model: LlamaForCausalLM, rows, batch_size: int = 8) -> dict[str, float]:
    """Bits per byte on held-out packed rows: all present targets, and assistant bytes only."""
    model.eval()
    device = next(model.parameters()).device
    tot = {"all": [0.0, 0], "assistant": [0.0, 0]}
    for i in range(0, len(rows), batch_size):
        ids = rows.input_ids[i : i + batch_size].to(device)
        doc = rows.doc_ids[i : i + batch_size].to(device)
        score = rows.score_mask[i : i + batch_size, 1:].to(device)
        nll, present = next_byte_nll(model(input_ids=ids).logits, ids, doc)  # (P,), (B, S-1)
        for name, m in (("all", torch.ones_like(nll, dtype=torch.bool)), ("assistant", score[present])):
            tot[name][0] += float(nll[m].sum())
            tot[name][1] += int(m.sum())
    return {
        "heldout_bits_per_byte": tot["all"][0] / max(tot["all"][1], 1) / math.log(2),
        "heldout_bits_per_assistant_byte": tot["assistant"][0] / max(tot["assistant"][1], 1) / math.log(2),
        "heldout_bytes_scored": tot["all"][1],
    }


# ---------------------------------------------------------------------------------------------
# the training loop (plain PyTorch: see docs/backbones.md "Pre-training speed" for why not Lightning)
# ---------------------------------------------------------------------------------------------
STATE_FILE = "state.pt"
"""The resumable snapshot inside a run directory: weights, optimiser, step, phase, curve, evaluations."""


class _Rows:
    """One phase's training rows and its seeded, resumable order: batch `i` of the phase is rows
    perm_e[b*B:(b+1)*B] with e = i // batches_per_epoch, perm_e = randperm(rows, seed + 1009 e);
    the last partial batch of an epoch is dropped (every row at most once per epoch)."""

    def __init__(self, rows, batch_size: int, seed: int):
        # compact copies (vocab 320 fits int16, per-row document numbers int32): the whole corpus stays in memory
        self.input_ids, self.doc_ids = rows.input_ids.to(torch.int16), rows.doc_ids.to(torch.int32)
        self.batch_size, self.seed, self.cut_documents = batch_size, seed, rows.cut_documents
        self.per_epoch = len(rows) // batch_size
        if self.per_epoch == 0:
            raise ValueError(f"fewer than batch_size={batch_size} training rows of {rows.input_ids.shape[1]} bytes")
        self._epoch, self._perm = -1, None

    def batch(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, b = divmod(i, self.per_epoch)
        if epoch != self._epoch:
            self._epoch = epoch
            self._perm = torch.randperm(len(self.input_ids), generator=torch.Generator().manual_seed(self.seed + 1009 * epoch))
        idx = self._perm[b * self.batch_size : (b + 1) * self.batch_size]
        return self.input_ids[idx].long(), self.doc_ids[idx].long()


def lr_factor(cfg: PretrainConfig, step: int, progress: float) -> float:
    """Warm-up, then constant, then a linear decay to `min_lr_ratio` over the final phase
    (warmup-stable-decay: the run's length need not be known while it is stable)."""
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    start = 1.0 - cfg.final_fraction
    if progress <= start or cfg.final_fraction == 0:
        return 1.0
    t = min(1.0, (progress - start) / cfg.final_fraction)
    return 1.0 - (1.0 - cfg.min_lr_ratio) * t


class _Clock:
    """Active seconds of the optimisation steps: each step counts its wall time clipped to 3x the
    running typical step, so SIGSTOP pauses (a benchmark timing something) do not spend the budget."""

    def __init__(self, seconds: float = 0.0):
        self.seconds, self._typical = seconds, None

    def add(self, dt: float) -> None:
        counted = dt if self._typical is None else min(dt, 3 * self._typical)
        self._typical = counted if self._typical is None else 0.9 * self._typical + 0.1 * counted
        self.seconds += counted


def _save_state(run_dir: Path, state: dict) -> None:
    """Atomic on the run directory's filesystem (mtpc.atomic: temporary beside it, fsync, rename)."""
    with atomic_open(run_dir / STATE_FILE) as f:
        torch.save(state, f)


def config_key(cfg: PretrainConfig) -> dict:
    """The fields a resumed run must share with its snapshot (the budget and the cadences may change)."""
    free = {"max_steps", "max_minutes", "snapshot_minutes", "log_every", "eval_minutes", "stop_gain_per_hour", "heldout_data"}
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in free}


def pretrain(cfg: PretrainConfig, out_dir: str | Path, run_dir: str | Path | None = None) -> dict:
    """Train, evaluate and save to `out_dir` (written whole or not at all); returns the metrics.

    With `run_dir` the run snapshots its whole state there (`state.pt`, every `snapshot_minutes`
    of active time and at the end) and resumes from it when started again with the same config:
    a run killed and resumed takes the same steps on the same rows as an uninterrupted one."""
    cfg.validate()
    out_dir = Path(out_dir)
    wall0 = time.monotonic()
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    torch.manual_seed(cfg.seed)
    cuda = cfg.accelerator in ("gpu", "cuda") or (cfg.accelerator == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu")
    train, heldout = _conversations(cfg)
    random.Random(cfg.seed).shuffle(train)
    phases = [(cfg.seq_len, cfg.batch_size)]
    if cfg.final_seq_len:
        phases.append((cfg.final_seq_len, cfg.final_batch_size or cfg.batch_size))
    budget_bytes = cfg.max_steps * max(b * s for s, b in phases)
    rows = [_Rows(_packed(cfg.train_data, train, s, -(-budget_bytes // s), None), b, cfg.seed + 7919 * p)
            for p, (s, b) in enumerate(phases)]
    # the reported slice at the final length; the same held-out bytes at each phase's row length for the
    # evaluations along the way (a model trained on 512-byte rows has not seen positions past 512: scored
    # at 2048 during the main phase it would look flat whatever it learns, and end the run early)
    final_len = cfg.final_seq_len or cfg.seq_len
    held = {s: heldout_rows(cfg, cfg.heldout_rows * final_len // s, s, heldout) for s, _ in phases}

    model = LlamaForCausalLM(cfg.llama_config()).to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay}, {"params": other, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95))
    state = {"step": 0, "phase": 0, "phase_start": 0, "active_seconds": 0.0, "budget_minutes": cfg.max_minutes,
             "curve": [], "evals": []}
    run_dir = Path(run_dir) if run_dir is not None else None
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        if (run_dir / STATE_FILE).is_file():
            snap = torch.load(run_dir / STATE_FILE, map_location=device, weights_only=True)
            if snap["config_key"] != config_key(cfg):
                diff = sorted(k for k in config_key(cfg) if snap["config_key"].get(k) != config_key(cfg)[k])
                raise ValueError(f"{run_dir / STATE_FILE}: a snapshot of another run (differs in {diff}); "
                                 f"use another run directory or the same config")
            if snap["num_threads"] != torch.get_num_threads():
                raise ValueError(f"{run_dir / STATE_FILE}: written with {snap['num_threads']} torch threads, now "
                                 f"{torch.get_num_threads()}; resume with the same num_threads")
            model.load_state_dict(snap["model"])
            opt.load_state_dict(snap["optimizer"])
            state = snap["state"]
            print(f"resumed {run_dir} at step {state['step']} ({state['active_seconds'] / 60:.1f} active minutes)", flush=True)
    compiled = torch.compile(model) if cfg.compile else model
    clock = _Clock(state["active_seconds"])
    autocast = cfg.precision == "bf16-mixed"

    def progress(step: int) -> float:
        return min(1.0, max(step / cfg.max_steps, clock.seconds / 60 / state["budget_minutes"]))

    def snapshot() -> None:
        if run_dir is not None:
            state["active_seconds"] = clock.seconds
            _save_state(run_dir, {"model": model.state_dict(), "optimizer": opt.state_dict(), "state": state,
                                  "config_key": config_key(cfg), "num_threads": torch.get_num_threads()})

    def evaluate() -> None:
        t = time.monotonic()
        seq = phases[state["phase"]][0]
        res = heldout_bits_per_byte(model, held[seq])
        model.train()
        state["evals"].append({"step": state["step"], "active_minutes": clock.seconds / 60,
                               "train_bytes": state.get("bytes", 0), "seq_len": seq, **res})
        print(f"step {state['step']}: held-out bits/byte {res['heldout_bits_per_byte']:.3f} "
              f"(assistant {res['heldout_bits_per_assistant_byte']:.3f}) at {seq}-byte rows, "
              f"{time.monotonic() - t:.0f} s", flush=True)

    def plateaued() -> bool:
        """Held-out assistant bits/byte gained < stop_gain_per_hour over the last active hour."""
        ev = [e for e in state["evals"] if e.get("seq_len") == state["evals"][-1].get("seq_len")]
        if not cfg.stop_gain_per_hour or len(ev) < 2 or ev[-1]["active_minutes"] < 60:
            return False
        past = [e for e in ev if e["active_minutes"] <= ev[-1]["active_minutes"] - 60]
        if not past:
            return False
        gain = past[-1]["heldout_bits_per_assistant_byte"] - ev[-1]["heldout_bits_per_assistant_byte"]
        hours = (ev[-1]["active_minutes"] - past[-1]["active_minutes"]) / 60
        return gain / hours < cfg.stop_gain_per_hour

    model.train()
    next_snapshot = clock.seconds + cfg.snapshot_minutes * 60 if cfg.snapshot_minutes else math.inf
    next_eval = (len(state["evals"]) + 1) * cfg.eval_minutes * 60 if cfg.eval_minutes else math.inf
    losses = state.setdefault("losses", [])  # train bits/byte since the last curve point (kept across resumes)
    stop_signal: list[int] = []
    old = {s: signal.signal(s, lambda n, f: stop_signal.append(n)) for s in (signal.SIGTERM, signal.SIGINT)
           if threading.current_thread() is threading.main_thread()}
    try:
        while progress(state["step"]) < 1.0 and not stop_signal:
            t0 = time.monotonic()
            if len(phases) > 1 and state["phase"] == 0 and progress(state["step"]) >= 1.0 - cfg.final_fraction:
                state["phase"], state["phase_start"] = 1, state["step"]
                print(f"step {state['step']}: final phase, {phases[1][1]} x {phases[1][0]} bytes", flush=True)
            seq, bsz = phases[state["phase"]]
            ids, doc = rows[state["phase"]].batch(state["step"] - state["phase_start"])
            ids, doc = ids.to(device), doc.to(device)
            for g in opt.param_groups:
                g["lr"] = cfg.lr * lr_factor(cfg, state["step"], progress(state["step"]))
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                nll, n = summed_nll(compiled, ids, doc)
            loss = nll / max(n, 1)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()) / math.log(2))
            state["step"] += 1
            state["bytes"] = state.get("bytes", 0) + seq * bsz
            clock.add(time.monotonic() - t0)
            step = state["step"]
            if step % cfg.log_every == 0 or progress(step) >= 1.0:
                point = {"step": step, "train_bytes": state["bytes"], "seq_len": seq,
                         "train_bits_per_byte": sum(losses) / len(losses), "lr": opt.param_groups[0]["lr"],
                         "active_minutes": clock.seconds / 60}
                losses.clear()
                state["curve"].append(point)
                print(f"step {step}: train bits/byte {point['train_bits_per_byte']:.3f}, "
                      f"{state['bytes'] / max(clock.seconds, 1e-9):,.0f} bytes/s, {progress(step):.0%} of budget", flush=True)
            if clock.seconds >= next_eval:
                next_eval += cfg.eval_minutes * 60
                evaluate()
                if state["phase"] == 0 and plateaued() and len(phases) > 1:
                    # enter the final phase now: the remaining budget is final_fraction of the whole
                    state["budget_minutes"] = clock.seconds / 60 / (1.0 - cfg.final_fraction)
                    print(f"step {step}: held-out gain < {cfg.stop_gain_per_hour} bits/byte per hour; "
                          f"finishing in {state['budget_minutes'] * cfg.final_fraction:.0f} active minutes", flush=True)
            if clock.seconds >= next_snapshot:
                next_snapshot += cfg.snapshot_minutes * 60
                snapshot()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    state["active_seconds"] = clock.seconds
    snapshot()
    if stop_signal:
        raise Interrupted(stop_signal[0], state["step"], run_dir)
    model = model.float()
    metrics = heldout_bits_per_byte(model, held[final_len])
    seen = state["bytes"]
    bytes_per_second = seen / max(clock.seconds, 1e-9)
    flops = model_flops_per_byte(model, cfg)
    peak = peak_flops()
    metrics.update(
        steps=state["step"],
        train_bytes_seen=seen,
        train_rows=sum(len(r.input_ids) for r in rows),
        train_documents_cut_at_row_ends=sum(r.cut_documents for r in rows),
        train_active_minutes=clock.seconds / 60,
        train_bytes_per_second=bytes_per_second,
        model_flops_per_byte=flops,
        train_flops_per_second=flops * bytes_per_second,
        mfu=None if peak is None else flops * bytes_per_second / peak,
        mfu_formula="MFU = (6 N + 12 L d S) * bytes/s / peak; N = parameters without the input embedding, "
                    "L layers, d width, S seq_len (PaLM, App. B); peak = bf16 dense of the GPU (H100/H200: 989 TFLOP/s)",
        total_minutes=(time.monotonic() - wall0) / 60,
        parameters=sum(p.numel() for p in model.parameters()),
        torch_threads=torch.get_num_threads(),
        hardware=machine(),
        command=" ".join(["python", "-m", "experiments.pretrain", *sys.argv[1:]]),
        git_sha=git_sha(),
        config=dataclasses.asdict(cfg),
        loss_curve=state["curve"],
        heldout_curve=state["evals"],
    )
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    ByteTokenizer().save_pretrained(tmp)
    (tmp / METRICS_FILE).write_text(json.dumps(metrics, indent=2) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return metrics


class Interrupted(RuntimeError):
    """SIGTERM / SIGINT stopped the run after its snapshot was written (exit code 128 + signal)."""

    def __init__(self, signum: int, step: int, run_dir: Path | None):
        where = f"; resume by running the same command (snapshot in {run_dir})" if run_dir else " (no run directory: nothing kept)"
        super().__init__(f"stopped by signal {signum} at step {step}{where}")
        self.signum = signum


def model_flops_per_byte(model: LlamaForCausalLM, cfg: PretrainConfig) -> float:
    """Training FLOPs per byte: 6 N (matmuls, forward + backward) + 12 L d S (attention scores and
    values; PaLM's count, causal masking not discounted). N excludes the input embedding."""
    n = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    return 6.0 * n + 12.0 * cfg.num_layers * cfg.hidden_size * cfg.seq_len


def peak_flops() -> float | None:
    """bf16 dense peak of the GPU in use (None on the CPU or an unknown GPU)."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    return 989e12 if ("H100" in name or "H200" in name) else None


def default_config() -> PretrainConfig:
    return load_config(CONFIGS["gpu" if torch.cuda.is_available() else "cpu"])


def heldout_rows(cfg: PretrainConfig, rows: int, seq_len: int = 2048, conversations: list[dict] | None = None):
    """The fixed held-out slice: the held-out conversations in corpus order, packed at `seq_len`."""
    if cfg.heldout_data is not None and cfg.heldout_data.endswith(STREAM_SUFFIX):
        return pack_stream(read_stream(cfg.heldout_data), seq_len, max_rows=rows)
    if conversations is not None:
        heldout = conversations
    elif cfg.heldout_data is not None:
        heldout = load_messages(cfg.heldout_data)
    elif cfg.train_data == "sharegpt":
        heldout = sharegpt_corpus(progress=False).heldout
    else:
        heldout = _conversations(cfg)[1]
    return pack(heldout, ByteTokenizer(), seq_len, max_rows=rows)


@contextlib.contextmanager
def background(on: bool, run_dir: str | None):
    """Lowest priority, registered as pausable background work (experiments.background), while `on`."""
    if not on:
        yield
        return
    from experiments.background import register

    os.nice(19)
    with register(run_dir, what="pre-training"):
        yield


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.pretrain", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="auto", help="cpu, gpu, auto (gpu if CUDA is available) or a YAML path")
    ap.add_argument("--out", default=None, help=f"output directory (default: {pretrained_model_dir()})")
    ap.add_argument("--force", action="store_true", help="retrain even if the output directory holds a model")
    ap.add_argument("--ship", action="store_true",
                    help="after training, write --out as a shipped default (bf16 shards, manifest, held-out score)")
    ap.add_argument("--ship-rows", type=int, default=1024, help="held-out rows of 2048 bytes scored when shipping")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field (YAML value)")
    ap.add_argument("--run-dir", default=None,
                    help="snapshot the whole run state here and resume from it when started again (same config)")
    ap.add_argument("--background", action="store_true",
                    help="run at the lowest CPU priority, registered as pausable background work, so the suite's "
                         "timers pause it (SIGSTOP/SIGCONT) while they time (experiments.background)")
    args = ap.parse_args(argv)
    from experiments.quiet import quiet

    quiet()
    try:
        overrides = parse_sets(args.set)
        name = ("gpu" if torch.cuda.is_available() else "cpu") if args.config == "auto" else args.config
        cfg = load_config(CONFIGS.get(name, name), **overrides)
    except ValueError as e:
        ap.error(str(e))
    out = Path(args.out) if args.out else pretrained_model_dir()
    if (out / "config.json").is_file() and not args.force:
        print(f"default model already at {out} (use --force to retrain)")
        metrics_path = out / METRICS_FILE
        if metrics_path.is_file():
            print(metrics_path.read_text())
        return 0
    from filelock import FileLock

    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out.parent / f"{out.name}.lock")), background(args.background, args.run_dir):
        try:
            metrics = pretrain(cfg, out, run_dir=args.run_dir)
        except Interrupted as e:
            print(f"experiments.pretrain: {e}", file=sys.stderr)
            return 128 + e.signum
        if args.ship:
            from experiments.ship_default import ship

            model = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
            metrics = ship(model, out, metrics, rows=args.ship_rows)
    print(json.dumps({k: v for k, v in metrics.items() if k not in ("config", "loss_curve")}, indent=2))
    print(f"saved to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
