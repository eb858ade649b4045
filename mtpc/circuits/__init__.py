"""Probabilistic circuits over a window of n tokens: ff, cp, hmm, btree behind one contract.

`build_circuit(kind, window, rank, vocab)` validates the structure and returns a `Circuit`
(see base.py for the query contract and docs/circuits.md for the maths). Pure torch.

The kinds are named once, torch-free, in `mtpc.names.CIRCUIT_KINDS` (what configs, sweep specs and
the analysis read without importing torch); `CIRCUIT_CLASSES` maps each name to its class, keyed by
the class's own `kind`; a kind without latent states says its one rank in its class (`fixed_rank`, ff: 1),
mirrored torch-free in `mtpc.names.FIXED_RANKS`. `check_registry()` says they agree, and runs when this package is imported,
so a kind named in one place only fails at once, naming the other. Adding a kind: docs/circuits.md,
"Adding a circuit kind".
"""

from __future__ import annotations

from mtpc import names
from mtpc.names import CIRCUIT_KINDS

from .base import Circuit, Params
from .btree import BTreeCircuit, BtreeNode
from .cp import CPCircuit
from .ff import FFCircuit
from .hmm import HMMCircuit

#: circuit kind -> its class, in `CIRCUIT_KINDS` order
CIRCUIT_CLASSES: dict[str, type[Circuit]] = {
    cls.kind: cls for cls in (FFCircuit, CPCircuit, HMMCircuit, BTreeCircuit)
}


def check_registry() -> None:
    """ImportError unless `CIRCUIT_CLASSES` holds exactly `mtpc.names.CIRCUIT_KINDS`, in that order,
    each under its class's own `kind` and with its `fixed_rank` as `mtpc.names.FIXED_RANKS` says."""
    for kind, cls in CIRCUIT_CLASSES.items():
        if getattr(cls, "kind", None) != kind:
            raise ImportError(
                f"mtpc.circuits.CIRCUIT_CLASSES[{kind!r}] is {cls.__name__}, whose kind is {getattr(cls, 'kind', None)!r}"
            )
        if getattr(cls, "fixed_rank", None) != names.FIXED_RANKS.get(kind):
            raise ImportError(
                f"{cls.__name__}.fixed_rank is {getattr(cls, 'fixed_rank', None)!r}, mtpc.names.FIXED_RANKS "
                f"gives {kind!r} {names.FIXED_RANKS.get(kind)!r}; expected the same"
            )
    if tuple(CIRCUIT_CLASSES) != tuple(names.CIRCUIT_KINDS):
        raise ImportError(
            f"circuit kinds disagree: mtpc.names.CIRCUIT_KINDS = {list(names.CIRCUIT_KINDS)}, "
            f"mtpc.circuits.CIRCUIT_CLASSES = {list(CIRCUIT_CLASSES)}; expected the same names in the same order"
        )


check_registry()


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name}: expected >= 1, got {value}")
    return value


def build_circuit(kind: str, window: int, rank: int, vocab: int) -> Circuit:
    """A circuit structure; kind in CIRCUIT_KINDS, window n >= 1, rank r >= 1 (the class's `fixed_rank`
    if it has one: ff r = 1), vocab v >= 1.

    No upper bounds here (a circuit is pure maths; the loss builds vocab-1 circuits of any size):
    the head and every config check `mtpc.names.check_architecture`.
    """
    if kind not in CIRCUIT_CLASSES:
        raise ValueError(f"kind: expected one of {tuple(CIRCUIT_CLASSES)}, got {kind!r}")
    window = _positive_int("window", window)
    rank = _positive_int("rank", rank)
    vocab = _positive_int("vocab", vocab)
    cls = CIRCUIT_CLASSES[kind]
    if cls.fixed_rank is not None and rank != cls.fixed_rank:
        raise ValueError(f"rank: {kind} has no latent states; expected rank {cls.fixed_rank}, got {rank}")
    return cls(window, rank, vocab)


__all__ = [
    "CIRCUIT_CLASSES",
    "CIRCUIT_KINDS",
    "BtreeNode",
    "Circuit",
    "Params",
    "build_circuit",
    "check_registry",
]
