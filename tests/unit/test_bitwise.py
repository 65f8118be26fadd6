"""``format.bitwise``: the one "same value" rule the restore check, the tied-weights
check, the tie detection, the optimizer watch, the replay check and the resume test's
metric comparison share (DESIGN.md F5: a cast or a changed value is caught however
small)."""

from __future__ import annotations

import math
import struct

import pytest
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


def test_differing_flags_each_element_whose_bits_differ():
    a = torch.tensor([float("nan"), 1.0, 0.0, 2.0])
    b = torch.tensor([float("nan"), 1.0, -0.0, 2.5])
    assert bitwise.differing(a, b).tolist() == [False, False, True, True]
    assert bitwise.differing(a, a.clone()).tolist() == [False] * 4  # != says NaN differs


@pytest.mark.parametrize(
    "dtype",
    [torch.bool, torch.uint8, torch.bfloat16, torch.float16, torch.float32, torch.int64,
     torch.complex64, torch.complex128],
)  # fmt: skip
def test_differing_in_every_element_width(dtype):
    a = torch.zeros(5, dtype=dtype)
    b = a.clone()
    b[3] = 1
    assert bitwise.differing(a, b).tolist() == [False, False, False, True, False]
    assert bitwise.differing(torch.zeros(0, dtype=dtype), torch.zeros(0, dtype=dtype)).numel() == 0


def test_differing_reads_row_major_order_and_refuses_mismatched_tensors():
    a = torch.arange(6.0).reshape(2, 3)
    assert not bitwise.differing(a.t(), a.t().contiguous()).any()
    assert bitwise.differing(a.t(), a.reshape(3, 2)).tolist() == [False, True, True, True, True,
                                                                   False]  # fmt: skip
    with pytest.raises(ValueError, match="element by element"):
        bitwise.differing(a, a.double())
    with pytest.raises(ValueError, match="element by element"):
        bitwise.differing(a, a[:1])


def test_same_float_is_the_bits_with_every_nan_equal():
    """Metric values read back from JSON: -0.0 is not 0.0; a NaN keeps no payload there,
    so any NaN equals any NaN."""
    other_nan = struct.unpack("<d", struct.pack("<Q", 0x7FF8_0000_0000_0001))[0]
    assert bitwise.same_float(math.nan, -math.nan) and bitwise.same_float(math.nan, other_nan)
    assert not bitwise.same_float(0.0, -0.0)
    assert bitwise.same_float(-0.0, -0.0) and bitwise.same_float(math.inf, math.inf)
    assert not bitwise.same_float(math.inf, -math.inf)
    assert not bitwise.same_float(1.0, math.nextafter(1.0, 2.0))
    assert not bitwise.same_float(math.nan, 1.0)
