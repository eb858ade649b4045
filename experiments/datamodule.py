"""LightningDataModule over chat data: load conversations, split held-out by id hash, pack rows.

Holds `ChatDataModule` (built from a `DataConfig`; sources: the bundled ShareGPT corpus, any
messages-format JSON/JSONL file or HF dataset name, or `debug`: a few KB of generated chat text for
CPU tests; `on_error: skip` drops malformed records, prints their count and keeps it as
`skipped_records`), the seeded per-epoch shuffle that resumes mid-epoch (`EpochSampler` +
`ResumableLoader`, whose state Lightning stores in the checkpoint), and `debug_conversations`.
Tokenising and packing (assistant mask, document ids) are `mtpc.data.pack`'s; this file leaves out
any model code.
"""

from __future__ import annotations

import random
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from experiments.config import DataConfig


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


def load_split(source: str, val_fraction: float, on_error: str = "raise") -> tuple[list[dict], list[dict], int]:
    """(train, held-out, skipped) conversations of `source` (see `DataConfig.source`).

    `sharegpt` uses the corpus's own chat-level split (the one the default model was pre-trained
    without); other sources are split by `mtpc.data.is_heldout(id, val_fraction)`, the hash
    pre-training splits them with, so with val_fraction <= 0.1 no validation chat was a pre-training
    chat. on_error: what `mtpc.data.load_messages` does with a malformed record (raise, or skip and count it).
    """
    from mtpc import data

    if source == "sharegpt":
        return *data.heldout_split("sharegpt"), 0
    skipped = 0
    if source == "debug":
        convs = debug_conversations()
    else:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # only while loading: every warning is shown again below
            convs = data.load_messages(source, on_error=on_error)
        for w in caught:
            found = re.search(r"skipped (\d+) malformed record", str(w.message))
            if found:  # load_messages's one warning with the count: our own line instead
                skipped = int(found.group(1))
                print(f"data.source {source}: {w.message}", file=sys.stderr)
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if not convs:
        raise ValueError(f"data.source = {source!r}: no conversations found")
    return *data.heldout_split(convs, val_fraction), skipped


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

    config: the `data` section (experiments.config.DataConfig: every field is documented there);
    fields: keyword overrides of it (`ChatDataModule(source="debug", seq_len=64)`).
    """

    def __init__(self, config: DataConfig | None = None, **fields: Any):
        super().__init__()
        self.config = replace(config or DataConfig(), **fields)
        self.train_rows: PackedRows | None = None
        self.val_rows: PackedRows | None = None
        self.tokenizer: Any = None
        self.skipped_records = 0  # malformed records dropped (on_error: skip)

    def setup(self, stage: str | None = None) -> None:
        if self.train_rows is not None:
            return
        from mtpc.data import pack

        c = self.config
        module = self.trainer.lightning_module if self.trainer is not None else None
        tok = getattr(module, "tokenizer", None)
        if tok is None:
            from mtpc.tokenizer import ByteTokenizer

            tok = ByteTokenizer()
        self.tokenizer = tok
        train, val, self.skipped_records = load_split(c.source, c.val_fraction, c.on_error)
        if c.max_train_conversations is not None:
            train = train[: c.max_train_conversations]
        if c.max_val_conversations is not None:
            val = val[: c.max_val_conversations]
        if c.extra_train_source:  # e.g. self-distillation answers: training only, validation stays on source
            from mtpc.data import load_messages

            train = train + load_messages(c.extra_train_source, on_error=c.on_error)
        if not train:
            raise ValueError(f"data: no training conversations left from {c.source!r} (val_fraction={c.val_fraction})")
        self.train_rows = PackedRows(pack(train, tok, c.seq_len))
        if val:
            rows = PackedRows(pack(val, tok, c.seq_len))
            if c.max_val_rows is not None:
                rows = torch.utils.data.Subset(rows, range(min(c.max_val_rows, len(rows))))
            self.val_rows = rows

    def _consumed_batches(self) -> int:
        return self.trainer.fit_loop.epoch_loop.batch_progress.current.processed

    def train_dataloader(self) -> DataLoader:
        return ResumableLoader(self.train_rows, self.config.batch_size, self.config.seed, self._consumed_batches)

    def val_dataloader(self) -> DataLoader | list:
        if self.val_rows is None:
            return []
        return DataLoader(self.val_rows, batch_size=self.config.batch_size, shuffle=False)
