"""Prepare the working tree for the one GPU device call: corpus streams, git SHA, size check.

`python -m experiments.shipping.device_prep [--pretrain] [--tiny]` writes, under `.device/` (git-ignored;
the device call names it in `carry`):
- with `--pretrain` only, `train.u8.xz`, `heldout.u8.xz`: the bundled ShareGPT training and
  held-out split as xz byte streams (`mtpc.data.write_stream`; training conversations shuffled with
  seed 0), which the GPU pre-training config reads and packs in seconds — rebuilt only when the
  corpus changes. `bench/device.sh` trains a new default only when they are there; without the flag
  they are removed, and the device call benchmarks the shipped (GPU-trained) default instead;
- `third_party/`: a copy of the target models' code (`$MTPC_THIRD_PARTY`, else
  `../shared/third_party`), which `bench/device.sh` part 3 reads there (`../shared` does not
  travel); git-ignored like the rest of `.device/`, never committed;
- `heldout_prompts.jsonl`: the bundled corpus's held-out prompt pool (one JSON string a line, in
  the corpus's order, so `load_prompt_sets` draws the same sets from it), and `heads/`: the trained
  heads of the shipped default found in the mtpc cache (`<cache>/heads/default-*`, as
  `bench/bench_offline.py` looks them up), for `bench/device.sh` part 4 (offline against online
  acceptance on the GPU; the corpus itself does not travel);
- `GIT_SHA`: the commit (the copy on the device has no .git; `experiments.pretrain` records it);
- `whl/`: wheels of the pure-Python packages the device image lacks (`DEVICE_WHEELS`: the
  config parser behind `experiments.pretrain --config`), fetched from PyPI for CPython 3.12;
  `bench/device.sh` installs them into a folder on PYTHONPATH there (nothing can be fetched there);
and then checks that everything that travels — tracked files, untracked files git does not
ignore, and `.device/` — is at most 60 MiB (the device tool takes 64 MiB); exit 1 if not.
`--tiny` writes small streams (200 / 50 conversations) for the CPU dry-run of `bench/device.sh`
(implies `--pretrain`).

Leaves out: running anything on the device (bench/device.sh does), training (experiments.pretrain).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

from mtpc.data import sharegpt_corpus, write_stream

ROOT = Path(__file__).resolve().parents[2]
DEVICE_DIR = ROOT / ".device"
LIMIT_MIB = 60
# the device image (KINDS.md's package list) has torch, transformers, peft, lightning, yaml, but not these
DEVICE_WHEELS = ["jsonargparse==4.53.0", "docstring-parser==0.18.0", "typeshed-client==2.15.0"]


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def travel_bytes(extra: list[Path]) -> dict[str, int]:
    """Bytes that the device call sends: tracked + untracked-not-ignored files + `extra` folders."""
    files = set(_git("ls-files", "-z").split("\0")) | set(
        _git("ls-files", "-z", "--others", "--exclude-standard").split("\0")
    )
    sizes = {"tracked+untracked": sum((ROOT / f).stat().st_size for f in files if f and (ROOT / f).is_file())}
    for d in extra:
        if d.exists():
            sizes[str(d.relative_to(ROOT))] = sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
    return sizes


def build_streams(tiny: bool) -> dict:
    corpus = sharegpt_corpus()
    train, heldout = list(corpus.train), list(corpus.heldout)
    random.Random(0).shuffle(train)  # the same order experiments.pretrain gives the conversations
    if tiny:
        train, heldout = train[:200], heldout[:50]
    key = {"corpus": corpus.stats, "tiny": tiny, "seed": 0}
    stamp = DEVICE_DIR / "streams.json"
    DEVICE_DIR.mkdir(exist_ok=True)
    if stamp.is_file() and json.loads(stamp.read_text()).get("key") == key:
        return json.loads(stamp.read_text())
    info = {"key": key}
    for name, convs in (("heldout", heldout), ("train", train)):
        print(f"writing .device/{name}.u8.xz ({len(convs)} conversations)...", flush=True)
        info[name] = write_stream(convs, DEVICE_DIR / f"{name}.u8.xz")
    stamp.write_text(json.dumps(info, indent=1) + "\n")
    return info


def fetch_wheels() -> None:
    """Pure-Python wheels for the device's CPython 3.12 into .device/whl (kept when already there)."""
    dest = DEVICE_DIR / "whl"
    have = {p.name.split("-")[0].lower().replace("_", "-") for p in dest.glob("*.whl")}
    need = [w for w in DEVICE_WHEELS if w.split("==")[0] not in have]
    if not need:
        return
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "--platform", "manylinux2014_x86_64", "-d", str(dest), *need]  # fmt: skip
    print(f"fetching wheels for the device: {' '.join(need)}", flush=True)
    subprocess.run(cmd, check=True)


def write_prompt_pool(pool: list[str], path: Path) -> None:
    """One JSON string a line, in the pool's order: `load_prompt_sets(path)` then draws what it draws from the pool."""
    path.write_text("".join(json.dumps(p, ensure_ascii=False) + "\n" for p in pool), encoding="utf-8")


def write_offline_inputs() -> None:
    """The held-out prompt pool and the cached default-model heads for bench_offline on the device."""
    from mtpc.paths import cache_dir

    DEVICE_DIR.mkdir(exist_ok=True)
    write_prompt_pool(sharegpt_corpus(progress=False).heldout_prompts, DEVICE_DIR / "heldout_prompts.jsonl")
    shutil.rmtree(DEVICE_DIR / "heads", ignore_errors=True)
    heads = sorted(p for p in (cache_dir() / "heads").glob("default-*") if (p / "config.json").is_file())
    for d in heads:
        shutil.copytree(d, DEVICE_DIR / "heads" / d.name)
    if not heads:
        print("warning: no trained default-model head in the cache: device.sh part 4 starts heads from the "
              "unembedding (see bench/bench_offline.py)", file=sys.stderr)  # fmt: skip


def copy_third_party() -> None:
    """The target models' code into .device/third_party (replaced each time), if found here."""
    for cand in (os.environ.get("MTPC_THIRD_PARTY"), ROOT.parent / "shared" / "third_party"):
        if cand and (Path(cand) / "evabyte_hf").is_dir():
            shutil.rmtree(DEVICE_DIR / "third_party", ignore_errors=True)
            shutil.copytree(cand, DEVICE_DIR / "third_party")
            return
    print(
        "warning: no third_party/evabyte_hf found: device.sh part 3 will fail (set MTPC_THIRD_PARTY)",
        file=sys.stderr,
    )


HEAD_TRAIN = "head_train.jsonl"
HEAD_TRAIN_MIB = 16
"""Training conversations carried for the GPU head training (the corpus does not travel)."""


def write_head_train(tiny: bool) -> int:
    """`.device/head_train.jsonl`: the first training conversations of the bundled ShareGPT split (its own
    order), up to HEAD_TRAIN_MIB MiB (tiny: 64 KiB), for the device call's head training (part 1b).
    Held-out conversations never travel there, so the heads' held-out figures stay held out."""
    from mtpc.data import sharegpt_corpus

    budget = (64 << 10) if tiny else HEAD_TRAIN_MIB << 20
    DEVICE_DIR.mkdir(exist_ok=True)
    n, size = 0, 0
    with open(DEVICE_DIR / HEAD_TRAIN, "w", encoding="utf-8") as f:
        for conv in sharegpt_corpus(progress=False).train:
            line = json.dumps(conv, ensure_ascii=False) + "\n"
            if size + len(line.encode()) > budget:
                break
            f.write(line)
            n, size = n + 1, size + len(line.encode())
    print(f"writing .device/{HEAD_TRAIN} ({n} conversations, {size / 2**20:.1f} MiB)", flush=True)
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m experiments.shipping.device_prep", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument(
        "--tiny", action="store_true", help="small streams for the CPU dry-run (implies --pretrain)"
    )
    ap.add_argument(
        "--pretrain", action="store_true", help="the corpus streams: the device call trains a new default"
    )
    ap.add_argument(
        "--no-heads",
        action="store_true",
        help="leave out the head-training conversations (part 1b of the device call trains the shipped head)",
    )
    args = ap.parse_args(argv)
    if args.pretrain or args.tiny:
        info = build_streams(args.tiny)
    else:  # nothing to train: the streams (~21 MiB) stay behind
        DEVICE_DIR.mkdir(exist_ok=True)
        for name in ("train.u8.xz", "heldout.u8.xz", "streams.json"):
            (DEVICE_DIR / name).unlink(missing_ok=True)
        info = {"train": 0, "heldout": 0}
    if args.no_heads:
        (DEVICE_DIR / HEAD_TRAIN).unlink(missing_ok=True)
    else:
        write_head_train(args.tiny)
    fetch_wheels()
    copy_third_party()
    write_offline_inputs()
    (DEVICE_DIR / "GIT_SHA").write_text(_git("rev-parse", "HEAD").strip() + "\n")
    sizes = travel_bytes([DEVICE_DIR, ROOT / ".whl"])
    total = sum(sizes.values())
    for k, v in sizes.items():
        print(f"{k:>20}: {v / 2**20:7.1f} MiB")
    streams = (
        f"; ids: train {info['train']:,}, heldout {info['heldout']:,}"
        if info["train"]
        else "; no corpus streams (no pre-training)"
    )
    print(f"{'total':>20}: {total / 2**20:7.1f} MiB (limit {LIMIT_MIB} MiB){streams}")
    if total > LIMIT_MIB * 2**20:
        print(f"error: the device call would send {total / 2**20:.1f} MiB > {LIMIT_MIB} MiB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
