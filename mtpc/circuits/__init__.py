"""Probabilistic circuits over a window of n tokens: ff, cp, hmm, btree behind one contract.

`build_circuit(kind, window, rank, vocab)` validates the structure and returns a `Circuit`
(see base.py for the query contract and docs/circuits.md for the maths). Pure torch.
"""

from __future__ import annotations

from mtpc.names import CIRCUIT_KINDS

from .base import Circuit, Params
from .btree import BTreeCircuit, BtreeNode
from .cp import CPCircuit
from .ff import FFCircuit
from .hmm import HMMCircuit

_CLASSES: dict[str, type[Circuit]] = {"ff": FFCircuit, "cp": CPCircuit, "hmm": HMMCircuit, "btree": BTreeCircuit}


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name}: expected >= 1, got {value}")
    return value


def build_circuit(kind: str, window: int, rank: int, vocab: int) -> Circuit:
    """A circuit structure; kind in CIRCUIT_KINDS, window n >= 1, rank r >= 1 (ff: r = 1), vocab v >= 1.

    No upper bounds here (a circuit is pure maths; the loss builds vocab-1 circuits of any size):
    the head and every config check `mtpc.names.check_architecture`.
    """
    if kind not in CIRCUIT_KINDS:
        raise ValueError(f"kind: expected one of {CIRCUIT_KINDS}, got {kind!r}")
    window = _positive_int("window", window)
    rank = _positive_int("rank", rank)
    vocab = _positive_int("vocab", vocab)
    if kind == "ff" and rank != 1:
        raise ValueError(f"rank: ff has no latent states; expected rank 1, got {rank}")
    return _CLASSES[kind](window, rank, vocab)


__all__ = ["CIRCUIT_KINDS", "BtreeNode", "Circuit", "Params", "build_circuit"]
