"""Pre-training's data: the conversations, the training rows in their seeded resumable order
(`TrainRows`), the fixed held-out slice (`heldout_rows`) and its score (`heldout_bits_per_byte`).

`heldout_rows` takes plain arguments (the two data fields of a config, as a run's metrics record
them), so `experiments.shipping.ship_default` scores a model without a `PretrainConfig`.
Leaves out: the settings (config.py) and the loop (loop.py).
"""

from __future__ import annotations

import math
import random

import torch
from transformers import LlamaForCausalLM

from mtpc.data import (
    STREAM_SUFFIX,
    heldout_split,
    load_messages,
    pack,
    pack_stream,
    read_stream,
    sharegpt_corpus,
)
from mtpc.losses import next_byte_nll
from mtpc.tokenizer import ByteTokenizer


def split_conversations(train_data: str, heldout_data: str | None) -> tuple[list[dict], list[dict]]:
    """(training, held-out) conversations; none of either side that is a byte stream."""
    if train_data.endswith(STREAM_SUFFIX):
        if heldout_data is None:
            raise ValueError(f"train_data: {train_data!r} is a byte stream; expected heldout_data set too")
        return [], [] if heldout_data.endswith(STREAM_SUFFIX) else load_messages(heldout_data)
    train, heldout = heldout_split("sharegpt" if train_data == "sharegpt" else load_messages(train_data))
    if train_data != "sharegpt" and not heldout:
        heldout = train[-max(1, len(train) // 20) :]
    if heldout_data is not None:
        heldout = [] if heldout_data.endswith(STREAM_SUFFIX) else load_messages(heldout_data)
    if not train or not (heldout or str(heldout_data).endswith(STREAM_SUFFIX)):
        raise ValueError(
            f"train_data: {train_data!r} gave no training or no held-out conversations; expected both"
        )
    return train, heldout


def packed(source: str | None, convs: list[dict] | None, seq_len: int, max_rows: int, seed: int | None):
    """Rows of `source` if it is a byte stream, else of the conversations (shuffled by `seed`)."""
    if source is not None and source.endswith(STREAM_SUFFIX):
        return pack_stream(read_stream(source), seq_len, max_rows=max_rows)
    if seed is not None:
        random.Random(seed).shuffle(convs)
    return pack(convs, ByteTokenizer(), seq_len, max_rows=max_rows)


def heldout_rows(
    rows: int,
    seq_len: int = 2048,
    *,
    train_data: str = "sharegpt",
    heldout_data: str | None = None,
    conversations: list[dict] | None = None,
):
    """The fixed held-out slice: the held-out conversations in corpus order, packed at `seq_len`
    (`heldout_data`'s stream or conversations, else `train_data`'s held-out split)."""
    if heldout_data is not None and heldout_data.endswith(STREAM_SUFFIX):
        return pack_stream(read_stream(heldout_data), seq_len, max_rows=rows)
    if conversations is not None:
        heldout = conversations
    elif heldout_data is not None:
        heldout = load_messages(heldout_data)
    elif train_data == "sharegpt":
        heldout = sharegpt_corpus(progress=False).heldout
    else:
        heldout = split_conversations(train_data, heldout_data)[1]
    return pack(heldout, ByteTokenizer(), seq_len, max_rows=rows)


class TrainRows:
    """One phase's training rows and its seeded, resumable order: batch `i` of the phase is rows
    perm_e[b*B:(b+1)*B] with e = i // batches_per_epoch, perm_e = randperm(rows, seed + 1009 e);
    the last partial batch of an epoch is dropped (every row at most once per epoch)."""

    def __init__(self, rows, batch_size: int, seed: int):
        # compact copies (vocab 320 fits int16, per-row document numbers int32): the whole corpus stays in memory
        self.input_ids, self.doc_ids = rows.input_ids.to(torch.int16), rows.doc_ids.to(torch.int32)
        self.batch_size, self.seed, self.cut_documents = batch_size, seed, rows.cut_documents
        self.per_epoch = len(rows) // batch_size
        if self.per_epoch == 0:
            raise ValueError(
                f"batch_size: {batch_size} exceeds the {len(rows)} training rows of "
                f"{rows.input_ids.shape[1]} bytes; expected fewer rows per batch or more data"
            )
        self._epoch, self._perm = -1, None

    def batch(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, b = divmod(i, self.per_epoch)
        if epoch != self._epoch:
            self._epoch = epoch
            self._perm = torch.randperm(
                len(self.input_ids), generator=torch.Generator().manual_seed(self.seed + 1009 * epoch)
            )
        idx = self._perm[b * self.batch_size : (b + 1) * self.batch_size]
        return self.input_ids[idx].long(), self.doc_ids[idx].long()


def summed_nll(
    model: LlamaForCausalLM, input_ids: torch.Tensor, doc_ids: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """Summed next-byte NLL (nats) over present targets (`mtpc.losses.next_byte_nll`) and their count."""
    nll, present = next_byte_nll(model(input_ids=input_ids).logits, input_ids, doc_ids)
    return nll.sum(), int(present.sum())


@torch.no_grad()
def heldout_bits_per_byte(model: LlamaForCausalLM, rows, batch_size: int = 8) -> dict[str, float]:
    """Bits per byte on held-out packed rows: all present targets, and assistant bytes only."""
    model.eval()
    device = next(model.parameters()).device
    tot = {"all": [0.0, 0], "assistant": [0.0, 0]}
    for i in range(0, len(rows), batch_size):
        ids = rows.input_ids[i : i + batch_size].to(device)
        doc = rows.doc_ids[i : i + batch_size].to(device)
        score = rows.score_mask[i : i + batch_size, 1:].to(device)
        nll, present = next_byte_nll(model(input_ids=ids).logits, ids, doc)  # (P,), (B, S-1)
        for name, m in (("all", torch.ones_like(nll, dtype=torch.bool)), ("assistant", score[present])):
            tot[name][0] += float(nll[m].sum())
            tot[name][1] += int(m.sum())
    return {
        "heldout_bits_per_byte": tot["all"][0] / max(tot["all"][1], 1) / math.log(2),
        "heldout_bits_per_assistant_byte": tot["assistant"][0] / max(tot["assistant"][1], 1) / math.log(2),
        "heldout_bytes_scored": tot["all"][1],
    }
