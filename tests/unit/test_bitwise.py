"""``format.bitwise``: the one bit-for-bit comparison the restore check, the tied-weights
check and the tie detection share (DESIGN.md F5: a cast or a changed value is caught
however small)."""

from __future__ import annotations

import torch

from unbroken.format import bitwise


def test_nan_equals_the_same_nan_and_signed_zeros_differ():
    a = torch.tensor([float("nan"), 1.0, 0.0])
    assert bitwise.equal(a, a.clone())  # torch.equal says False here: NaN != NaN
    assert not bitwise.equal(a, torch.tensor([float("nan"), 1.0, -0.0]))  # == says equal


def test_one_flipped_bit_in_any_word_width_is_caught():
    for n in (1, 2, 3, 4, 8, 12, 1001):  # byte counts of every word width, and odd ones
        a = torch.arange(n, dtype=torch.uint8)
        b = a.clone()
        b[-1] ^= 1
        assert bitwise.equal(a, a.clone())
        assert not bitwise.equal(a, b), n


def test_values_are_compared_in_row_major_order_whatever_the_layout():
    a = torch.randn(4, 6)
    assert bitwise.equal(a.t(), a.t().contiguous())
    assert not bitwise.equal(a.t(), a.contiguous())


def test_different_byte_counts_are_not_equal():
    assert not bitwise.equal(torch.zeros(4, dtype=torch.uint8), torch.zeros(6, dtype=torch.uint8))
    assert bitwise.equal(torch.zeros(0), torch.zeros(0))
