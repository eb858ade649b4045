"""Pre-training's loop: `pretrain(cfg, out_dir, run_dir)` trains a transformers `LlamaForCausalLM`
(vocab 320) on next-byte prediction in a plain PyTorch loop (see docs/backbones.md "Pre-training
speed" for why not Lightning): a main phase of `seq_len`-byte rows, then an optional final phase of
`final_seq_len`-byte rows that is also the learning-rate decay (warmup-stable-decay); it stops at
`max_steps` or `max_minutes` of active time (`Clock`: SIGSTOP pauses do not count), or enters the
final phase early once the held-out gain per hour falls below `stop_gain_per_hour`. SIGTERM/SIGINT
snapshot and raise `Interrupted`. Leaves out: the settings (config.py), the rows and the held-out
score (data.py), the snapshot and output files (files.py), the command line (experiments/pretrain.py).
"""

from __future__ import annotations

import dataclasses
import math
import random
import signal
import sys
import threading
import time
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from experiments.pretraining.config import PretrainConfig
from experiments.pretraining.data import (
    TrainRows,
    heldout_bits_per_byte,
    heldout_rows,
    packed,
    split_conversations,
    summed_nll,
)
from experiments.pretraining.files import config_key, load_snapshot, save_output, save_snapshot
from tracking.runs import git_sha, machine


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


class Clock:
    """Active seconds of the optimisation steps: each step counts its wall time clipped to 3x the
    running typical step, so SIGSTOP pauses (a benchmark timing something) do not spend the budget."""

    def __init__(self, seconds: float = 0.0):
        self.seconds, self._typical = seconds, None

    def add(self, dt: float) -> None:
        counted = dt if self._typical is None else min(dt, 3 * self._typical)
        self._typical = counted if self._typical is None else 0.9 * self._typical + 0.1 * counted
        self.seconds += counted


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
    train, heldout = split_conversations(cfg.train_data, cfg.heldout_data)
    random.Random(cfg.seed).shuffle(train)
    phases = [(cfg.seq_len, cfg.batch_size)]
    if cfg.final_seq_len:
        phases.append((cfg.final_seq_len, cfg.final_batch_size or cfg.batch_size))
    budget_bytes = cfg.max_steps * max(b * s for s, b in phases)
    rows = [
        TrainRows(packed(cfg.train_data, train, s, -(-budget_bytes // s), None), b, cfg.seed + 7919 * p)
        for p, (s, b) in enumerate(phases)
    ]
    # the reported slice at the final length; the same held-out bytes at each phase's row length for the
    # evaluations along the way (a model trained on 512-byte rows has not seen positions past 512: scored
    # at 2048 during the main phase it would look flat whatever it learns, and end the run early)
    final_len = cfg.final_seq_len or cfg.seq_len
    held = {
        s: heldout_rows(
            cfg.heldout_rows * final_len // s,
            s,
            train_data=cfg.train_data,
            heldout_data=cfg.heldout_data,
            conversations=heldout,
        )
        for s, _ in phases
    }

    model = LlamaForCausalLM(cfg.llama_config()).to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": other, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    state = {
        "step": 0,
        "phase": 0,
        "phase_start": 0,
        "active_seconds": 0.0,
        "budget_minutes": cfg.max_minutes,
        "curve": [],
        "evals": [],
    }
    run_dir = Path(run_dir) if run_dir is not None else None
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        snap = load_snapshot(run_dir, cfg, device)
        if snap is not None:
            model.load_state_dict(snap["model"])
            opt.load_state_dict(snap["optimizer"])
            state = snap["state"]
            print(
                f"resumed {run_dir} at step {state['step']} ({state['active_seconds'] / 60:.1f} active minutes)",
                flush=True,
            )
    compiled = torch.compile(model) if cfg.compile else model
    clock = Clock(state["active_seconds"])
    autocast = cfg.precision == "bf16-mixed"

    def progress(step: int) -> float:
        return min(1.0, max(step / cfg.max_steps, clock.seconds / 60 / state["budget_minutes"]))

    def snapshot() -> None:
        if run_dir is not None:
            state["active_seconds"] = clock.seconds
            save_snapshot(
                run_dir,
                {
                    "model": model.state_dict(),
                    "optimizer": opt.state_dict(),
                    "state": state,
                    "config_key": config_key(cfg),
                    "num_threads": torch.get_num_threads(),
                },
            )

    def evaluate() -> None:
        t = time.monotonic()
        seq = phases[state["phase"]][0]
        res = heldout_bits_per_byte(model, held[seq])
        model.train()
        state["evals"].append(
            {
                "step": state["step"],
                "active_minutes": clock.seconds / 60,
                "train_bytes": state.get("bytes", 0),
                "seq_len": seq,
                **res,
            }
        )
        print(
            f"step {state['step']}: held-out bits/byte {res['heldout_bits_per_byte']:.3f} "
            f"(assistant {res['heldout_bits_per_assistant_byte']:.3f}) at {seq}-byte rows, "
            f"{time.monotonic() - t:.0f} s",
            flush=True,
        )

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
    losses = state.setdefault(
        "losses", []
    )  # train bits/byte since the last curve point (kept across resumes)
    stop_signal: list[int] = []
    old = {
        s: signal.signal(s, lambda n, f: stop_signal.append(n))
        for s in (signal.SIGTERM, signal.SIGINT)
        if threading.current_thread() is threading.main_thread()
    }
    try:
        while progress(state["step"]) < 1.0 and not stop_signal:
            t0 = time.monotonic()
            if (
                len(phases) > 1
                and state["phase"] == 0
                and progress(state["step"]) >= 1.0 - cfg.final_fraction
            ):
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
                point = {
                    "step": step,
                    "train_bytes": state["bytes"],
                    "seq_len": seq,
                    "train_bits_per_byte": sum(losses) / len(losses),
                    "lr": opt.param_groups[0]["lr"],
                    "active_minutes": clock.seconds / 60,
                }
                losses.clear()
                state["curve"].append(point)
                print(
                    f"step {step}: train bits/byte {point['train_bits_per_byte']:.3f}, "
                    f"{state['bytes'] / max(clock.seconds, 1e-9):,.0f} bytes/s, {progress(step):.0%} of budget",
                    flush=True,
                )
            if clock.seconds >= next_eval:
                next_eval += cfg.eval_minutes * 60
                evaluate()
                if state["phase"] == 0 and plateaued() and len(phases) > 1:
                    # enter the final phase now: the remaining budget is final_fraction of the whole
                    state["budget_minutes"] = clock.seconds / 60 / (1.0 - cfg.final_fraction)
                    print(
                        f"step {step}: held-out gain < {cfg.stop_gain_per_hour} bits/byte per hour; "
                        f"finishing in {state['budget_minutes'] * cfg.final_fraction:.0f} active minutes",
                        flush=True,
                    )
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
    save_output(model, out_dir, metrics)
    return metrics


class Interrupted(RuntimeError):
    """SIGTERM / SIGINT stopped the run after its snapshot was written (exit code 128 + signal)."""

    def __init__(self, signum: int, step: int, run_dir: Path | None):
        where = (
            f"; resume by running the same command (snapshot in {run_dir})"
            if run_dir
            else " (no run directory: nothing kept)"
        )
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
