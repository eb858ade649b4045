"""The library's vocabulary: every name and bound the library uses, stated once.

Holds the circuit kinds, the decoding modes and extra-token rules, the engine settings, the
window/rank/LoRA-depth bounds with the ff rank rule (`check_architecture`, the one check the head,
the training config and the sweep spec all call; `check_axis` for one value) and the defaults of a
head. The experiment built on it (the sweep axes, `tracking/axes.py`; grid keys, MLflow params and
metrics, artifact names, `tracking/schema.py`) is not the library's: a training setting's rule
lives with the training config (`experiments.training.config`). Import from here; never restate a tuple or a bound elsewhere.

Only names and plain checks live here (no torch, so the analysis and sweep specs can read it
cheaply).
"""

from __future__ import annotations

from typing import Any

#: circuit kinds, in table/plot order (fully factorised, mixture, HMM, binary tree); each has its class in
#: mtpc.circuits.CIRCUIT_CLASSES, checked to agree at import (docs/circuits.md, "Adding a circuit kind")
CIRCUIT_KINDS: tuple[str, ...] = ("ff", "cp", "hmm", "btree")
#: the kinds without latent states -> the one rank they have (ff: a product of n leaves, rank 1); the
#: torch-free mirror of each class's `fixed_rank` (mtpc/circuits/), checked to agree at import
FIXED_RANKS: dict[str, int] = {"ff": 1}
#: decoding modes: greedy (argmax, byte-identical to plain greedy) or sample
DECODE_MODES: tuple[str, ...] = ("greedy", "sample")
#: what happens to the verifier's extra token: keep (exact, one call per cycle) or drop (paper's Alg. 2)
EXTRA_TOKEN_OPTIONS: tuple[str, ...] = ("keep", "drop")
#: the decoding engine of a backbone: auto (compact when it implements the model), compact (mtpc's own
#: Llama forward with preallocated caches), hf (the transformers decoder layers)
DECODE_ENGINES: tuple[str, ...] = ("auto", "compact", "hf")
#: how the compact engine runs the LoRA draft top: lowrank (s B (A x) beside the shared W) or merged
DRAFT_LORA_MODES: tuple[str, ...] = ("lowrank", "merged")
#: how the compact engine holds the base weights: views (the HF parameters as they are, (out, in)),
#: packed (one transposed (in, out) copy, q|k|v and gate|up fused: fewer products), onednn (the
#: same groups in oneDNN's blocked format, multiplied by oneDNN: CPU, float32 / bf16) or rowdot (the
#: same groups as (out, in) copies for mtpc's row-dot kernel: x86 CPU with AVX2 + FMA, float32, the
#: default there; oneDNN is where rowdot does not run, elsewhere views is)
ENGINE_WEIGHT_LAYOUTS: tuple[str, ...] = ("views", "packed", "onednn", "rowdot")
#: how the compact engine attends in its static-shape calls: sdpa (torch's attention over the whole
#: capacity with a mask, the default) or split_kv (the split-KV Triton kernel over the live length read
#: from a device tensor: CUDA with triton, unverified on a GPU; mtpc/backbones/decode_attention.py)
ENGINE_ATTENTION: tuple[str, ...] = ("sdpa", "split_kv")
#: window n: a head predicts 1..MAX_WINDOW bytes; decoding drafts n - 1 bytes, so it needs n >= 2
MIN_HEAD_WINDOW = 1
MIN_DECODE_WINDOW = 2
MAX_WINDOW = 64
#: rank r: latent states per sum unit (ff has none: r must be 1)
MIN_RANK = 1
MAX_RANK = 1024
#: lora_depth k: top backbone layers with a draft LoRA adapter (0: none); the backbone may allow fewer
MAX_LORA_DEPTH = 1024
#: defaults shared by training and the in-process random heads of `MtpcModel`
DEFAULT_WINDOW = 8
DEFAULT_RANK = 8


def default_rank(circuit: str) -> int:
    """The rank used when none is given: a kind's fixed rank (`FIXED_RANKS`: ff 1), DEFAULT_RANK otherwise."""
    return FIXED_RANKS.get(circuit, DEFAULT_RANK)


def point_rank(circuit: str, rank: int) -> int:
    """The rank of a sweep space point: a grid product or a sampler draw that picks a kind of fixed rank
    (`FIXED_RANKS`: ff) takes that rank.

    ff has no rank axis, so `circuit: [ff, cp] x rank: [4, 8]` means ff once and cp twice. This is
    the only place a rank is replaced; a config or a head that asks for ff with r != 1 is an error.
    """
    return FIXED_RANKS.get(circuit, rank)


class ArchitectureError(ValueError):
    """An invalid (circuit, window, rank, lora_depth): `key` is the param, `detail` what was expected."""

    def __init__(self, where: str, key: str, detail: str) -> None:
        super().__init__(f"{where}{key}: {detail}")
        self.key, self.detail = key, detail


def check_axis(name: str, value: Any, *, decoding: bool = False, where: str = "") -> None:
    """Check one value of an architecture axis (circuit, window, rank, lora_depth) alone: the bounds
    (the ff rank rule needs the circuit too). ValueError for another name."""
    if name == "circuit":
        if value not in CIRCUIT_KINDS:
            raise ArchitectureError(
                where, name, f"unknown circuit kind {value!r}; expected one of {list(CIRCUIT_KINDS)}"
            )
        return
    bounds = {
        "window": (MIN_DECODE_WINDOW if decoding else MIN_HEAD_WINDOW, MAX_WINDOW),
        "rank": (MIN_RANK, MAX_RANK),
        "lora_depth": (0, MAX_LORA_DEPTH),
    }
    if name not in bounds:
        raise ValueError(
            f"check_axis: {name!r} is not an architecture axis; expected circuit, {', '.join(bounds)}"
        )
    low, high = bounds[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArchitectureError(where, name, f"expected an integer in [{low}, {high}], got {value!r}")
    if not low <= value <= high:
        raise ArchitectureError(where, name, f"{value} out of range; expected an integer in [{low}, {high}]")


def check_decode_window(window: int, what: str = "speculative decoding") -> int:
    """A window a cycle can decode with (at least MIN_DECODE_WINDOW bytes), else a one-line ValueError."""
    if window < MIN_DECODE_WINDOW:
        raise ValueError(f"{what} needs a window n >= {MIN_DECODE_WINDOW}, got {window}")
    return window


def check_draft_len(draft_len: object, window: int) -> int:
    """The bytes a cycle feeds: `draft_len` checked against the head's window n (None: n)."""
    if draft_len is None:
        return window
    if (
        isinstance(draft_len, bool)
        or not isinstance(draft_len, int)
        or not MIN_DECODE_WINDOW <= draft_len <= window
    ):
        raise ValueError(
            f"draft_len: expected an integer in [{MIN_DECODE_WINDOW}, {window}] (the head's window) or None, "
            f"got {draft_len!r}"
        )
    return draft_len


def check_architecture(
    circuit: Any, window: Any, rank: Any, lora_depth: Any = None, *, decoding: bool = False, where: str = ""
) -> None:
    """Raise ArchitectureError (a one-line ValueError naming `where` + the key) unless the head is valid.

    circuit in CIRCUIT_KINDS; MIN_HEAD_WINDOW (MIN_DECODE_WINDOW if `decoding`) <= window <= MAX_WINDOW;
    MIN_RANK <= rank <= MAX_RANK, and a kind's fixed rank (`FIXED_RANKS`: 1 for ff); 0 <= lora_depth <= MAX_LORA_DEPTH unless None.
    `where` prefixes the key, e.g. "experiments/configs/debug.yaml: model." -> "...: model.rank: ...".
    """
    for name, value in (("circuit", circuit), ("window", window), ("rank", rank), ("lora_depth", lora_depth)):
        if value is not None or name != "lora_depth":
            check_axis(name, value, decoding=decoding, where=where)
    fixed = FIXED_RANKS.get(circuit)
    if fixed is not None and rank != fixed:
        raise ArchitectureError(
            where, "rank", f"{circuit} has no latent states; expected rank {fixed}, got {rank}"
        )
