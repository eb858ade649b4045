"""Ship a trained head beside the default backbone: `mtpc/default_heads/<name>/` and its index entry.

    python -m experiments.shipping.ship_head RUN_DIR --name btree-n8-r16 --default \\
        --report bench/results/shipped_head_cpu.json
    python -m experiments.shipping.ship_head --update btree-n8-r16 --draft-len 4 \\
        --report bench/results/shipped_head_cpu.json      (re-measured, the head untouched)

RUN_DIR is a finished `experiments.train fit` run directory (its `run.json`, `metrics.json` and head
export, `run.export_dir`). The head is stored in bf16 (loaded to the backbone's dtype: float32 on the
CPU), checked to fit `mtpc.shipped_heads.MAX_HEAD_BYTES`, and given a model card: the training data,
steps and bytes, the command that trained it, and — from `--report`, the JSON of
`bench/bench_shipped_head.py` run on this very head — its held-out speed-up over plain decoding with
the text's degeneracy, the command and the machine. The index (`INDEX.json`) records every file's
SHA-256, checked at each load (`mtpc.shipped_heads`). Only heads trained on the shipped backbone ship.
Leaves out: training (experiments/training/), measuring (bench/bench_shipped_head.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from mtpc.atomic import sha256_file, write_json, write_text
from mtpc.backbones.shipped import SHIPPED_DIR, verify_shipped
from mtpc.heads import load_head, save_head
from mtpc.names import check_draft_len
from mtpc.shipped_heads import CARD_FILE, DEFAULT, HEADS_DIR, INDEX_FILE, MAX_HEAD_BYTES, NAME


def _card(
    name: str,
    head: Any,
    run: dict[str, Any],
    metrics: dict[str, Any],
    report: dict[str, Any] | None,
    label: str,
) -> str:
    cfg = run["config"]
    m, d = cfg["model"], cfg["data"]
    steps = metrics["steps"]
    rows = int(d.get("global_batch_size") or d["batch_size"])  # rows per optimizer step
    lines = [
        f"# Shipped head `{name}`",
        "",
        f"An MtPC head for the shipped default backbone `{label}`: "
        f'`MtpcModel.from_pretrained("shipped:{name}")` (`"default"` loads the head that '
        "`mtpc/default_heads/INDEX.json` names its default).",
        "",
        f"- **Circuit**: {head.config.kind}, window n = {head.config.window}, rank r = {head.config.rank}, "
        f"leaves {'App. G (rank-' + str(head.config.leaf_delta_rank) + ' deltas)' if head.config.leaf_delta_rank else 'full'}, "
        f"LoRA depth k = {head.config.lora_depth}"
        f"{'; reads the known byte c (e_t + E[c]: scored on positions 2..n, keep cycle only)' if head.config.known_byte else ''}"
        "; stored in bf16, loaded to the backbone's dtype.",
        f"- **Training**: the window loss with distillation weight beta = {m['kl_beta']} (temperature "
        f"{m.get('kl_temperature', 1.0)}), Adam lr {m['lr']}, {steps} optimizer steps of {rows} x {d['seq_len']} "
        f"bytes (~{int(steps) * rows * d['seq_len'] / 1e6:.1f} MB of text) on the bundled ShareGPT training "
        "split (held-out conversations never seen).",
    ]
    val = {k: v for k, v in metrics.items() if k.startswith("val") and isinstance(v, (int, float))}
    if val:
        lines.append(
            "- **Validation** (held-out rows, last step): "
            + ", ".join(f"{k} {v:.4f}" for k, v in sorted(val.items()))
        )
    if metrics.get("machine"):
        lines.append(f"- **Machine**: {metrics['machine']}")
    if metrics.get("command"):
        lines.append(f"- **Command**: `{metrics['command']}`")
    if report is not None:
        lines += ["", *_speed_section(report)]
    lines += [
        "",
        "The backbone is a tiny model trained for minutes: see its own card for what its text is worth.",
    ]
    return "\n".join(lines) + "\n"


def _report_rows(report: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """(mode, draft length, figures) per row of a bench_shipped_head report: one draft length per
    mode, or several (`--draft-lens`: {mode: {m: figures}})."""
    rows = []
    for mode, r in report["modes"].items():
        arms = r.items() if "speedup_median" not in r else [(str(r.get("draft_len", "-")), r)]
        rows += [(mode, str(m), fig) for m, fig in arms]
    return rows


def _speed_section(report: dict[str, Any], draft_len: int | None = None) -> list[str]:
    """The model card's held-out speed section from bench_shipped_head's JSON."""
    lines = [
        "## Held-out speed (plain and speculative decoding interleaved in one process)",
        "",
        f"Command: `{report['command']}`  ",
        f"Machine: {report['machine']}  ",
        f"Prompts: {report['prompts']}",
    ]
    if draft_len is not None:
        lines += [
            "",
            f"Decoding default: the cycle feeds the first **{draft_len}** bytes of the head's window "
            f"(`draft_len`, `MtpcModel.generate(draft_len=)` overrides it), chosen on the development prompts.",
        ]
    lines += [
        "",
        "| mode | draft length | speed-up over plain (median of rounds) | per-round | decoding alone "
        "(prefill excluded) | prefill's share of plain | bytes per cycle | degenerate fraction | "
        "distinct 4-grams | greedy identical |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, m, r in _report_rows(report):
        decode = f"{r['decode_speedup_median']:.2f}x" if "decode_speedup_median" in r else "-"
        share = f"{r['prefill_share_of_plain']:.2f}" if "prefill_share_of_plain" in r else "-"
        lines.append(
            f"| {mode} | {m} | {r['speedup_median']:.2f}x | {', '.join(f'{x:.2f}' for x in r['speedup_rounds'])} | "
            f"{decode} | {share} | {r['bytes_per_cycle']:.2f} | {r['degenerate_fraction']:.3f} | "
            f"{r['distinct_4gram_ratio']:.3f} | {r.get('identical', '-')} |"
        )
    return lines


def update_shipped(
    name: str, report_path: Path, draft_len: int | None = None, heads_dir: Path | None = None
) -> Path:
    """Re-measure a shipped head without retraining it: its model card's speed section from a new
    bench_shipped_head report, and (draft_len) its decoding default in the index; the card's digest
    re-recorded. The head's weights and config are untouched."""
    from mtpc.shipped_heads import read_index, verify_head

    heads_dir = heads_dir or HEADS_DIR
    index = read_index(heads_dir)
    if name not in index["heads"]:
        raise ValueError(
            f"--update {name!r}: no shipped head of that name; shipped: {sorted(index['heads'])}"
        )
    verify_head(name, index, heads_dir)
    head, _ = load_head(heads_dir / name)
    if draft_len is not None:
        check_draft_len(draft_len, head.config.window)
    report = json.loads(report_path.read_text())
    card_path = heads_dir / name / CARD_FILE
    card = card_path.read_text()
    start = card.find("## Held-out speed")
    tail = card.find("\nThe backbone is a tiny model")
    if tail < 0:
        raise ValueError(f"{card_path}: not a shipped head's model card (its closing line is missing)")
    if start < 0:  # shipped without a report: the section goes before the closing line
        start = tail + 1
    current = index["heads"][name].get("decode", {}).get("draft_len")
    shown = draft_len if draft_len is not None else current
    card = card[:start] + "\n".join(_speed_section(report, shown)) + "\n" + card[tail:]
    write_text(card_path, card)
    entry = index["heads"][name]
    entry["files"][CARD_FILE] = sha256_file(card_path)
    if draft_len is not None:
        entry["decode"] = {"draft_len": draft_len}
    write_json(heads_dir / INDEX_FILE, index, indent=2, sort_keys=True)
    return heads_dir / name


def ship(
    run_dir: Path,
    name: str,
    *,
    make_default: bool,
    report_path: Path | None,
    command: str | None = None,
    machine: str | None = None,
    heads_dir: Path | None = None,
) -> Path:
    if not NAME.match(name):
        raise ValueError(f"--name {name!r}: expected a lower-case name ({NAME.pattern})")
    heads_dir = heads_dir or HEADS_DIR
    run_file, metrics_file = run_dir / "run.json", run_dir / "metrics.json"
    for p in (run_file, metrics_file):
        if not p.is_file():
            raise ValueError(f"{p}: missing; expected a finished training run directory")
    run, metrics = json.loads(run_file.read_text()), json.loads(metrics_file.read_text())
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    metrics["steps"] = (
        torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"]
        if ckpt.is_file()
        else run["config"]["trainer"].get("max_steps")
    )
    metrics.update({k: v for k, v in (("command", command), ("machine", machine)) if v})
    export = Path(run["config"]["run"]["export_dir"] or run_dir / "head")
    head, lora = load_head(export)
    if lora:
        raise ValueError(f"{export}: a head with LoRA (k > 0) changes the backbone; only k = 0 heads ship")
    label = verify_shipped(SHIPPED_DIR)
    if head.config.backbone not in ("default", label):
        raise ValueError(
            f"{export}: trained on {head.config.backbone!r}; only heads of the shipped {label} ship"
        )
    report = json.loads(report_path.read_text()) if report_path else None
    index_path = heads_dir / INDEX_FILE
    index = json.loads(index_path.read_text()) if index_path.is_file() else {"backbone": label, "heads": {}}
    if index.get("backbone") != label:
        raise ValueError(
            f"{index_path}: the shipped heads are {index.get('backbone')}'s; the backbone is {label}"
        )
    heads_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=heads_dir, prefix=f".{name}.tmp") as tmp:
        staged = Path(tmp) / name
        head.config.backbone = label
        save_head(staged, head.to(torch.bfloat16))
        write_text(staged / CARD_FILE, _card(name, head, run, metrics, report, label))
        size = sum(p.stat().st_size for p in staged.iterdir())
        if size > MAX_HEAD_BYTES:
            raise ValueError(
                f"{export}: {size / 2**20:.1f} MiB in bf16; a shipped head must stay under "
                f"{MAX_HEAD_BYTES / 2**20:.0f} MiB (a smaller rank or App. G leaves)"
            )
        files = {p.name: sha256_file(p) for p in sorted(staged.iterdir())}
        target = heads_dir / name
        if target.exists():
            shutil.rmtree(target)
        staged.rename(target)
    index["heads"][name] = {"files": files}
    if make_default or DEFAULT not in index:
        index[DEFAULT] = name
    write_json(index_path, index, indent=2, sort_keys=True)
    return heads_dir / name


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m experiments.shipping.ship_head", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("run_dir", type=Path, nargs="?", help="a finished experiments.train run directory")
    ap.add_argument("--name", default=None, help="the shipped head's name (loaded as shipped:<name>)")
    ap.add_argument(
        "--update",
        default=None,
        metavar="NAME",
        help="re-measure shipped head NAME without retraining: its card's speed section from --report, "
        "its decoding default from --draft-len",
    )
    ap.add_argument(
        "--draft-len", type=int, default=None, help="with --update: bytes a cycle feeds by default"
    )
    ap.add_argument(
        "--default", action="store_true", help="make it the head from_pretrained('default') loads"
    )
    ap.add_argument(
        "--report", type=Path, default=None, help="bench/bench_shipped_head.py's JSON for this head"
    )
    ap.add_argument("--train-command", default=None, help="the command that trained it, for the model card")
    ap.add_argument("--train-machine", default=None, help="where it trained, for the model card")
    a = ap.parse_args(argv)
    if a.update is not None:
        if a.report is None or a.run_dir is not None:
            ap.error("--update NAME takes --report (and --draft-len), not a run directory")
        try:
            out = update_shipped(a.update, a.report, a.draft_len)
        except (ValueError, FileNotFoundError) as e:
            print(f"experiments.shipping.ship_head: {e}", file=sys.stderr)
            return 2
        print(f"updated {out}")
        return 0
    if a.run_dir is None or a.name is None:
        ap.error("a run directory and --name are required (or --update NAME)")
    try:
        out = ship(
            a.run_dir,
            a.name,
            make_default=a.default,
            report_path=a.report,
            command=a.train_command,
            machine=a.train_machine,
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"experiments.shipping.ship_head: {e}", file=sys.stderr)
        return 2
    print(f"shipped {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
