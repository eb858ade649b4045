"""Degeneracy of generated text (torch-free): is an answer a loop, and how repetitive is it.

An acceptance figure measured on looping text ("the the the ...") says nothing about the method, so
evaluation reports these beside it (DESIGN section 7):

- `degenerate(answer)`: the answer's tail is periodic with a short period. Precisely: let s be the
  last `window` (128) bytes of the answer, or the whole answer when it is shorter; s is degenerate
  iff some period p with 1 <= p <= min(max_period, len(s) // MIN_REPEATS) has s[i] == s[i + p] for
  every i < len(s) - p. MIN_REPEATS = window / max_period = 4, so a full 128-byte tail is judged with
  p <= 32 (exactly "periodic with a period <= 32"), and a shorter answer with the same demand of at
  least four copies of the period: "abababab" (8 bytes, p = 2) is degenerate, a 3-byte answer never
  is (no period has four copies), the empty answer is not.
- `distinct_4gram_ratio(answer)`: unique / total byte 4-grams of the answer; None below 4 bytes.
- `degeneracy_metrics(answers)`: the fraction of degenerate answers and the mean 4-gram ratio over
  the answers that have 4-grams (NaN when none has).

Answers are bytes, or sequences of ints (token ids: special ids count as symbols like any other).
Leaves out: decoding (mtpc/speculative) and where the numbers are logged (experiments/evaluation/decoding.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

DEGENERATE_WINDOW = 128
"""bytes at the end of an answer that are tested for periodicity"""
DEGENERATE_MAX_PERIOD = 32
"""longest period that counts as a loop in a full window"""
MIN_REPEATS = DEGENERATE_WINDOW // DEGENERATE_MAX_PERIOD
"""copies of the period the tested span must hold (4); applies to short answers alike"""
NGRAM = 4


def _symbols(answer: bytes | bytearray | Sequence[int]) -> Sequence[int]:
    if isinstance(answer, str):
        raise ValueError("answer: expected bytes or a sequence of ints, got str (encode it first)")
    return answer


def degenerate(
    answer: bytes | bytearray | Sequence[int],
    window: int = DEGENERATE_WINDOW,
    max_period: int = DEGENERATE_MAX_PERIOD,
) -> bool:
    """True iff the last `window` symbols (all of a shorter answer) repeat with a period p <=
    min(max_period, len // (window // max_period)) (see the module docstring)."""
    if window < 1 or max_period < 1 or max_period > window:
        raise ValueError(
            f"window, max_period: expected 1 <= max_period <= window, got {window}, {max_period}"
        )
    s = list(_symbols(answer)[-window:])
    longest = min(max_period, len(s) // max(window // max_period, 1))
    return any(s[p:] == s[: len(s) - p] for p in range(1, longest + 1))


def distinct_4gram_ratio(answer: bytes | bytearray | Sequence[int], n: int = NGRAM) -> float | None:
    """unique / total n-grams (n = 4) of the answer; None when it has fewer than n symbols."""
    s = tuple(_symbols(answer))
    total = len(s) - n + 1
    if total < 1:
        return None
    return len({s[i : i + n] for i in range(total)}) / total


def degeneracy_metrics(answers: Iterable[bytes | bytearray | Sequence[int]]) -> dict[str, float]:
    """{"degenerate_fraction", "distinct_4gram_ratio"} over the answers (NaN for an empty list, and
    the ratio NaN when no answer has a 4-gram)."""
    answers = list(answers)
    flags = [degenerate(a) for a in answers]
    ratios = [r for r in (distinct_4gram_ratio(a) for a in answers) if r is not None]
    return {
        "degenerate_fraction": sum(flags) / len(flags) if flags else math.nan,
        "distinct_4gram_ratio": sum(ratios) / len(ratios) if ratios else math.nan,
    }
