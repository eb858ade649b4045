"""The evaluation's command line: one `EvalConfig` (flags `--eval.<field>` and/or a `--config` YAML),
the heads to evaluate, where the results go.

    python -m experiments.evaluate --head <dir> [--ff-head <dir>] --out results.json \
        [--config eval.yaml] [--eval.modes greedy,sample] [--eval.n_prompts 16] [--eval.sets 1] \
        [--eval.temperatures 1.0,0.7] [--eval.acceptance offline|online] [--eval.stp false] ... \
        [--device cpu|cuda[:i]|mps] [--threads N] [--mlflow-parent-run <id>]

Every `EvalConfig` field (experiments/training/config.py: the settings a sweep spec's `eval` section and a
sweep trial use too) is a flag `--eval.<field>` and a key of the `eval:` section of a `--config`
file, with its defaults; a list field takes one value, a comma list or a YAML list
(`--eval.modes greedy`, `--eval.eos banned,allowed`). `EvalConfig.check` is the one rule on their
values; an error names the flag or file that set the value, in one line, exit 2. The other flags
(head, backbone, device, output, MLflow) may also be keys of the `--config` file (`head: runs/x/head`).

Checked before any weights load: the values, `--threads`, `--device` (a GPU that is there),
`--out` (writable), the head directories, `--mlflow-parent-run` (the run exists in the store) and
the prompts; before anything decodes: every prompt fits the backbone's context
(experiments/evaluation/decoding.py). A results file that cannot be written (a full disk) prints one line
naming the path, then the results on stdout as JSON (nothing lost), and exits 74.

Leaves out: the evaluation itself (experiments/evaluation/decoding.py), the prompts (experiments/evaluation/prompts.py).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from experiments.evaluation.config import EvalConfig

PROG = "python -m experiments.evaluate"
#: the flags of the command line before `EvalConfig` was its one front door -> their spelling now
RENAMED = {"--prompts": "--eval.prompts", "--num-prompts": "--eval.n_prompts", "--sets": "--eval.sets",
           "--max-new-tokens": "--eval.max_new_tokens", "--mode": "--eval.modes", "--extra-token": "--eval.extra_token",
           "--temperature": "--eval.temperatures", "--top-p": "--eval.top_p", "--seed": "--eval.seed",
           "--acceptance": "--eval.acceptance", "--latency-prompts": "--eval.latency_prompts",
           "--no-continuation-cache": "--eval.continuation_cache false", "--eos": "--eval.eos"}  # fmt: skip
EX_IOERR = 74  # a write failed (sysexits.h), as `experiments.train`


def build_parser() -> Any:
    """The jsonargparse parser: --config, --eval.* (EvalConfig's fields and docstrings), the plain flags."""
    from jsonargparse import ActionConfigFile, ArgumentParser

    from experiments.plumbing.parsing import docstring_settings

    docstring_settings()
    p = ArgumentParser(prog=PROG, exit_on_error=False, description=__doc__.split("\n\n")[0])
    p.add_argument(
        "-c",
        "--config",
        action=ActionConfigFile,
        help="a YAML file: an `eval:` section (EvalConfig's fields) and any flag below by its name (head, out, ...)",
    )
    p.add_class_arguments(EvalConfig, "eval")
    p.add_argument(
        "--head",
        type=str | None,
        default=None,
        help="head export directory (save_head), or a shipped head: default, shipped:<name>; required",
    )
    p.add_argument(
        "--allow-unverified-head",
        action="store_true",
        help="load head exports that carry no SHA-256s (older exports; mtpc.heads.migrate_head adds them)",
    )
    p.add_argument(
        "--ff-head",
        type=str | None,
        default=None,
        help="an ff head export evaluated alongside (speedup_vs_ff)",
    )
    p.add_argument(
        "--backbone", type=str | None, default=None, help="override the backbone recorded in the head"
    )
    p.add_argument(
        "--device",
        type=str | None,
        default=None,
        help="cpu, cuda, cuda:<i>, mps (default: where the backbone loads)",
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let the backbone's checkpoint run its own modelling code (a hub id also needs --revision)",
    )
    p.add_argument(
        "--revision", type=str | None, default=None, help="the hub commit hash of the backbone to load"
    )
    p.add_argument("--out", type=str | None, default=None, help="results JSON path; required")
    p.add_argument(
        "--mlflow-parent-run",
        type=str | None,
        default=None,
        help="log one child run per (mode, temperature, eos, prompt_set) under this existing run",
    )
    p.add_argument(
        "--mlflow-tracking-uri",
        type=str | None,
        default=None,
        help="default: $MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlflow.db",
    )
    p.add_argument(
        "--threads",
        type=int | None,
        default=None,
        help="torch intra-op threads, >= 1 (1 is steadier on a shared CPU)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument(
        "--evabyte-mtp",
        action="store_true",
        help="also run EvaByte's own multi-byte decoding (greedy, truncated to the budget) as a baseline",
    )
    return p


_LIST_FIELDS = tuple(
    f"--eval.{f.name}" for f in dataclasses.fields(EvalConfig) if str(f.type).startswith("tuple")
)


def _normalize(argv: list[str]) -> list[str]:
    """A list field's plain value or comma list as a YAML list (`greedy,sample` -> `[greedy,sample]`); an
    old flag spelling refused naming the new one."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        name, eq, value = token.partition("=")
        if name in RENAMED:
            raise ValueError(
                f"{name}: renamed {RENAMED[name]} (every evaluation setting is an --eval.<field> flag; "
                f"{PROG} --help lists them)"
            )
        if name in _LIST_FIELDS:
            if not eq and i + 1 < len(argv):
                value, i = argv[i + 1], i + 1
            if not value.lstrip().startswith("["):
                value = f"[{value}]"
            out += [name, value]
        else:
            out.append(token)
        i += 1
    return out


def parse_cli(argv: list[str]) -> tuple[EvalConfig, Any]:
    """The command line -> (the checked EvalConfig, the namespace of the other flags); ValueError with
    one line naming the flag or file of a bad value. Loads nothing."""
    from experiments.plumbing.parsing import Fail, blame, check_cli_class_paths, key_sources, one_line

    argv = _normalize(list(argv))
    check_cli_class_paths(argv)  # a --config naming a class_path is refused before anything is parsed
    parser = build_parser()
    sources = key_sources(argv, parser.get_defaults().as_dict(), f"{PROG} --help lists the options")
    try:
        ns = parser.parse_args(argv)
    except Exception as err:  # noqa: BLE001 (jsonargparse's ArgumentError: say it in one line)
        raise ValueError(f"{one_line(err)} ({PROG} --help lists the options)") from None

    files = [str(f) for f in (ns.get("config") or []) if f is not None]
    source = ", ".join(files) or "<command line>"
    try:
        evaluation = EvalConfig(**ns.eval.as_dict()).check(Fail(source))
    except ValueError as err:
        raise ValueError(blame(str(err), source, sources)) from None
    for flag in ("head", "out"):
        if not ns.get(flag):
            raise ValueError(f"--{flag}: required ({PROG} --help lists the options)")
    return evaluation, ns


def check_threads(threads: int | None) -> None:
    if threads is not None and threads < 1:
        raise ValueError(f"--threads {threads}: expected an integer >= 1 (torch intra-op threads)")


def check_device(device: str | None) -> None:
    """`--device` names a device of this machine: cpu, cuda[:i] with that GPU present, mps where it is available."""
    if device is None:
        return
    import torch

    try:
        d = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device {device!r}: not a device; expected cpu, cuda, cuda:<i> or mps") from None
    if d.type == "cpu":
        return
    if d.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise ValueError(f"--device {device}: no CUDA GPU on this machine; expected cpu")
        if d.index is not None and d.index >= n:
            raise ValueError(f"--device {device}: this machine has {n} CUDA GPU(s) (cuda:0..cuda:{n - 1})")
        return
    if d.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"--device {device}: MPS is not available on this machine; expected cpu")
        return
    raise ValueError(
        f"--device {device}: {d.type} devices are not supported; expected cpu, cuda, cuda:<i> or mps"
    )


def check_parent_run(run_id: str, tracking_uri: str | None) -> None:
    """The MLflow parent run exists in the store (found before anything decodes, not after)."""
    import tracking
    from tracking.store import sqlite_path

    resolved = tracking.resolve_uri(explicit=tracking_uri, explicit_source="--mlflow-tracking-uri")
    db = sqlite_path(resolved.uri)
    if db is not None and not db.is_file():
        raise ValueError(
            f"--mlflow-parent-run {run_id}: no MLflow store at {db} (the tracking URI from {resolved.source})"
        )
    try:
        tracking.client(resolved.uri).get_run(run_id)
    except Exception as err:  # noqa: BLE001 (MlflowException: RESOURCE_DOES_NOT_EXIST, or a store that does not answer)
        raise ValueError(
            f"--mlflow-parent-run {run_id}: no such run in {resolved.uri} ({tracking.short(err, 160)})"
        ) from None


def check_heads(ns: Any) -> None:
    """Each head flag names a head export folder, or a shipped head ('default', 'shipped:<name>'),
    checked against its index here (mtpc.shipped_heads)."""
    from mtpc.shipped_heads import is_shipped_name, resolve_head

    for flag in ("head", "ff_head"):
        d = ns.get(flag)
        name = f"--{flag.replace('_', '-')}"
        if is_shipped_name(d):
            try:
                d = str(resolve_head(d))
            except (ValueError, FileNotFoundError) as e:
                raise ValueError(f"{name}: {e}") from None
        if d is not None and not Path(d).expanduser().is_dir():
            raise ValueError(f"{name}: {d!r} does not exist or is not a directory")
        if d is not None and not (Path(d).expanduser() / "config.json").is_file():
            raise ValueError(f"{name}: {d!r} is not a head export (no config.json)")


def main(argv: list[str] | None = None) -> int:
    from experiments.plumbing.quiet import quiet

    quiet()
    try:
        evaluation, ns = parse_cli(sys.argv[1:] if argv is None else argv)
        check_threads(ns.threads)
        check_device(ns.device)
        from mtpc.atomic import check_writable

        check_writable(ns.out, "--out")  # before anything decodes: the results must have a place to go
        check_heads(ns)
        if ns.mlflow_parent_run:
            check_parent_run(ns.mlflow_parent_run, ns.mlflow_tracking_uri)
        from experiments.evaluation.prompts import eval_prompt_sets

        prompt_sets, set_names = eval_prompt_sets(evaluation)
        import torch

        if ns.threads is not None:
            torch.set_num_threads(ns.threads)
        results = _evaluate(evaluation, ns, prompt_sets, set_names)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return _report(results, ns)


def _evaluate(
    evaluation: EvalConfig, ns: Any, prompt_sets: list[list[str]], set_names: list[str]
) -> dict[str, Any]:
    from experiments.evaluation.decoding import evaluate_heads
    from mtpc import MtpcModel

    load_kw = {"device": ns.device} if ns.device else {}
    if ns.trust_remote_code or ns.revision:
        load_kw.update(trust_remote_code=ns.trust_remote_code, revision=ns.revision)
    main_model = MtpcModel.from_pretrained(
        ns.head, backbone=ns.backbone, allow_unverified=ns.allow_unverified_head, **load_kw
    )
    models = {"head": main_model}
    if ns.ff_head:
        ff = _load_sharing_backbone(ns.ff_head, main_model, ns.allow_unverified_head)
        if ff.head.config.kind != "ff":
            raise ValueError(f"--ff-head: {ns.ff_head} holds a {ff.head.config.kind} head, not ff")
        models["ff"] = ff
    results = evaluate_heads(
        models,
        prompt_sets,
        evaluation,
        set_names=set_names,
        ff_name="ff" if ns.ff_head else None,
        progress=not ns.no_progress,
        evabyte_mtp=ns.evabyte_mtp,
    )
    results["config"].update(
        {
            "head_dir": str(ns.head),
            "ff_head_dir": ns.ff_head,
            "prompts": evaluation.prompts,
            "eval": dataclasses.asdict(evaluation),
        }
    )
    return results


def _report(results: dict[str, Any], ns: Any) -> int:
    """Write the results (a full disk: one line, then the results on stdout), print the summary, log to MLflow."""
    from experiments.evaluation.decoding import degeneracy_warnings, log_evaluation_to_mlflow
    from mtpc.atomic import write_json
    from tracking.schema import DEGENERACY_METRICS

    out = Path(ns.out).expanduser()
    rc = 0
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_json(out, results, indent=2)
    except OSError as err:  # mtpc.atomic names the path ("no space left" for a full disk); keep the results
        print(f"error: {err.strerror or err}; the results follow on stdout as JSON", file=sys.stderr)
        print(json.dumps(results, indent=2))
        rc = EX_IOERR
    for row in results["summary"]:
        m = {
            k: f"{row[k]['mean']:.4g}±{row[k]['std']:.2g}"
            for k in (
                "mu_acc",
                "tokens_per_cycle",
                "speedup_vs_stp",
                "derived_speedup_vs_stp",
                *DEGENERACY_METRICS,
            )
            if k in row
        }
        line = (
            f"{row['head']:>5} {row['circuit']:>5} n={row['window']} {row['mode']}/{row['extra_token']}/eos {row['eos']} "
            f"T={row['temperature']} ({row['acceptance_method']}): {m}"
        )
        print(
            line, file=sys.stderr if rc else sys.stdout
        )  # stdout holds the JSON alone when it carries the results
    for line in degeneracy_warnings(results["summary"]):
        print(line, file=sys.stderr)
    if ns.mlflow_parent_run:
        ids = log_evaluation_to_mlflow(results, ns.mlflow_parent_run, tracking_uri=ns.mlflow_tracking_uri)
        print(
            f"logged {len(ids)} child runs under {ns.mlflow_parent_run}",
            file=sys.stderr if rc else sys.stdout,
        )
    if not rc:
        print(f"wrote {out}")
    return rc


def _load_sharing_backbone(head_dir: str, main: Any, allow_unverified: bool = False) -> Any:
    """Load a second head on the main model's backbone weights (a new adapter if its lora_depth differs)."""
    from mtpc import MtpcModel
    from mtpc.heads import load_head
    from mtpc.shipped_heads import resolve_head

    head_dir = str(resolve_head(head_dir))
    head, _ = load_head(head_dir, allow_unverified=allow_unverified)
    bb = main.backbone
    if head.config.lora_depth == bb.lora_depth and head.config.lora_depth == 0:
        return MtpcModel.from_pretrained(head_dir, backbone=bb, allow_unverified=allow_unverified)
    m = MtpcModel.from_pretrained(head_dir, backbone=bb.model, allow_unverified=allow_unverified)
    m.backbone.tokenizer = bb.tokenizer
    return m


if __name__ == "__main__":
    raise SystemExit(main())
