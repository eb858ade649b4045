"""An on-disk cache of the plain model's continuations, shared by every trial and process that asks.

Offline acceptance (offline.py) needs the plain model's continuation of every prompt. They depend
only on the verifier's weights, the prompts, the decode config and the seeds, not on the head, so
in a sweep every trial would recompute the same bytes. `cached_continuations` computes them once
per key and stores them as `<root>/<key>.json`; `root` is `$MTPC_CONTINUATION_CACHE_DIR`, else
`mtpc.paths.cache_dir() / "continuations"`.

The key is the SHA-256 of (each part below, as canonical JSON):

- `code_version`: `CODE_VERSION`, bumped whenever `continuations` / `plain_decode(_batch)` / the
  chooser would emit other bytes for the same inputs (old entries are then never read again).
- `weights`: `weights_fingerprint(backbone)`: the frozen model's config (private `_` keys and
  `transformers_version` left out) and, for every parameter and buffer of `backbone.model` (the
  verifier's weights; a LoRA draft top is not part of them, so heads with and without LoRA on one
  backbone share continuations, as they do inside one evaluation), its name, shape, dtype and bytes:
  all of them for a tensor of at most `SAMPLE` elements, else `SAMPLE` evenly spaced elements (cheap
  even for a 6.5B model: a few MB hashed). A shipped default adds its `default@<sha8>` label (its
  manifest covers every byte). Different checkpoints (another training step, a fine-tune, a merged
  LoRA, another dtype) differ at nearly every element; an edit confined to unsampled elements of a
  large tensor would go unnoticed: disable the cache for such weights.
- `compute`: dtype, device type (and CUDA device name), engine ("compact" / "hf"), the
  continuation batch size, torch / transformers versions and the CPU architecture: what can move a
  float32 near-tie.
- `decode`: mode, max_new_tokens, the stop ids and whether EOS is banned; sampling adds temperature
  and top_p (greedy ignores them and the seeds, so greedy entries are shared across temperatures).
- `prompts`: SHA-256 of the encoded prompts (ids, with their lengths), and the seeds (sampling).

An entry holds the key, the parts above (readable) and the continuations, with the SHA-256 of key and
continuations; it is written atomically (mtpc.atomic). On read an entry that does not parse, names
another key or fails its checksum is never trusted: one warning line names the file, and the
continuations are recomputed and written again. The checksum catches damage, not a writer who
recomputes it (`_checksum` is public knowledge): so an entry that passes it is also checked against
the model before it is returned, and fails the same way (named, recomputed, overwritten) when its
contents are impossible under the config (ids outside the vocabulary, longer than max_new_tokens,
bytes past a stop id) or when a byte is not what the verifier chooses there
(`offline.contradiction`: one verifier pass, the argmax for greedy within a float near-tie margin,
the seed's replayed draw for sampling), or, when the caller computed the bytes anyway (`compute`),
when they differ. Two processes asking for one key at once: a file
lock per key (`<key>.lock`, released by the OS if its holder dies) lets one compute while the other
waits, then reads. A cache directory that cannot be written warns once per call and computes
without caching.

`cached_pass` returns the continuations' teacher-forced pass as well and checks a hit on that very
pass (a caller that needs the pass anyway pays one, not the check's and its own).

Leaves out: the head's side of the evaluation (offline.py) and
eviction (entries are small: about 4 bytes per generated id; delete the directory to clear it).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mtpc.atomic import remove_stale_temps, write_json
from mtpc.backbones.common import Backbone
from mtpc.paths import cache_dir

__all__ = ["CODE_VERSION", "ENV_VAR", "SAMPLE", "cache_root", "cached_continuations", "cached_pass", "continuation_key",
           "entry_path", "weights_fingerprint"]  # fmt: skip

CODE_VERSION = 4
"""Bump when the continuation algorithm (offline.continuations, plain_decode(_batch), the chooser) changes its output."""
ENV_VAR = "MTPC_CONTINUATION_CACHE_DIR"
SAMPLE = 65536
"""Elements hashed per tensor: all of a smaller tensor, else this many evenly spaced ones."""
FORMAT = "mtpc-continuations"


def cache_root() -> Path:
    """`$MTPC_CONTINUATION_CACHE_DIR`, else `<mtpc cache>/continuations` (not created here)."""
    env = os.environ.get(ENV_VAR)
    return Path(env).expanduser() if env else cache_dir() / "continuations"


def _canon(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()


def _tensor_bytes(t: Tensor) -> bytes:
    flat = t.detach().reshape(-1)
    if flat.numel() > SAMPLE:
        flat = flat[torch.linspace(0, flat.numel() - 1, SAMPLE, device=flat.device).long()]
    flat = flat.cpu().contiguous()
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return flat.view(torch.uint8).numpy().tobytes()


def weights_fingerprint(backbone: Backbone | torch.nn.Module) -> str:
    """SHA-256 over the frozen model's config and every tensor's name, shape, dtype and (sampled)
    bytes; see the module docstring for what it covers. ValueError when the backbone has no module
    to read (`backbone.model`, or the backbone itself as a torch module)."""
    module = getattr(backbone, "model", None)
    if not isinstance(module, torch.nn.Module):
        module = backbone if isinstance(backbone, torch.nn.Module) else None
    if module is None:
        raise ValueError(f"weights_fingerprint: {type(backbone).__name__} has no torch module to hash")
    h = hashlib.sha256()
    name = str(getattr(backbone, "name", "") or "")
    if name.startswith("default@"):
        h.update(_canon({"label": name}))
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        h.update(_canon({k: v for k, v in config.to_dict().items()
                         if not k.startswith("_") and k != "transformers_version"}))  # fmt: skip
    tensors = dict(module.named_parameters())
    tensors.update((f"buffer:{k}", v) for k, v in module.named_buffers())
    for key in sorted(tensors):
        t = tensors[key]
        h.update(_canon([key, list(t.shape), str(t.dtype)]))
        h.update(_tensor_bytes(t))
    return h.hexdigest()


def _effective_batch(backbone: Backbone, batch_size: int) -> int:
    return (
        batch_size if getattr(backbone, "engine", "hf") == "compact" else 1
    )  # as offline.continuations decodes


def continuation_key(backbone: Backbone, prompts: list[Tensor], cfg: Any, seeds: list[int] | None = None,
                     batch_size: int = 1) -> tuple[str, dict[str, Any]]:  # fmt: skip
    """(the cache key, the parts it hashes) of `continuations(backbone, prompts, cfg, seeds, batch_size)`."""
    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:  # pragma: no cover - a dependency of every backbone
        tf_version = None
    dev = torch.device(getattr(backbone, "device", "cpu"))
    compute = {
        "dtype": str(getattr(backbone, "dtype", None)), "device": dev.type, "engine": getattr(backbone, "engine", "hf"),
        "batch_size": _effective_batch(backbone, batch_size), "torch": torch.__version__, "transformers": tf_version,
        "machine": platform.machine(),
    }  # fmt: skip
    if dev.type == "cuda":
        compute["device_name"] = torch.cuda.get_device_name(dev)
    sample = cfg.mode == "sample"
    decode = {"mode": cfg.mode, "max_new_tokens": int(cfg.max_new_tokens), "eos_ids": list(cfg.eos_ids),
              "ban_eos": bool(cfg.ban_eos)}  # fmt: skip
    if sample:
        decode.update(temperature=float(cfg.temperature), top_p=float(cfg.top_p))
    ph = hashlib.sha256()
    for p in prompts:
        ids = p.detach().reshape(-1).to("cpu", torch.int64)
        ph.update(ids.numel().to_bytes(8, "little"))
        ph.update(ids.numpy().tobytes())
    parts = {
        "code_version": CODE_VERSION, "weights": weights_fingerprint(backbone), "compute": compute, "decode": decode,
        "prompts": {"count": len(prompts), "sha256": ph.hexdigest()},
        "seeds": [int(s) for s in seeds] if sample and seeds is not None else None,
    }  # fmt: skip
    return hashlib.sha256(_canon(parts)).hexdigest(), parts


def entry_path(key: str, root: Path | None = None) -> Path:
    return (root or cache_root()) / f"{key}.json"


def _checksum(key: str, ys: list[list[int]]) -> str:
    return hashlib.sha256(_canon({"key": key, "continuations": ys})).hexdigest()


def _read(path: Path, key: str, n: int) -> list[list[int]] | None:
    """The entry's continuations; None when absent; None with one warning line when it cannot be trusted."""
    if not path.exists():
        return None
    why = None
    try:
        entry = json.loads(path.read_bytes())
        ys = entry["continuations"]
        if entry.get("format") != FORMAT or entry.get("key") != key:
            why = "it names another key or format"
        elif entry.get("sha256") != _checksum(key, ys):
            why = "its checksum does not match"
        elif (not isinstance(ys, list) or len(ys) != n
              or not all(isinstance(y, list) and y and all(type(t) is int for t in y) for y in ys)):  # fmt: skip
            why = f"it does not hold {n} continuations"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        why = f"it cannot be read ({type(e).__name__})"
    if why is not None:
        warnings.warn(f"continuation cache: {path} is corrupt ({why}); recomputing it", stacklevel=3)
        return None
    return ys


def _impossible(backbone: Backbone, prompts: list[Tensor], ys: list[list[int]], cfg: Any) -> str | None:
    """Why `ys` cannot be continuations of `prompts` under `cfg` on this backbone (None when they can)."""
    from mtpc.speculative.offline import _check_continuations

    try:
        _check_continuations(prompts, ys, cfg, backbone.vocab_size, backbone.max_context)
    except ValueError as e:
        return str(e)
    return None


def cached_continuations(backbone: Backbone, prompts: list[Tensor], cfg: Any, seeds: list[int] | None = None,
                         batch_size: int = 1, *, cache: bool = True, root: Path | None = None,
                         compute: Callable[[], list[list[int]]] | None = None, verify: bool = True,
                         check: Callable[[list[list[int]]], str | None] | None = None) -> list[list[int]]:  # fmt: skip
    """`offline.continuations(backbone, prompts, cfg, seeds, batch_size)`, read from the cache when an
    entry with this key exists, else computed (once, under the key's file lock) and stored.
    cache=False: computed, nothing read or written. compute: what computes them, when the caller
    computes the bytes anyway (`offline.decode_and_force`: the same bytes and the pass); it must
    return exactly what `continuations` would; an entry read is compared with its bytes.

    An entry read is checked before it is returned: contents the config cannot produce (ids outside
    the vocabulary, longer than max_new_tokens, ...) and, without `compute`, any byte the verifier
    contradicts (`offline.contradiction`: one verifier pass; verify=False skips it, for a caller that
    checks the bytes against its own pass; check: what checks them instead, -> why not or None, as
    `cached_pass` does on the pass it needs anyway) give one warning line naming the file, and the
    continuations are recomputed and stored again."""
    from filelock import FileLock

    from mtpc.speculative import offline

    given = compute is not None
    if compute is None:

        def compute() -> list[list[int]]:
            return offline.continuations(backbone, prompts, cfg, seeds=seeds, batch_size=batch_size)

    if not cache:
        return compute()
    if cfg.mode == "sample" and (seeds is None or len(seeds) != len(prompts)):
        return compute()  # continuations raises its own error
    key, parts = continuation_key(backbone, prompts, cfg, seeds, batch_size)
    root = root or cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(root / f"{key}.lock"), mode=0o666)
        lock.acquire()
    except OSError as e:
        warnings.warn(f"continuation cache: {root} cannot be used ({e}); computing without it", stacklevel=2)
        return compute()
    try:
        path = entry_path(key, root)
        ys = _read(path, key, len(prompts))
        if ys is not None:
            fresh = compute() if given else None
            if fresh is not None:
                why = None if fresh == ys else "its bytes differ from the ones computed now"
            elif check is not None:
                why = _impossible(backbone, prompts, ys, cfg) or check(ys)
            elif verify:
                why = offline.contradiction(backbone, prompts, ys, cfg, seeds)
            else:
                why = _impossible(backbone, prompts, ys, cfg)
            if why is None:
                return ys
            warnings.warn(f"continuation cache: {path} does not hold this model's continuations ({why}); "
                          "recomputing it", stacklevel=2)  # fmt: skip
            ys = fresh
        ys = compute() if ys is None else ys
        remove_stale_temps(root, path.name)
        entry = {
            "format": FORMAT,
            "key": key,
            "parts": parts,
            "continuations": ys,
            "sha256": _checksum(key, ys),
        }
        try:
            write_json(path, entry, separators=(",", ":"))
        except OSError as e:
            warnings.warn(
                f"continuation cache: could not store {path} ({e}); continuing without it", stacklevel=2
            )
        return ys
    finally:
        lock.release()


def cached_pass(backbone: Backbone, prompts: list[Tensor], cfg: Any, seeds: list[int] | None = None,
                batch_size: int = 1, *, cache: bool = True, root: Path | None = None,
                force_batch: int = 8) -> Any:  # fmt: skip
    """`offline.teacher_force` over `cached_continuations(...)` (-> `TeacherForced`), an entry read
    checked on that very pass (`teacher_force(check=True)`) rather than on one of its own: for an
    evaluation that needs the pass anyway, a hit costs one pass, not two. force_batch: the pass's
    batch size on the HF layers."""
    from mtpc.speculative import offline

    seen = []

    def check(ys: list[list[int]]) -> str | None:
        seen.append(offline.teacher_force(backbone, prompts, ys, cfg, force_batch, seeds=seeds, check=True))
        return seen[-1].contradiction

    ys = cached_continuations(backbone, prompts, cfg, seeds, batch_size, cache=cache, root=root, check=check)
    if seen and seen[-1].contradiction is None:
        return seen[-1]  # the entry read, trusted on its pass
    return offline.teacher_force(backbone, prompts, ys, cfg, force_batch)
