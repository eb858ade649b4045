"""Train one MtPC head from the command line (`python -m experiments.train fit`): the CLI only.

    python -m experiments.train fit --config experiments/configs/debug.yaml [--model.circuit hmm] [--ckpt_path last]

Parses one `TrainConfig` through jsonargparse (`--config` files, `--section.key` flags; a wrong value
names the file or flag that set it), checks it and the trainer settings before anything loads, then
runs `experiments.training.fit.train_head` (the run itself: docs/training.md) and prints where the
head went and its final metrics. `--mlflow_run_id RUN` logs into an existing run and leaves it open
(a multi-rank sweep trial's child command: experiments/training/launch.py).
Exit codes: 0 done, 2 bad config, data or resume path (one line naming file and key),
3 stopped by SIGUSR1, 143 stopped by SIGTERM, 130 stopped by SIGINT (each after writing
`checkpoints/last.ckpt`; resume with `--ckpt_path last`), 74 a write failed (e.g. no space left;
one line naming the path). A stop signal after the last optimizer step lets the validation and
export finish (exit 0, said in a line).
Leaves out: the training run (experiments/training/), evaluation and sweeps.
"""

from __future__ import annotations

import json
import re
import signal
import sys

from experiments.training.config import TrainConfig, from_namespace
from experiments.training.fit import check_trainer, train_head

__all__ = ["STOP_CODES", "main", "parse_cli"]


def parse_cli(argv: list[str] | None) -> tuple[TrainConfig, str | None, str | None]:
    """`fit [--config FILE]... [--section.key VALUE]...` -> (config, ckpt_path, mlflow_run_id); ValueError with one line."""
    from jsonargparse import ArgumentParser

    from experiments.plumbing.parsing import blame, check_cli_class_paths, source_of
    from experiments.training.config import build_fit_parser

    check_cli_class_paths(
        list(sys.argv[1:] if argv is None else argv)
    )  # before anything is parsed (and imported)
    root = ArgumentParser(
        prog="python -m experiments.train",
        exit_on_error=False,
        description="Train one MtPC head (docs/training.md).",
    )
    sub = root.add_subcommands(required=True, dest="subcommand")
    sub.add_subcommand("fit", build_fit_parser(), help="train one head and export it")
    sources = _key_sources(list(argv if argv is not None else sys.argv[1:]))
    try:
        ns = root.parse_args(argv)
    except Exception as err:  # jsonargparse's ArgumentError: say it in one line, usage on request (--help)
        message = " ".join(str(err).split())
        named = re.match(r'Parser key "([^"]+)": (.*)', message)  # a wrong type: name where that key was set
        where = source_of(named.group(1), sources) if named else None
        if named and where:
            raise ValueError(f"{where}: {named.group(1)}: {named.group(2)}") from None
        raise ValueError(f"{message} (python -m experiments.train fit --help lists the options)") from None
    fit = ns.fit
    files = [str(f) for f in (fit.get("config") or []) if f is not None]
    cfg = from_namespace(fit, ", ".join(files) or "<command line>")
    try:
        check_trainer(cfg.check())
    except ValueError as err:
        raise ValueError(blame(str(err), cfg.source, sources)) from None
    return cfg, fit.ckpt_path, fit.mlflow_run_id


def _key_sources(argv: list[str]) -> dict[str, str]:
    """Where each key of a `fit` command line was set last (`experiments.plumbing.parsing.key_sources`)."""
    from experiments.plumbing.parsing import key_sources
    from experiments.training.config import fit_parser

    return key_sources(
        argv,
        fit_parser().get_defaults().as_dict(),
        "python -m experiments.train fit --help lists the options",
        skip=("fit",),
    )


#: exit code of a run stopped by a signal (after its checkpoint): SIGUSR1 3, else 128 + the signal number
STOP_CODES = {signal.SIGUSR1: 3, signal.SIGTERM: 128 + signal.SIGTERM, signal.SIGINT: 128 + signal.SIGINT}


def main(argv: list[str] | None = None) -> int:
    from experiments.plumbing.quiet import quiet

    quiet()
    try:
        cfg, ckpt_path, mlflow_run_id = parse_cli(argv)
        result = train_head(cfg, ckpt_path=ckpt_path, mlflow_run_id=mlflow_run_id)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a write failed: mtpc.atomic names the path ("no space left" for a full disk)
        print(f"error: {err.strerror or err}", file=sys.stderr)
        return 74
    except KeyboardInterrupt:  # Ctrl-C twice, or once after the last step and again during the export
        print(
            "error: interrupted; no head exported (checkpoints/last.ckpt holds the last saved step: resume "
            "with --ckpt_path last)",
            file=sys.stderr,
        )
        return 130
    if result.preempted:
        name = signal.Signals(result.stop_signal).name if result.stop_signal else "request"
        print(f"stopped by {name}: checkpoint in {result.checkpoint_dir}; resume with --ckpt_path last")
        return STOP_CODES.get(result.stop_signal, 3)
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    if rank_zero_only.rank != 0:  # the other ranks of a multi-process run say nothing
        return 0
    print(f"head exported to {result.head_dir}")
    if result.late_signal is not None:
        print(
            f"{signal.Signals(result.late_signal).name} arrived after the last training step: the run finished "
            "its final validation and export instead of stopping"
        )
    print(json.dumps({k: round(v, 5) for k, v in result.metrics.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
