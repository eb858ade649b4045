"""The frozen backbone's hidden states of a training batch, computed once and reused by every head.

At LoRA depth k = 0 the whole backbone is frozen: a batch's e_t (the post-final-norm hidden states,
which at k = 0 are both the draft and the verifier input) depends on its bytes and the weights alone,
and the teacher's logits (distillation) follow from it through the LM head. `HiddenCache` keeps them
on disk, content-addressed: the key is the SHA-256 of the batch's ids (shape and bytes) under a folder
named by the backbone's fingerprint (its name, dtype and the SHA-256 of every weight), so any head or
trial that trains on the same rows of the same backbone reads them instead of running the trunk —
across heads and trials; within one run rows are seen once (one epoch), so a single run only fills.

An entry is a safetensors file written atomically (`mtpc.atomic`) whose metadata holds its key and the
SHA-256 of its tensor; an entry that does not parse, names another key or fails its checksum is
reported once (one warning naming the file) and recomputed and rewritten. A folder that cannot be
written warns once and training goes on without the cache. The stored tensor is the computed one in
the backbone's dtype, so gradients through a cached batch equal the uncached path's exactly (tested in
float64). Size: B x S x d values per batch (the default model, 2 x 512 bytes: 2 MiB a step in float32).

Counters (`hits`, `misses`, `fill_s`, `read_s`) let a benchmark report the fill apart from the reuse.
Leaves out: k > 0 (the trunk below the LoRA could be cached the same way; not done), the LM head.
"""

from __future__ import annotations

import hashlib
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as safetensors_bytes

from mtpc.atomic import write_bytes
from mtpc.backbones.common import Backbone

FORMAT = 1


def fingerprint(backbone: Backbone) -> str:
    """16 hex digits naming the backbone's weights exactly: its name, dtype and every parameter's bytes."""
    h = hashlib.sha256(f"{FORMAT}:{getattr(backbone, 'name', type(backbone).__name__)}".encode())
    for name, t in sorted(backbone.state_dict().items()):
        if "lora_" in name:
            continue
        t = t.detach().contiguous().cpu()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def _tensor_digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


class HiddenCache:
    """`get(ids, compute)`: the hidden states of batch `ids` (B, S) from disk, else `compute()` stored."""

    def __init__(self, directory: str | Path, backbone: Backbone):
        self.root = Path(directory).expanduser() / fingerprint(backbone)
        self.hits = self.misses = 0
        self.fill_s = self.read_s = 0.0
        self._disabled = False
        self._warned: set[str] = set()

    def _key(self, ids: torch.Tensor) -> str:
        a = ids.detach().to("cpu", torch.int64).contiguous()
        return hashlib.sha256(f"{tuple(a.shape)}".encode() + a.numpy().tobytes()).hexdigest()

    def path(self, ids: torch.Tensor) -> Path:
        key = self._key(ids)
        return self.root / key[:2] / f"{key}.safetensors"

    def _warn(self, what: str, msg: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            warnings.warn(msg, stacklevel=3)

    def _read(self, path: Path, key: str, device: torch.device) -> torch.Tensor | None:
        try:
            if not path.is_file():
                return None
            with safe_open(str(path), framework="pt") as f:  # one open: the tensor and its key and checksum
                meta = f.metadata() or {}
                t = f.get_tensor("hidden")
            if meta.get("key") != key or meta.get("sha256") != _tensor_digest(t):
                raise ValueError("key or checksum differs")
        except FileNotFoundError:
            return None
        except (SafetensorError, OSError, ValueError, KeyError) as err:
            self._warn(str(path), f"hidden-state cache: {path} is corrupt ({err}); recomputing it")
            return None
        return t.to(device)

    def get(self, ids: torch.Tensor, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        key = self._key(ids)
        path = self.root / key[:2] / f"{key}.safetensors"
        if not self._disabled:
            t0 = time.perf_counter()
            hidden = self._read(path, key, ids.device)
            if hidden is not None:
                self.hits += 1
                self.read_s += time.perf_counter() - t0
                return hidden
        t0 = time.perf_counter()
        with torch.no_grad():
            hidden = compute().detach()
        self.misses += 1
        if not self._disabled:
            cpu = hidden.to("cpu").contiguous()
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                write_bytes(
                    path,
                    safetensors_bytes({"hidden": cpu}, metadata={"key": key, "sha256": _tensor_digest(cpu)}),
                )
            except OSError as err:
                self._disabled = True
                self._warn(
                    "write",
                    f"hidden-state cache: cannot write under {self.root} ({err}); training goes on "
                    "without the cache",
                )
        self.fill_s += time.perf_counter() - t0
        return hidden

    def stats(self) -> dict[str, float]:
        return {
            "hidden_cache_hits": float(self.hits),
            "hidden_cache_misses": float(self.misses),
            "hidden_cache_fill_s": self.fill_s,
            "hidden_cache_read_s": self.read_s,
        }
