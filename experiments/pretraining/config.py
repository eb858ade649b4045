"""Pre-training's settings: `PretrainConfig`, its checks and `load_config` (the shipped YAMLs in `CONFIGS`).

Every check fails through `experiments.plumbing.parsing.Fail`: one line `<file>: <key>: what; expected`.
Leaves out: the data, the loop and the files a run writes (the sibling modules).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from transformers import LlamaConfig

from experiments.plumbing.parsing import CONFIG_DIR, Fail, apply_overrides, parse_section, read_yaml
from mtpc.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE

CONFIGS = {"cpu": CONFIG_DIR / "pretrain_cpu.yaml", "gpu": CONFIG_DIR / "pretrain_gpu.yaml"}
POSITIVE_INTS = (
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "intermediate_size",
    "max_context",
    "seq_len",
    "batch_size",
    "max_steps",
    "heldout_rows",
    "log_every",
)


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
    `*.u8.xz` byte stream (`mtpc.data.write_stream`, what `experiments.shipping.device_prep` writes)."""
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
        """ValueError `<where>: <key>: what; expected` for the first field out of bounds."""
        check(self, Fail(where))

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


def check(c: PretrainConfig, fail: Fail) -> None:
    """The bounds of every field and the rules between fields, through `fail(key, msg)`."""
    for key in POSITIVE_INTS:
        fail.integer(key, getattr(c, key), lo=1)
    if c.hidden_size % c.num_heads or (c.hidden_size // c.num_heads) % 2:
        fail(
            "hidden_size",
            f"{c.hidden_size} does not split into num_heads={c.num_heads} heads of even size; "
            f"expected a multiple of 2 * num_heads (rotary)",
        )
    if c.num_heads % c.num_kv_heads:
        fail(
            "num_kv_heads",
            f"{c.num_kv_heads} does not divide num_heads={c.num_heads}; expected a divisor of it",
        )
    if c.seq_len > c.max_context:
        fail("seq_len", f"{c.seq_len} exceeds max_context={c.max_context}; expected <= max_context")
    fail.number("lr", c.lr)
    if not c.lr > 0:
        fail("lr", f"{c.lr}; expected > 0")
    fail.number("min_lr_ratio", c.min_lr_ratio, lo=0, hi=1)
    fail.integer("warmup_steps", c.warmup_steps, lo=0)
    fail.number("weight_decay", c.weight_decay, lo=0)
    fail.number("max_minutes", c.max_minutes)
    if not c.max_minutes > 0:
        fail("max_minutes", f"{c.max_minutes}; expected > 0")
    fail.number("snapshot_minutes", c.snapshot_minutes, lo=0)
    fail.choice("accelerator", c.accelerator, ("cpu", "gpu", "cuda", "auto"))
    fail.choice("precision", c.precision, ("32-true", "bf16-mixed"))
    if c.final_seq_len is not None:
        fail.integer("final_seq_len", c.final_seq_len, lo=2, hi=c.max_context)
    if c.final_batch_size is not None:
        fail.integer("final_batch_size", c.final_batch_size, lo=1)
    fail.number("final_fraction", c.final_fraction, lo=0)
    if not c.final_fraction < 1:
        fail("final_fraction", f"{c.final_fraction}; expected a number in [0, 1)")
    fail.number("eval_minutes", c.eval_minutes, lo=0)
    fail.number("stop_gain_per_hour", c.stop_gain_per_hour, lo=0)
    if c.stop_gain_per_hour and not c.eval_minutes:
        fail(
            "stop_gain_per_hour",
            f"{c.stop_gain_per_hour} needs held-out evaluations; expected eval_minutes > 0 "
            f"(the gain is measured on them)",
        )


def load_config(path: str | Path, **overrides) -> PretrainConfig:
    """Read a YAML into a validated `PretrainConfig` through the suite's config pieces
    (`experiments.plumbing.parsing`: bounded YAML, the override rule, the typed section parser); errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(
            f"{path}: no such file; expected a pre-training config path or one of {sorted(CONFIGS)}"
        )
    raw = read_yaml(path, what="pretrain config") or {}
    fail = Fail(str(path))
    if not isinstance(raw, dict):
        fail("(top level)", f"a {type(raw).__name__}; expected a mapping of PretrainConfig fields")
    raw = apply_overrides(raw, overrides)
    known = {f.name for f in dataclasses.fields(PretrainConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:  # all of them in one message (parse_section stops at the first)
        fail(", ".join(unknown), f"unknown key(s) {unknown}; expected some of {sorted(known)}")
    cfg = parse_section(PretrainConfig, raw, "", fail)
    check(cfg, fail)
    return cfg
