"""LightningDataModule over chat data: load conversations, split held-out by id hash, pack rows.

Holds `ChatDataModule` (built from a `DataConfig`; sources: the bundled ShareGPT corpus, any
messages-format JSON/JSONL file or HF dataset name, or `debug`: a few KB of generated chat text for
CPU tests; `on_error: skip` drops malformed records, prints their count and keeps it as
`skipped_records`), the seeded per-epoch shuffle that resumes mid-epoch and shards by rank (`EpochSampler` +
`ResumableLoader`, whose state Lightning stores in the checkpoint; each batch carries its optimizer
step's per-offset example counts, `target_table`), and `debug_conversations`.
Tokenising and packing (assistant mask, document ids) are `mtpc.data.pack`'s; this file leaves out
any model code.
"""

from __future__ import annotations

import math
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

from experiments.training.config import DataConfig


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
        convs.append(
            {
                "id": f"debug{i}",
                "messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}],
            }
        )
    return convs


def load_split(
    source: str, val_fraction: float, on_error: str = "raise"
) -> tuple[list[dict], list[dict], int]:
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

    `skip` drops the first indices of the next iteration only (mid-epoch resume). `ResumableLoader`
    reads `order` and `epoch` and does its own batching.
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


def target_table(rows: PackedRows, window: int, chunk: int = 256) -> torch.Tensor:
    """(rows, window) bool: row i has a scored target at window offset j (what the window loss's
    per-offset example count counts; `mtpc.losses.window_targets`)."""
    from mtpc.losses import window_targets

    out = []
    for s in range(0, len(rows), chunk):
        sl = slice(s, s + chunk)
        _, _, scored = window_targets(
            rows.input_ids[sl].long(), rows.score_mask[sl], rows.doc_ids[sl].long(), window
        )
        out.append(scored.any(dim=1))
    return torch.cat(out) if out else torch.zeros(0, window, dtype=torch.bool)


class ResumableLoader(DataLoader):
    """The training loader: a seeded per-epoch permutation, sharded by rank, whose position Lightning
    saves in checkpoints (it calls state_dict/load_state_dict).

    Step k of an epoch (one micro-batch per rank) takes rows `order[k G : (k + 1) G]` of the epoch's
    permutation, G = world_size * batch_size; rank r reads its `batch_size` rows at `r * batch_size`.
    So every row is read once per epoch by exactly one rank, and the rows of a step are those of a
    one-process run with batch G (the same order). The last step of an epoch takes the remaining
    rows: a rank left without any reads one row of that step with its score mask cleared (it adds
    nothing to the loss, its gradient or the counts; every rank must run the same number of steps).
    Lightning's DistributedSampler is not used (`use_distributed_sampler=False`): it would pad
    with duplicate rows and could not rebuild this loader.

    has_target (rows, window) bool, when given, appends to every batch the per-offset example counts
    of its whole optimizer step (all ranks, all `accumulate` micro-batches of it; the last group of an
    epoch may be shorter, as Lightning steps at the epoch's end): the normaliser of the window loss
    over the global batch, known to every rank without communication.
    `progress()` returns how many steps of the current epoch the loop has consumed; it is read
    from the trainer rather than counted here because Lightning prefetches a batch ahead.
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        seed: int,
        progress: Callable[[], int],
        *,
        rank: int = 0,
        world_size: int = 1,
        accumulate: int = 1,
        has_target: torch.Tensor | None = None,
    ):
        super().__init__(dataset, batch_size=batch_size, sampler=EpochSampler(len(dataset), seed))
        self._progress = progress
        self.rank, self.world_size, self.accumulate, self.has_target = (
            rank,
            world_size,
            max(1, accumulate),
            has_target,
        )

    @property
    def rows_per_step(self) -> int:
        """G: rows of one step over all ranks."""
        return self.world_size * self.batch_size

    def __len__(self) -> int:
        return math.ceil(len(self.dataset) / self.rows_per_step)

    def step_rows(self, order: list[int], k: int) -> tuple[list[int], bool]:
        """(this rank's rows of step k, padded): padded means the rank had none and reads one unscored row."""
        rows = order[k * self.rows_per_step : (k + 1) * self.rows_per_step]
        mine = rows[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
        return (mine, False) if mine else (rows[:1], True)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        skip, self.sampler.skip = self.sampler.skip, 0
        order = self.sampler.order(self.sampler.epoch)
        group = self.accumulate * self.rows_per_step
        for k in range(skip, len(self)):
            mine, padded = self.step_rows(order, k)
            ids, mask, docs = (torch.stack(t) for t in zip(*(self.dataset[i] for i in mine), strict=True))
            if padded:
                mask = torch.zeros_like(mask)
            if self.has_target is None:
                yield ids, mask, docs
                continue
            g = k // self.accumulate
            counts = self.has_target[order[g * group : (g + 1) * group]].sum(
                dim=0
            )  # (n,) whole optimizer step
            yield ids, mask, docs, counts

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.sampler.epoch,
            "batches": int(self._progress()),
            "rows_per_step": self.rows_per_step,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        epoch, batches = int(state["epoch"]), int(state["batches"])
        saved = int(state.get("rows_per_step", self.batch_size))  # older checkpoints: one process
        if saved != self.rows_per_step and 0 < batches < len(self):
            raise ValueError(
                f"the checkpoint stopped mid-epoch at {saved} rows per step (devices x num_nodes x "
                f"data.batch_size); this run has {self.rows_per_step}: resume with the same devices, "
                "nodes and batch size"
            )
        if batches >= len(self):  # saved at the end of an epoch: continue with the next one
            epoch, batches = epoch + 1, 0
        self.sampler.epoch = epoch
        self.sampler.skip = batches


class ChatDataModule(L.LightningDataModule):
    """Chat conversations packed into fixed-length rows, with a held-out split for per-position NLL.

    config: the `data` section (experiments.training.config.DataConfig: every field is documented there);
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
            raise ValueError(
                f"data: no training conversations left from {c.source!r} (val_fraction={c.val_fraction})"
            )
        self.train_rows = PackedRows(pack(train, tok, c.seq_len))
        if val:
            rows = PackedRows(pack(val, tok, c.seq_len))
            if c.max_val_rows is not None:
                rows = torch.utils.data.Subset(rows, range(min(c.max_val_rows, len(rows))))
            self.val_rows = rows

    def _consumed_batches(self) -> int:
        return self.trainer.fit_loop.epoch_loop.batch_progress.current.processed

    def _ranks(self) -> tuple[int, int]:
        """(global rank, world size): (0, 1) without a trainer."""
        t = self.trainer
        return (t.global_rank, t.world_size) if t is not None else (0, 1)

    def train_dataloader(self) -> DataLoader:
        rank, world = self._ranks()
        module = self.trainer.lightning_module if self.trainer is not None else None
        window = getattr(getattr(module, "config", None), "window", None)
        table = target_table(self.train_rows, window) if window else None
        accumulate = self.trainer.accumulate_grad_batches if self.trainer is not None else 1
        return ResumableLoader(
            self.train_rows,
            self.config.batch_size,
            self.config.seed,
            self._consumed_batches,
            rank=rank,
            world_size=world,
            accumulate=accumulate,
            has_target=table,
        )

    def val_dataloader(self) -> DataLoader | list:
        """The held-out rows, every world_size-th from this rank's (the module reduces sums and counts)."""
        if self.val_rows is None:
            return []
        rank, world = self._ranks()
        rows = (
            self.val_rows
            if world == 1
            else torch.utils.data.Subset(self.val_rows, range(rank, len(self.val_rows), world))
        )
        return DataLoader(rows, batch_size=self.config.batch_size, shuffle=False)
