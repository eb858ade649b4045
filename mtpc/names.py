"""The suite's vocabulary: every name and bound that more than one layer uses, stated once.

Holds the circuit kinds, the decoding modes and extra-token rules, the sweep grid parameters, the
window/rank/LoRA-depth bounds with the ff rank rule (`check_architecture`, the one check the head,
the training config and the sweep spec all call), and the MLflow param and metric names shared by
the decoding statistics, the evaluation JSON, MLflow child runs, the sweep objectives and the
analysis (DESIGN section 3). Import from here; never restate a tuple or a bound elsewhere.

Only names and plain checks live here (no torch, so the analysis and sweep specs can read it
cheaply); the values are computed in `mtpc/speculative` and `experiments/evaluate.py`.
"""

from __future__ import annotations

from typing import Any

#: circuit kinds, in table/plot order (fully factorised, mixture, HMM, binary tree)
CIRCUIT_KINDS: tuple[str, ...] = ("ff", "cp", "hmm", "btree")
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
#: packed (one transposed (in, out) copy, q|k|v and gate|up fused: fewer products) or onednn (the
#: same groups in oneDNN's blocked format, multiplied by oneDNN: CPU, float32 / bf16 only, the
#: default there; elsewhere views is)
ENGINE_WEIGHT_LAYOUTS: tuple[str, ...] = ("views", "packed", "onednn")
#: the axes of a sweep grid point (and the architecture params of a trial), in grid-key order
GRID_PARAMS: tuple[str, ...] = ("circuit", "rank", "window", "lora_depth")
#: training axes a grid may vary beside the architecture, with their defaults: kl_beta (weight of the
#: distillation term, 0 = cross-entropy; training's model.kl_beta) and train_seed (the head's
#: training seed, training's seed_everything; the evaluation `seed` is another param)
TRAIN_AXES: dict[str, Any] = {"kl_beta": 0.0, "train_seed": 0}
#: every axis of a sweep grid point: the architecture, then the training axes (grid-key order)
SWEEP_AXES: tuple[str, ...] = GRID_PARAMS + tuple(TRAIN_AXES)
#: the tag of each axis in a grid key (`cp-r8-n16-k0`, `cp-r8-n16-k0-kl0.5-s1`). A new sweep axis
#: adds its name to SWEEP_AXES (with its default in TRAIN_AXES, which a key leaves out, so the keys
#: (run names, checkpoint directories) of points that do not use the axis stay what they were) and
#: its tag here; that is the one place.
GRID_KEY_TAGS: dict[str, str] = {"circuit": "", "rank": "r", "window": "n", "lora_depth": "k", "kl_beta": "kl", "train_seed": "s"}


def _same(value: Any, default: Any) -> bool:
    try:
        return float(value) == float(default)
    except (TypeError, ValueError):
        return str(value) == str(default)


def grid_key(point: dict[str, Any]) -> str:
    """A short stable name for a grid point, e.g. `cp-r8-n16-k0` (`-kl0.5-s1` for kl_beta 0.5,
    train_seed 1; axes at their TRAIN_AXES default are left out): checkpoint directories, the parent
    run of a trial and the names of its evaluation runs. Values may be str (as MLflow stores
    params) or numbers alike."""
    parts = []
    for name in SWEEP_AXES:
        if name in TRAIN_AXES:
            value = point.get(name, TRAIN_AXES[name])
            if value is None or _same(value, TRAIN_AXES[name]):
                continue
        else:
            value = point[name]
        if isinstance(value, float) or isinstance(TRAIN_AXES.get(name), float):
            value = f"{float(value):g}"  # 0.5 and "0.5" alike
        parts.append(f"{GRID_KEY_TAGS[name]}{value}")
    return "-".join(parts)


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
    """The rank used when none is given: 1 for ff (it has no latent states), DEFAULT_RANK otherwise."""
    return 1 if circuit == "ff" else DEFAULT_RANK


def point_rank(circuit: str, rank: int) -> int:
    """The rank of a sweep space point: a grid product or a sampler draw that picks ff takes r = 1.

    ff has no rank axis, so `circuit: [ff, cp] x rank: [4, 8]` means ff once and cp twice. This is
    the only place a rank is replaced; a config or a head that asks for ff with r != 1 is an error.
    """
    return 1 if circuit == "ff" else rank


class ArchitectureError(ValueError):
    """An invalid (circuit, window, rank, lora_depth): `key` is the param, `detail` what was expected."""

    def __init__(self, where: str, key: str, detail: str) -> None:
        super().__init__(f"{where}{key}: {detail}")
        self.key, self.detail = key, detail


def check_axis(name: str, value: Any, *, decoding: bool = False, where: str = "") -> None:
    """Check one SWEEP_AXES value alone (the bounds; the ff rank rule needs the circuit too)."""
    if name == "kl_beta":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise ArchitectureError(where, name, f"expected a number in [0, 1] (0: cross-entropy only), got {value!r}")
        return
    if name == "train_seed":
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ArchitectureError(where, name, f"expected an integer >= 0, got {value!r}")
        return
    if name == "circuit":
        if value not in CIRCUIT_KINDS:
            raise ArchitectureError(where, name, f"unknown circuit kind {value!r}; expected one of {list(CIRCUIT_KINDS)}")
        return
    low, high = {
        "window": (MIN_DECODE_WINDOW if decoding else MIN_HEAD_WINDOW, MAX_WINDOW),
        "rank": (MIN_RANK, MAX_RANK),
        "lora_depth": (0, MAX_LORA_DEPTH),
    }[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArchitectureError(where, name, f"expected an integer in [{low}, {high}], got {value!r}")
    if not low <= value <= high:
        raise ArchitectureError(where, name, f"{value} out of range; expected an integer in [{low}, {high}]")


def check_architecture(
    circuit: Any, window: Any, rank: Any, lora_depth: Any = None, *, decoding: bool = False, where: str = ""
) -> None:
    """Raise ArchitectureError (a one-line ValueError naming `where` + the key) unless the head is valid.

    circuit in CIRCUIT_KINDS; MIN_HEAD_WINDOW (MIN_DECODE_WINDOW if `decoding`) <= window <= MAX_WINDOW;
    MIN_RANK <= rank <= MAX_RANK, and rank == 1 for ff; 0 <= lora_depth <= MAX_LORA_DEPTH unless None.
    `where` prefixes the key, e.g. "experiments/configs/debug.yaml: model." -> "...: model.rank: ...".
    """
    for name, value in (("circuit", circuit), ("window", window), ("rank", rank), ("lora_depth", lora_depth)):
        if value is not None or name != "lora_depth":
            check_axis(name, value, decoding=decoding, where=where)
    if circuit == "ff" and rank != 1:
        raise ArchitectureError(where, "rank", f"ff has no latent states; expected rank 1, got {rank}")


#: how EOS is treated during evaluation: banned (probability 0: every method generates the same
#: lengths) or allowed (EOS stops an answer)
EOS_MODES: tuple[str, ...] = ("banned", "allowed")
#: prompt sets named DEV_SET_PREFIX + i are development prompts: used to choose settings (beta, a
#: temperature, the best head), never reported; the others ("0", "1", ...) are the reported sets
DEV_SET_PREFIX = "dev"
#: params of every evaluation child run (copied from the trial, so children can be filtered alone)
EVAL_PARAMS: tuple[str, ...] = (
    "backbone", "circuit", "window", "rank", "lora_depth", "mode", "extra_token", "eos", "temperature",
    "prompt_set", "seed", "top_p", "hardware",
)  # fmt: skip
#: scalar metrics of one evaluation (mode, prompt set); the first four place a run on the Pareto plot
EVAL_METRICS: tuple[str, ...] = (
    "mu_lat",  # mean seconds per cycle (draft + verify + accept), prefill excluded
    "mu_acc",  # mean accepted drafted bytes per cycle
    "tokens_per_cycle",  # bytes emitted per cycle
    "throughput",  # generated bytes / decode seconds (measured)
    "max_throughput",  # window / mu_lat (accept-all bound)
    "stp_mu_lat",
    "stp_throughput",
    "speedup_vs_stp",
    "speedup_vs_ff",  # only when an ff head was evaluated in the same process
    "peak_mem_bytes",
    "degenerate_fraction",  # answers whose last 128 bytes loop with a period <= 32 (mtpc/textstats.py)
    "distinct_4gram_ratio",  # mean over answers of unique / total byte 4-grams
)
#: the degeneracy metrics of one evaluation (also computed for the plain model: `stp_` + name)
DEGENERACY_METRICS: tuple[str, ...] = ("degenerate_fraction", "distinct_4gram_ratio")
#: above this degenerate_fraction an acceptance figure is flagged as measured on looping text
DEGENERATE_WARN_FRACTION = 0.25
#: per-position acceptance metrics: f"{ACCEPTANCE_PREFIX}{i}", i = 1-based window position
ACCEPTANCE_PREFIX = "acceptance_pos_"
#: the accepted-length histogram artifact of a child run
HISTOGRAM_ARTIFACT = "accepted_length_histogram.json"
#: per-prompt records of a child run (cycles, accepted drafts, decode time, degenerate), for paired
#: comparisons over the same prompts (analysis/bootstrap.py)
PER_PROMPT_ARTIFACT = "per_prompt.json"
#: experiment tag: the number of grid points of the sweep that logs into it (set by its init), so
#: the analysis notices when the store holds fewer points than the sweep has
POINTS_TAG = "mtpc.n_points"
