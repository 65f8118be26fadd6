"""Fingerprints do not depend on sharding, and any changed element changes them."""

from __future__ import annotations

import itertools

import pytest
import torch

from unbroken.format import fingerprint as fp

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
          torch.int8, torch.uint8, torch.bool, torch.complex64]  # fmt: skip


def _sample(dtype, shape=(37, 113)):
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(0, 100, shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cuts", [[0, 37], [0, 12, 25, 37], [0, 1, 2, 36, 37], [0, 0, 37]])
def test_row_shards_add_up_to_the_whole(dtype, cuts):
    t = _sample(dtype)
    parts = [fp.partial(t[a:b], t.shape, [a, 0]) for a, b in itertools.pairwise(cuts)]
    assert fp.combine(parts) == fp.fingerprint(t)


def test_column_shards_add_up_to_the_whole():
    t = _sample(torch.float32)
    parts = [fp.partial(t[:, a:b], t.shape, [0, a]) for a, b in [(0, 50), (50, 51), (51, 113)]]
    assert fp.combine(parts) == fp.fingerprint(t)


def test_large_tensor_crossing_many_weight_blocks():
    t = torch.randn(3, 100_003)
    parts = [fp.partial(t[:, a:b], t.shape, [0, a]) for a, b in [(0, 4097), (4097, 100_003)]]
    assert fp.combine(parts) == fp.fingerprint(t)


@pytest.mark.parametrize("dtype", DTYPES)
def test_any_single_element_change_is_seen(dtype):
    t = _sample(dtype, (64, 65))
    base = fp.fingerprint(t)
    for idx in [(0, 0), (63, 64), (17, 33)]:
        changed = t.clone()
        if dtype == torch.bool:
            changed[idx] = ~changed[idx]
        elif dtype.is_floating_point:
            changed[idx] = torch.nextafter(changed[idx], torch.tensor(float("inf"), dtype=dtype))
        else:
            changed[idx] = changed[idx] + 1
        assert fp.fingerprint(changed) != base, (dtype, idx)


def test_order_matters():
    t = torch.arange(10, dtype=torch.float32)
    assert fp.fingerprint(t) != fp.fingerprint(t.flip(0))


def test_stable_across_versions():
    """The digest is persisted in manifests: its values must never change."""
    assert fp.fingerprint(torch.arange(12, dtype=torch.float32).reshape(3, 4)) == GOLDEN


GOLDEN = "42a62067d1a00000"  # wsum64-v1, computed once; never update it
