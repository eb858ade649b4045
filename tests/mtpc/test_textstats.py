"""Tests for mtpc/textstats.py: the periodicity rule on full windows and short answers, the 4-gram
ratio, the pooled metrics, and that the module stays torch-free."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from mtpc.textstats import DEGENERATE_MAX_PERIOD, degeneracy_metrics, degenerate, distinct_4gram_ratio


def test_full_window_periods_up_to_32_only():
    text = bytes(range(200))  # no repeats at all
    assert not degenerate(text)
    for p in (1, 2, 7, 32):
        unit = bytes(range(65, 65 + p)) if p <= 26 else bytes(range(33, 33 + p))
        loop = text + unit * (300 // p)
        assert degenerate(loop), p
    unit33 = bytes(range(33, 66))  # 33 distinct bytes: period 33 > 32
    assert not degenerate(text + unit33 * 10)


def test_only_the_last_128_bytes_count():
    loop = b"the " * 40  # 160 bytes, period 4
    assert degenerate(bytes(range(100, 250)) + loop)  # a good start does not save a looping tail
    assert not degenerate(loop + bytes(range(100, 101)))  # one odd byte at the end breaks the period
    # one foreign byte just inside the 128-byte tail breaks it; just outside, it does not
    tail = b"ab" * 63 + b"a"  # 127 bytes, period 2
    assert not degenerate(b"x" + tail) and degenerate(b"x" + b"b" + tail)


def test_short_answers_need_four_copies_of_the_period():
    assert degenerate(b"abababab")  # 8 bytes, p = 2, four copies
    assert not degenerate(b"abcabcab")  # p = 3 would need 12 bytes
    assert degenerate(b"abcabcabcabc")
    assert degenerate(b"aaaa") and not degenerate(b"aaa")  # 3 bytes: no period has four copies
    assert not degenerate(b"") and not degenerate(b"Hello, world.")
    assert degenerate(b"The " * 8)  # 32 bytes, p = 4
    assert not degenerate(b"The cat sat on the mat.")


def test_token_id_sequences_and_bad_input():
    assert degenerate([258] * 10) and not degenerate([1, 2, 3, 4, 5, 6, 7, 8])
    with pytest.raises(ValueError, match="^answer: expected bytes"):
        degenerate("text")
    with pytest.raises(ValueError, match="^window, max_period"):
        degenerate(b"abc", window=16, max_period=32)


def test_distinct_4gram_ratio():
    assert distinct_4gram_ratio(b"abcdefgh") == 1.0  # 5 distinct of 5
    assert distinct_4gram_ratio(b"aaaaaaa") == 1 / 4  # 4 grams, all "aaaa"
    assert distinct_4gram_ratio(b"abcabcabc") == 3 / 6
    assert distinct_4gram_ratio(b"abc") is None and distinct_4gram_ratio(b"abcd") == 1.0


def test_pooled_metrics():
    m = degeneracy_metrics([b"ab" * 80, b"The quick brown fox jumps over the lazy dog.", b"xy"])
    assert m["degenerate_fraction"] == pytest.approx(1 / 3)
    assert m["distinct_4gram_ratio"] == pytest.approx((2 / 157 + 1.0) / 2)  # b"xy" has no 4-gram
    empty = degeneracy_metrics([])
    assert math.isnan(empty["degenerate_fraction"]) and math.isnan(empty["distinct_4gram_ratio"])
    assert DEGENERATE_MAX_PERIOD == 32


def test_module_is_torch_free():
    code = "import sys, mtpc.textstats; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
