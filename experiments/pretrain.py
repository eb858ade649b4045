"""Pre-train the embedded default backbone: the command line (`python -m experiments.pretrain`, = `make pretrain`).

`python -m experiments.pretrain [--config cpu|gpu|PATH] [--set KEY=VALUE] [--out DIR] [--force]
[--run-dir DIR] [--background] [--ship]` trains a small byte-level Llama (vocab 320, `ByteTokenizer`)
on the ShareGPT training split (`experiments.pretraining.loop.pretrain`: two phases of row lengths,
an active-time budget), reports held-out bits per byte and saves a `from_pretrained` folder with
`pretrain_metrics.json` (loss and held-out curves, hardware, command, git SHA) to `--out` (default
`cache_dir()/models/pretrained`). With `--run-dir` the whole state is snapshotted there and a second
start with the same config resumes it exactly; SIGTERM/SIGINT snapshot and exit 128 + signal.
`--background`: nice 19, registered as pausable background work, so the suite's timers pause it
(experiments/plumbing/timing_lock.py). `--ship` then writes the repository's shipped form
(`experiments.shipping.ship_default`, which also ships a model trained earlier).

Exit codes: 0 done (or a model already at `--out`), 2 a bad config or an unusable snapshot (one line
naming the file), 74 a failed write (one line naming the path; "no space left" on a full disk), 128 +
signal when stopped. Leaves out: the settings, data, files and loop (`experiments/pretraining/`), MtPC
heads and LoRA (experiments/training/).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

import torch

from experiments.plumbing.parsing import parse_sets
from experiments.pretraining.config import CONFIGS, load_config
from experiments.pretraining.files import METRICS_FILE
from experiments.pretraining.loop import Interrupted, pretrain
from mtpc.backbones import pretrained_model_dir


@contextlib.contextmanager
def background(on: bool, run_dir: str | None):
    """Lowest priority, registered as pausable background work (experiments.plumbing.timing_lock), while `on`."""
    if not on:
        yield
        return
    from experiments.plumbing.timing_lock import register

    os.nice(19)
    with register(run_dir, what="pre-training"):
        yield


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.pretrain", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--config", default="auto", help="cpu, gpu, auto (gpu if CUDA is available) or a YAML path"
    )
    ap.add_argument("--out", default=None, help=f"output directory (default: {pretrained_model_dir()})")
    ap.add_argument("--force", action="store_true", help="retrain even if the output directory holds a model")
    ap.add_argument(
        "--ship",
        action="store_true",
        help="after training, write --out as a shipped default (bf16 shards, manifest, held-out score)",
    )
    ap.add_argument(
        "--ship-rows", type=int, default=1024, help="held-out rows of 2048 bytes scored when shipping"
    )
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field (YAML value)"
    )
    ap.add_argument(
        "--run-dir",
        default=None,
        help="snapshot the whole run state here and resume from it when started again (same config)",
    )
    ap.add_argument(
        "--background",
        action="store_true",
        help="run at the lowest CPU priority, registered as pausable background work, so the suite's "
        "timers pause it (SIGSTOP/SIGCONT) while they time (experiments.plumbing.timing_lock)",
    )
    args = ap.parse_args(argv)
    from experiments.plumbing.quiet import quiet

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
            if args.ship:
                from transformers import LlamaForCausalLM

                from experiments.shipping.ship_default import ship

                model = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
                metrics = ship(model, out, metrics, rows=args.ship_rows)
        except Interrupted as e:
            print(f"experiments.pretrain: {e}", file=sys.stderr)
            return 128 + e.signum
        except ValueError as e:  # a snapshot that cannot be resumed, data that cannot be used: names the file
            print(f"experiments.pretrain: {e}", file=sys.stderr)
            return 2
        except OSError as e:  # a write failed: mtpc.atomic names the path ("no space left" for a full disk)
            print(
                f"experiments.pretrain: {f'{e.filename}: ' if e.filename else ''}{e.strerror or e}",
                file=sys.stderr,
            )
            return 74
    print(json.dumps({k: v for k, v in metrics.items() if k not in ("config", "loss_curve")}, indent=2))
    print(f"saved to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
