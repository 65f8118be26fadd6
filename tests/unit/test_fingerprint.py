"""Fingerprints do not depend on sharding, and any changed element changes them, in every
format (``wsum64-v1`` and ``wsum64-v2``, still verified; ``mix64-v3``, written now)."""

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


GOLDEN = {  # computed once each; never update them
    "wsum64-v1": "42a62067d1a00000",
    "wsum64-v2": "3d55d9ff3b200000",
    "mix64-v3": "6bc2d4e9c5c92bbc",
}
ALGORITHMS = pytest.mark.parametrize("algorithm", fp.ALGORITHMS)


@ALGORITHMS
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cuts", [[0, 37], [0, 12, 25, 37], [0, 1, 2, 36, 37], [0, 0, 37]])
def test_row_shards_add_up_to_the_whole(dtype, cuts, algorithm):
    t = _sample(dtype)
    parts = [fp.partial(t[a:b], t.shape, [a, 0], algorithm) for a, b in itertools.pairwise(cuts)]
    assert fp.combine(parts) == fp.fingerprint(t, algorithm)


@ALGORITHMS
@pytest.mark.parametrize("dtype", DTYPES)
def test_column_shards_add_up_to_the_whole(dtype, algorithm):
    """Columns 1, 3 and 7 wide: for 1-, 2- and 4-byte dtypes a v2 word (8 bytes) is split
    between shards, each adding the bytes it holds."""
    t = _sample(dtype)
    cuts = [0, 1, 4, 11, 50, 51, 113]
    parts = [fp.partial(t[:, a:b], t.shape, [0, a], algorithm) for a, b in itertools.pairwise(cuts)]
    assert fp.combine(parts) == fp.fingerprint(t, algorithm)


@ALGORITHMS
def test_large_tensor_crossing_many_weight_blocks(algorithm):
    t = torch.randn(3, 100_003)
    parts = [
        fp.partial(t[:, a:b], t.shape, [0, a], algorithm) for a, b in [(0, 4097), (4097, 100_003)]
    ]
    assert fp.combine(parts) == fp.fingerprint(t, algorithm)


@ALGORITHMS
@pytest.mark.parametrize("dtype", DTYPES)
def test_any_single_element_change_is_seen(dtype, algorithm):
    t = _sample(dtype, (64, 65))
    base = fp.fingerprint(t, algorithm)
    for idx in [(0, 0), (63, 64), (17, 33)]:
        changed = t.clone()
        if dtype == torch.bool:
            changed[idx] = ~changed[idx]
        elif dtype.is_floating_point:
            changed[idx] = torch.nextafter(changed[idx], torch.tensor(float("inf"), dtype=dtype))
        else:
            changed[idx] = changed[idx] + 1
        assert fp.fingerprint(changed, algorithm) != base, (dtype, idx)


@ALGORITHMS
def test_order_matters(algorithm):
    t = torch.arange(10, dtype=torch.float32)
    assert fp.fingerprint(t, algorithm) != fp.fingerprint(t.flip(0), algorithm)


def test_the_formats_differ_and_v3_is_written():
    t = torch.arange(12, dtype=torch.float32)
    assert fp.ALGORITHM == fp.V3
    assert len({fp.fingerprint(t, a) for a in fp.ALGORITHMS}) == len(fp.ALGORITHMS)
    with pytest.raises(ValueError, match="wsum64-v9"):
        fp.fingerprint(t, "wsum64-v9")


@pytest.mark.parametrize("algorithm, golden", GOLDEN.items())
def test_stable_across_versions(algorithm, golden):
    """The digests are persisted in manifests: their values must never change."""
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert fp.fingerprint(t, algorithm) == golden
