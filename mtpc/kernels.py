"""The CPU row-vector products the compact engine and the head decoder multiply by: oneDNN's and
mtpc's row-dot kernel.

At batch 1 a decoding step is reading weights. On the 2-core test CPU (AMD EPYC, one thread)
MKL's `F.linear` / `addmm` read float32 weights at about half of memory speed, while oneDNN with
the weight reordered once into its blocked format reads near it (one row: 1.0 ms against 2.25 ms
for the default model's step weights; eight rows 1.6-1.9 against 4.3 ms; bench/bench_decode.py
times both). In bf16 `F.linear` already calls oneDNN, so there the blocked copy changes nothing
but the per-call reorder.

    w = onednn_pack(W)              # W (out, in) float32 / bf16 CPU -> a blocked copy (a new tensor)
    y = onednn_linear(x, w, bias)   # x (..., in) -> x W^T + bias (..., out)

`onednn_unsupported(device, dtype)` says why this cannot run (not the CPU, float64, a torch
without oneDNN) or None; `use_onednn` applies the rule the engine and the head decoder share
(asked for / automatic / off), `warn_fallback` says when the automatic choice fell back. Leaves out: CUDA (cuBLAS reads at speed there), autograd (decoding
only), torch.compile (inductor does not lower the blocked weights).

The cycle kernels (built in the same module), for the batch-1 decoding cycle on the CPU, where a
small tensor op's dispatch costs more than its arithmetic: the btree drafts (mtpc/csrc/btree_draft.cpp,
one call instead of ~40-80 small torch ops; greedy: the max-product window, the same floats in the
same order as the torch path, so the same window, ties included; sampled: an exact draw with its
conditionals, its own float order and uniforms) and the sampling accept (mtpc/csrc/accept.cpp):

    native_cycle_unsupported(device, dtype)            # why not here (one line), or None
    x = btree_greedy_draft(root, internal, leaves, prefix, plan)
    x, q = btree_sample_draft(root, internal, leaf_p, prefix, uniforms, plan)
    got = sample_accept(p, q, draft, budget, stop_ids, uniforms)  # [s, extra, count, *draft]
    got = greedy_accept_native(logits, draft, budget, stop_ids, banned)  # the greedy cycle's

The row-dot kernel (mtpc/csrc/rowdot.cpp, float32 arithmetic, x86 with AVX2 + FMA) multiplies by W
in its own (out, in) layout, a row's bits the same whatever the number of rows in the call (so the
verify's rows equal the step's exactly). W is read from bfloat16 storage where its values are bf16
numbers (`rowdot_weight`: a bf16 checkpoint loaded to float32), widened exactly: the same bits as
from float32, half the bytes. On the AMD EPYC VM (one thread, bench/bench_decode.py's engine
section) one row through the default model's fused groups takes 1.09x a plain read of them against
oneDNN's 1.33x, and the engine step with it 0.79x oneDNN's (docs/decoding.md). It is compiled once
per machine on first use (`torch.utils.cpp_extension`, a C++ compiler and ninja, ~30 s) into
torch's extensions folder (`$TORCH_EXTENSIONS_DIR`, else ~/.cache/torch_extensions):

    rowdot_unsupported(device, dtype)   # why it cannot run here (one line), or None; builds it
    w = rowdot_weight(W)                # W (out, in) float32 -> its copy: bf16 storage where exact
    y = rowdot_linear(x, w, bias)       # x (..., in) -> x W^T + bias (..., out)
"""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path

import torch
from torch import Tensor

# oneDNN's blocked weight format is chosen for a batch-size hint; 16 rows served the 1-byte step
# and the 8- / 16-byte verify best on the 2-core CPU (one row as fast as with hint 1's gemv format)
ONEDNN_BATCH_HINT = 16


def onednn_unsupported(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why oneDNN's products cannot run here (one line), or None."""
    device = torch.device(device)
    if device.type != "cpu":
        return f"weights='onednn' runs on the CPU only (the weights are on {device})"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"weights='onednn' needs float32 or bfloat16 weights (got {dtype}; oneDNN has no float64)"
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return "weights='onednn': this torch build has no oneDNN (mkldnn) linear"
    if dtype == torch.bfloat16 and not _bf16_supported():
        return (
            f"weights='onednn' in bfloat16 needs a CPU with avx512bw/vl/dq or avx_ne_convert "
            f"(this one: {torch.backends.cpu.get_cpu_capability()})"
        )
    return None


def _bf16_supported() -> bool:
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(probe()) if probe is not None else True


def use_onednn(requested: bool | None, device: torch.device | str, dtype: torch.dtype, where: str) -> bool:
    """Whether `where` multiplies by oneDNN: True (asked for: a ValueError naming `where` if it cannot
    run here), None (wherever it runs), False (never)."""
    reason = onednn_unsupported(device, dtype)
    if requested and reason:
        raise ValueError(f"{where}: {reason}")
    return reason is None if requested is None else bool(requested)


def warn_fallback(where: str, err: BaseException, instead: str) -> None:
    """One RuntimeWarning: the automatic oneDNN choice of `where` failed (a oneDNN build or CPU that
    cannot reorder the weights) and `instead` runs."""
    warnings.warn(f"{where}: oneDNN could not reorder the weights ({type(err).__name__}: {err}); using {instead}",
                  RuntimeWarning, stacklevel=3)  # fmt: skip


def onednn_pack(weight: Tensor) -> Tensor:
    """W (out, in) -> a oneDNN-blocked copy for `onednn_linear` (the source is not kept)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), ONEDNN_BATCH_HINT)


def onednn_linear(x: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (..., in) -> x W^T (+ bias (out,)) (..., out) for a `onednn_pack`ed W. A row's product came
    out the same bits whether the call held 1 or 8 rows (MKL's sgemm here does not)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# --- the row-dot kernel (mtpc/csrc/rowdot.cpp) -------------------------------------------------

CSRC = Path(__file__).resolve().parent / "csrc"
# one module: the row-dot product, the btree drafts, the sampling accept and their Python binding
KERNEL_SOURCES = [CSRC / "rowdot.cpp", CSRC / "btree_draft.cpp", CSRC / "accept.cpp", CSRC / "module.cpp"]


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


@functools.cache
def _kernel_module() -> tuple[object | None, str | None]:
    """(the compiled extension, None) or (None, why it is not there); built once per process."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"the row-dot kernel is x86 code (this machine: {platform.machine()})"
    missing = {"avx2", "fma"} - _cpu_flags()
    if missing:
        return None, f"the row-dot kernel needs a CPU with {' and '.join(sorted(missing))}"
    try:
        from torch.utils import cpp_extension

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = cpp_extension.load(  # into torch's extensions folder ($TORCH_EXTENSIONS_DIR)
                name="mtpc_kernels",
                sources=[str(p) for p in KERNEL_SOURCES],
                extra_cflags=["-O3", "-mavx2", "-mfma"],
                verbose=os.environ.get("MTPC_VERBOSE_BUILD") == "1",
            )
    except Exception as err:  # no compiler, no ninja, a failed build: say so in one line
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return None, f"the row-dot kernel did not build ({type(err).__name__}: {first[:200]})"
    return module, None


def _kernels():
    """The compiled module, or RuntimeError with the one-line reason it is not there."""
    module, why = _kernel_module()
    if module is None:
        raise RuntimeError(why)
    return module


def rowdot_unsupported(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why the row-dot kernel cannot run here (one line), or None; builds it on the first call."""
    device = torch.device(device)
    if device.type != "cpu":
        return f"weights='rowdot' runs on the CPU only (the weights are on {device})"
    if dtype != torch.float32:
        return f"weights='rowdot' needs float32 weights (got {dtype})"
    return _kernel_module()[1]


def rowdot_weight(weight: Tensor) -> Tensor:
    """W (out, in) float32 -> the copy `rowdot_linear` reads: bfloat16 *storage* when every value is
    a bf16 number (a checkpoint stored in bf16 and loaded to float32, as the shipped default model
    and heads are), else float32. The kernel widens bf16 exactly and computes in float32, so both
    give the same bits; the bf16 copy is half the bytes to read."""
    w = weight.detach().contiguous()
    narrow = w.to(torch.bfloat16)
    return narrow if torch.equal(narrow.to(w.dtype), w) else w.clone()


def rowdot_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (..., in) float32 -> x W^T (+ bias (out,) float32) (..., out) for W (out, in) contiguous,
    float32 or bfloat16 storage (`rowdot_weight`), on the CPU; row m of the result has the same bits
    whatever the number of rows (see the module docstring). Raises RuntimeError where
    `rowdot_unsupported` gives a reason."""
    module = _kernels()
    return module.rowdot_linear(x, weight, bias)


def rowdot_batched(x: Tensor, weight_t: Tensor, bias: Tensor) -> Tensor:
    """A batch of short row-vector products, one transposed matrix per row: x (J, K) float32,
    weight_t (J, K, N) float32 or bf16 storage (`rowdot_weight` on the (J K, N) view), bias (G, N)
    float32 -> (J, N), row j = x[j] @ weight_t[j] + bias[j // (J // G)], vectorised over the outputs
    (the head decoder's App. G leaves B (A e) + U e, K the delta rank). Raises RuntimeError where the
    kernels do not build."""
    module = _kernels()
    return module.rowdot_batched(x.contiguous(), weight_t.contiguous(), bias.contiguous())


def head_params(
    e: Tensor, c: Tensor | None, known: Tensor | None, weight: Tensor, bias: Tensor, delta_t: Tensor | None,
    n: int, r: int, v: int,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The head decoder's parameter pass for one context in one native call (its row-dot path):
    e (d,) float32, c (1,) int64 the known byte and known (V, d) its embedding (None: not a
    known-byte head), weight (N, d) and bias (N,) the decoder's stacked product, delta_t (n r, k, v)
    App. G's B^T (None: full leaves) -> (leaves (n, r, v) log-probabilities, every sum unit's
    log-weights flat, in the decoder's order): the bits of the separate calls (the same product
    kernels and ATen's log_softmax). Raises RuntimeError where the kernels do not build."""
    module = _kernels()
    empty = _EMPTY
    leaves, sums = module.head_params(
        e, empty if c is None else c.reshape(1).long(), empty if known is None else known, weight, bias,
        empty if delta_t is None else delta_t, n, r, v,
    )  # fmt: skip
    return leaves, sums


_EMPTY = torch.empty(0)


def btree_greedy_draft(
    root: Tensor, internal: Tensor, leaves: Tensor, prefix: Tensor, plan: Tensor
) -> Tensor:
    """The btree circuit's greedy window for one context in one native call (mtpc/csrc/btree_draft.cpp):
    root (r,), internal (m, r, r), leaves (n, r, v) float32 normalised log-parameters on the CPU,
    prefix (k,) int64, plan the tree (`mtpc.circuits.btree._Schedule.native_plan`) -> (n,) int64,
    the same window (bits and ties) as `BTreeCircuit._greedy_window` with the prefix. Raises
    RuntimeError where the kernels do not build (`native_cycle_unsupported` says why)."""
    module = _kernels()
    return module.btree_greedy_draft(root, internal, leaves, prefix, plan)


def btree_sample_draft(
    root: Tensor, internal: Tensor, leaf_p: Tensor, prefix: Tensor, uniforms: Tensor, plan: Tensor
) -> tuple[Tensor, Tensor]:
    """The btree circuit's sampled window for one context and its conditionals in one native call
    (mtpc/csrc/btree_draft.cpp): root (r,), internal (m, r, r) float32 normalised log-parameters,
    leaf_p (n, r, v) float32 leaf probabilities, prefix (k,) int64, uniforms (1 + m + n,) float64,
    plan (`_Schedule.native_plan`) -> (window (n,) int64, q(x_i = . | x_<i) (n, v) float32): an exact
    draw from the circuit (root, nodes, free leaves by inverse CDF, one uniform each) and the
    conditionals of the drawn window. Raises RuntimeError where the kernels do not build."""
    module = _kernels()
    x, q = module.btree_sample_draft(root, internal, leaf_p, prefix, uniforms, plan)
    return x, q


def sample_accept(
    p: Tensor, q: Tensor, draft: Tensor, budget: int, stop_ids: list[int], uniforms: Tensor
) -> Tensor:
    """The sampling cycle's acceptance in one native call (mtpc/csrc/accept.cpp): p (m + 1, v) target
    and q (m, v) draft probabilities (float32, CPU), draft (m,) int64, the byte budget and stop ids
    (the testable drafts: `acceptance.testable_drafts`), two float64 uniforms -> [s accepted, the
    extra token, the testable count, *draft] (int64, 3 + m): `acceptance.sample_verify`'s
    distribution, drawn by inverse CDF instead of two exponential races. Raises RuntimeError where the
    kernels do not build."""
    module = _kernels()
    return module.sample_accept(
        p.contiguous(), q.contiguous(), draft.contiguous(), budget, list(stop_ids), uniforms
    )


def greedy_accept_native(
    logits: Tensor, draft: Tensor, budget: int, stop_ids: list[int], banned: list[int]
) -> Tensor:
    """The greedy cycle's acceptance in one native call (mtpc/csrc/accept.cpp): verifier logits
    (m + 1, v) float32 on the CPU, draft (m,) int64, the byte budget, stop ids and banned ids ->
    [s accepted, the extra token, the testable count, *draft] (int64, 3 + m): what
    `acceptance.greedy_target` + `greedy_accept` give (the first maximum, banned ids excluded).
    Raises RuntimeError where the kernels do not build."""
    module = _kernels()
    return module.greedy_accept(logits.contiguous(), draft.contiguous(), budget, list(stop_ids), list(banned))


def native_cycle_unsupported(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why the native cycle kernels (the btree drafts, the sampling accept) cannot run here (one
    line), or None; builds the kernels on the first call. $MTPC_NATIVE_CYCLE=0 turns them off (the
    torch paths run: the same greedy window; sampled draws from the same distributions)."""
    if os.environ.get("MTPC_NATIVE_CYCLE", "1") == "0":
        return "the native cycle kernels are off ($MTPC_NATIVE_CYCLE=0)"
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        return "the native cycle kernels run on float32 CPU tensors only"
    return _kernel_module()[1]


def main() -> int:
    """`python -m mtpc.kernels`: build the row-dot kernel now (`make test` and `make demo` do, so no
    run pays the build later) and say in one line whether the engine will use it. Exit 0 either way:
    without it the engine multiplies by oneDNN."""
    import time

    t0 = time.perf_counter()
    why = rowdot_unsupported("cpu", torch.float32)
    if why:
        print(f"mtpc: {why}; the CPU engine multiplies by oneDNN instead")
    else:
        print(f"mtpc: CPU kernels ready ({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
