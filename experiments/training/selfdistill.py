"""Self-distillation data: the backbone's own answers to the training prompts, as a training source.

    python -m experiments.training.selfdistill --backbone default --source sharegpt --conversations 2000 \
        [--temperature 1.0 --max-new-tokens 256 --seed 0] [--out file.jsonl]

For each of the first `--conversations` training conversations of `--source` (the training split
only: held-out prompts never appear), the first user turn is answered by the backbone with plain
decoding (`MtpcModel.generate_plain`, sampling at `--temperature`, EOS allowed, at most
`--max-new-tokens` bytes; prompt i of the list uses seed + i, so a resumed run writes what an
uninterrupted one would). Answers are appended to a JSONL of messages records
`{"id", "messages": [user, assistant], "truncated", "seed"}` (`truncated`: stopped by the length
cap, not by EOS), flushed line by line: a killed run resumes where it stopped (a half-written last
line is dropped). The file lives under `<cache_dir>/selfdistill/` named by backbone, source,
temperature, cap and seed (`self_data_path`), with the settings in a `.json` beside it; a run with
other settings gets another file. Prompts whose rendered chat plus the cap exceed the backbone's
context are skipped and counted. Text is stored as UTF-8 (invalid bytes become U+FFFD).

Training reads it with `data.extra_train_source: <file>` (added to the training split of
`data.source`, e.g. ShareGPT, whose held-out chats stay the validation set) or as `data.source`.
Leaves out: the training itself (fit.py, datamodule.py) and the decoding loop (mtpc.speculative).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

SELF_DIR = "selfdistill"


def self_data_path(
    backbone: str,
    source: str,
    temperature: float,
    max_new_tokens: int,
    seed: int,
    cache: str | Path | None = None,
) -> Path:
    """Where the answers of `backbone` for `source`'s training prompts are cached."""
    from mtpc.paths import cache_dir

    root = Path(cache).expanduser() if cache is not None else cache_dir()
    slug = re.sub(
        r"[^A-Za-z0-9._@=-]+",
        "_",
        f"{backbone}-{Path(source).name}-T{temperature:g}-n{max_new_tokens}-s{seed}",
    )
    return root / SELF_DIR / f"{slug}.jsonl"


def _first_user_turn(conv: dict) -> str | None:
    for m in conv.get("messages", []):
        if m.get("role") == "user" and isinstance(m.get("content"), str) and m["content"].strip():
            return m["content"]
    return None


def _done_ids(path: Path) -> set[str]:
    """Ids already written; a half-written last line (a killed run) is cut off the file."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    keep = data[: data.rfind(b"\n") + 1]
    if len(keep) != len(data):
        path.write_bytes(keep)
    return {json.loads(line)["id"] for line in keep.decode("utf-8").splitlines() if line.strip()}


def generate_self_data(
    model: Any,
    prompts: list[tuple[str, str]],
    path: str | Path,
    *,
    temperature: float = 1.0,
    max_new_tokens: int = 256,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, int]:
    """Answer each (id, user text) of `prompts` with `model.generate_plain` (sampling, EOS allowed) and
    append messages records to `path`, skipping ids already there. Returns counts
    {"written", "already_done", "skipped_too_long", "truncated"}."""
    from tqdm import tqdm

    if not temperature > 0:
        raise ValueError(f"temperature: expected a number > 0 (sampling), got {temperature!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an integer >= 1, got {max_new_tokens!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    done = _done_ids(path)
    counts = {"written": 0, "already_done": 0, "skipped_too_long": 0, "truncated": 0}
    eos = getattr(model.backbone, "eos_token_id", None)
    limit = getattr(model.backbone, "max_context", None)
    with path.open("a", encoding="utf-8") as f:
        bar = tqdm(
            total=len(prompts),
            desc="self-distillation data",
            unit="answer",
            disable=not progress,
            file=sys.stderr,
        )
        for i, (conv_id, text) in enumerate(prompts):
            bar.update()
            rid = f"{conv_id}#self"
            if rid in done:
                counts["already_done"] += 1
                continue
            ids = model.encode_prompt(text)
            if limit is not None and ids.shape[0] + max_new_tokens + 2 > limit:
                counts["skipped_too_long"] += 1
                continue
            out = model.generate_plain(
                ids,
                max_new_tokens=max_new_tokens,
                mode="sample",
                temperature=temperature,
                seed=seed + i,
                ban_eos=False,
            )
            generated = out.ids.tolist()
            truncated = not generated or generated[-1] != eos
            answer = model.tokenizer.decode_text(generated)
            rec = {
                "id": rid,
                "messages": [{"role": "user", "content": text}, {"role": "assistant", "content": answer}],
                "truncated": truncated,
                "seed": seed + i,
            }
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            f.flush()
            counts["written"] += 1
            counts["truncated"] += truncated
        bar.close()
    return counts


def training_prompts(source: str, conversations: int, val_fraction: float = 0.02) -> list[tuple[str, str]]:
    """(id, first user turn) of the first `conversations` training conversations of `source`."""
    from experiments.training.datamodule import load_split

    if conversations < 1:
        raise ValueError(f"--conversations: expected an integer >= 1, got {conversations}")
    train = load_split(source, val_fraction)[0]  # (train, held-out, skipped records)
    out = []
    for conv in train:
        text = _first_user_turn(conv)
        if text is not None:
            out.append((str(conv["id"]), text))
        if len(out) == conversations:
            break
    return out


def build(
    backbone: str,
    source: str,
    conversations: int,
    *,
    temperature: float = 1.0,
    max_new_tokens: int = 256,
    seed: int = 0,
    out: str | Path | None = None,
    cache: str | Path | None = None,
    progress: bool = True,
    tiny_seed: int = 0,
) -> tuple[Path, dict[str, int]]:
    """Load `backbone` (as training does), pick the prompts and generate (resuming) into the cache file."""
    from experiments.training.module import build_backbone
    from mtpc import MtpcModel

    adapter = build_backbone(backbone, 0, tiny_seed=tiny_seed)
    model = MtpcModel.from_components(
        adapter, {"kind": "ff", "window": 2}
    )  # plain decoding only: the head is unused
    label = getattr(adapter, "name", "") or backbone
    path = (
        Path(out)
        if out is not None
        else self_data_path(label, source, temperature, max_new_tokens, seed, cache)
    )
    settings = {
        "backbone": label,
        "source": source,
        "temperature": temperature,
        "max_new_tokens": max_new_tokens,
        "seed": seed,
        "decoding": "plain (MtpcModel.generate_plain), sample, EOS allowed",
    }
    meta = path.with_suffix(".json")
    if meta.exists() and json.loads(meta.read_text()) != settings:
        raise ValueError(
            f"{path}: written with other settings ({meta.read_text().strip()}); choose another --out"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    meta.write_text(json.dumps(settings, indent=2) + "\n")
    prompts = training_prompts(source, conversations)
    counts = generate_self_data(
        model,
        prompts,
        path,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        seed=seed,
        progress=progress,
    )
    return path, counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m experiments.training.selfdistill", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument(
        "--backbone", default="default", help="`default`, `tiny`, a local HF directory or a hub name"
    )
    ap.add_argument(
        "--source", default="sharegpt", help="whose training prompts: `sharegpt`, `debug` or a messages file"
    )
    ap.add_argument("--conversations", type=int, required=True, help="how many training prompts to answer")
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the answers")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="length cap of an answer (bytes)")
    ap.add_argument("--seed", type=int, default=0, help="prompt i is sampled with seed + i")
    ap.add_argument(
        "--out", default=None, help="JSONL path (default: under the mtpc cache, named by the settings)"
    )
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    try:
        path, counts = build(
            args.backbone,
            args.source,
            args.conversations,
            temperature=args.temperature,
            max_new_tokens=args.max_new_tokens,
            seed=args.seed,
            out=args.out,
            progress=not args.no_progress,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{counts}; train on it with data.extra_train_source={path}")
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
