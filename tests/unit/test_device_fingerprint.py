"""The on-device ``wsum64-v2`` digest equals the NumPy one bit for bit.

A GPU tensor's fingerprint is computed on its device (format/device_fingerprint.py), a
CPU tensor's with NumPy (format/fingerprint.py). Were the two to differ by a single bit,
a checkpoint saved from GPUs would fail verification when restored on CPUs (or the other
way round), or worse a wrong value could pass. The device code runs on CPU tensors too,
so every case here compares the two on the CPU; the ``gpu`` tests repeat the comparisons
on ``cuda`` tensors where a GPU is present.
"""

from __future__ import annotations

import itertools
import types
import warnings

import pytest
import torch

from unbroken.format import device_fingerprint as dfp
from unbroken.format import fingerprint as fp

CPU = torch.device("cpu")
_NAMES = ["bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
          "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
          "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
          "float8_e8m0fnu", "float4_e2m1fn_x2"]  # fmt: skip
DTYPES = [getattr(torch, n) for n in _NAMES if hasattr(torch, n)]
BY_SIZE = [torch.uint8, torch.bfloat16, torch.float32, torch.int64, torch.complex128]
SHAPES = [(), (0,), (3, 0), (1,), (7,), (5, 13), (3, 4, 5), (2, 3, 2, 3)]


def _random(shape, dtype, seed=0, device=CPU):
    """Random bit patterns of ``dtype`` (NaNs, negatives, high bits and all)."""
    g = torch.Generator().manual_seed(seed)
    n = dtype.itemsize * max(1, torch.Size(shape).numel())
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw &= 1  # a bool is stored as 0 or 1
    t = raw.view(dtype)[: torch.Size(shape).numel()]
    return t.reshape(shape).to(device)


def _same(local, global_shape, offsets):
    """The device partial of ``local`` equals NumPy's partial of its CPU copy."""
    want = fp.partial(local.cpu(), global_shape, offsets, fp.V2)
    got = dfp.partial_on_device(local, global_shape, offsets)
    assert got == want, (local.dtype, tuple(local.shape), tuple(offsets))
    return got


def _pieces(t, cuts):
    """Every piece of ``t`` cut at ``cuts`` (one list of boundaries per dim), with offsets."""
    spans = [list(itertools.pairwise(c)) for c in cuts]
    for box in itertools.product(*spans):
        piece = t[tuple(slice(a, b) for a, b in box)]
        yield piece, [a for a, _ in box]


def _check_grid(t, cuts):
    """Each piece's partial equals NumPy's, and the pieces add up to the whole digest."""
    parts = [_same(piece, t.shape, offsets) for piece, offsets in _pieces(t, cuts)]
    assert fp.combine(parts) == fp.fingerprint(t.cpu(), fp.V2)


@pytest.fixture
def small_slabs(monkeypatch):
    """Slabs of one weight block, so that small tensors cross many slab boundaries."""
    monkeypatch.setattr(dfp, "_SLAB_BYTES", 1)


def test_constants_are_those_of_the_format():
    """T and U are persisted constants: the device's must be NumPy's, for any block."""
    table = dfp._constants(CPU)[0].numpy()
    assert (table == fp._TABLE).all()
    for first in [0, 4095, 2**40 + 7]:
        blocks = torch.arange(first, first + 64, dtype=torch.int64)
        assert (dfp._block_weights(blocks).numpy() == fp._block_weights(first, 64)).all()
        assert dfp._signed(dfp._block_weight_int(first)) == int(fp._block_weights(first, 1)[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_dtype_and_shape(dtype, shape):
    """Whole tensors of every dtype we save, 0-d and empty included, random bits."""
    _same(_random(shape, dtype), shape, [0] * len(shape))


@pytest.mark.parametrize("words", [1, 4095, 4096, 4097, 3 * 4096 + 5])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float16, torch.int64])
def test_sizes_around_block_boundaries(words, dtype, small_slabs):
    """Runs ending just before, on and after a weight block, and spanning several slabs."""
    n = words * 8 // dtype.itemsize
    t = _random((n,), dtype, seed=words)
    _check_grid(t, [[0, n]])
    _check_grid(t, [sorted({0, 1, n // 2 + 1, n - 1, n})])


@pytest.mark.parametrize("slabs", ["default", "small"])
@pytest.mark.parametrize("dtype", BY_SIZE, ids=str)
def test_shard_cuts(dtype, slabs, request):
    """Shard(0), Shard(1) and 2-D grids of uneven pieces: runs start and end mid-word for
    1-, 2- and 4-byte dtypes, and a Shard(1) piece's rows are many runs."""
    if slabs == "small":
        request.getfixturevalue("small_slabs")
    t = _random((11, 13), dtype)
    _check_grid(t, [[0, 11], [0, 13]])
    _check_grid(t, [[0, 1, 4, 11], [0, 13]])
    _check_grid(t, [[0, 11], [0, 1, 4, 5, 12, 13]])
    _check_grid(t, [[0, 3, 10, 11], [0, 7, 8, 13]])
    wide = _random((6, 16), dtype, seed=2)  # rows all starting at one word position
    _check_grid(wide, [[0, 6], [0, 3, 8, 11, 16]])
    cube = _random((5, 7, 3), dtype, seed=1)
    _check_grid(cube, [[0, 2, 5], [0, 7], [0, 1, 3]])
    _check_grid(cube, [[0, 5], [0, 3, 4, 7], [0, 3]])
    _check_grid(cube, [[0, 1, 5], [0, 6, 7], [0, 2, 3]])


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.float32], ids=str)
def test_many_rows_cross_slabs(dtype, small_slabs):
    """Thousands of short rows (a Shard(1) piece) split over several slabs of rows."""
    t = _random((5000, 9), dtype, seed=2)
    _check_grid(t, [[0, 2501, 5000], [0, 3, 4, 9]])


def test_long_rows_one_at_a_time(small_slabs):
    """Rows too long to batch go one at a time, each still starting mid-word."""
    t = _random((3, 40_000), torch.int8, seed=3)
    _check_grid(t, [[0, 3], [0, 1, 33_333, 40_000]])
    _check_grid(t, [[0, 1, 3], [0, 5, 40_000]])


def test_misaligned_storage():
    """A piece whose bytes start at an odd address of its storage (not 8-byte aligned)."""
    raw = _random((8 * 4096 * 2 + 21,), torch.uint8, seed=4)
    for start in [1, 3, 8, 13]:
        _same(raw[start:], raw.shape, [start])
        _same(raw[start:], (raw.numel() + 5,), [start + 5])
    halves = _random((2 * 4099 + 1,), torch.int16, seed=5)[1:].view(2, 4099)
    _same(halves, (2, 4099), [0, 0])


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32, torch.complex64])
def test_non_contiguous(dtype):
    """Transposed, stepped and channels_last tensors are summed in row-major order."""
    t = _random((6, 10), dtype)
    for view in [t.T, t[::2, 1::3], t[1::2], t.T[2:5]]:
        _same(view, view.shape, [0] * view.dim())
    image = _random((2, 3, 5, 4), dtype).to(memory_format=torch.channels_last)
    _same(image, image.shape, [0, 0, 0, 0])
    _check_grid(t.T, [[0, 3, 10], [0, 1, 6]])
    # one element seen through a stride: NumPy's path cannot view it, compare its copy
    one = _random((4,), dtype)[1::3][:1]
    assert dfp.partial_on_device(one, (5,), [2]) == fp.partial(
        one.clone(memory_format=torch.contiguous_format), (5,), [2], fp.V2
    )


def test_dispatch_sends_only_v2_off_cpu_to_the_device(monkeypatch):
    """``fingerprint.partial`` computes a v2 partial of a tensor off the CPU on its
    device (no host copy) and keeps CPU tensors, and v1, on the NumPy path."""
    calls = []

    def record(local, global_shape, offsets):
        calls.append((local, global_shape, offsets))
        return 42

    monkeypatch.setattr(dfp, "partial_on_device", record)
    on_gpu = types.SimpleNamespace(device=torch.device("cuda", 0))
    assert fp.partial(on_gpu, (4,), [0], fp.V2) == 42
    assert calls == [(on_gpu, (4,), [0])]
    t = torch.arange(4)
    fp.partial(t, t.shape, [0], fp.V2)
    fp.partial(t, t.shape, [0], fp.V1)
    assert len(calls) == 1


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_every_dtype_and_shape(dtype):
    """On a GPU: a CUDA tensor's digest, through ``fingerprint.partial``, equals its CPU
    copy's, for every dtype and shape."""
    for shape in SHAPES:
        t = _random(shape, dtype, device=torch.device("cuda"))
        offsets = [0] * len(shape)
        assert fp.partial(t, shape, offsets) == fp.partial(t.cpu(), shape, offsets)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("slabs", ["default", "small"])
@pytest.mark.parametrize("dtype", BY_SIZE, ids=str)
def test_gpu_shard_cuts(dtype, slabs, request):
    """On a GPU: shard grids, many rows and misaligned pieces equal NumPy's partials."""
    if slabs == "small":
        request.getfixturevalue("small_slabs")
    cuda = torch.device("cuda")
    _check_grid(_random((11, 13), dtype, device=cuda), [[0, 3, 10, 11], [0, 7, 8, 13]])
    _check_grid(_random((2000, 9), dtype, device=cuda), [[0, 1001, 2000], [0, 4, 9]])
    _check_grid(_random((5, 7, 3), dtype, device=cuda).mT, [[0, 2, 5], [0, 1, 3], [0, 7]])
    _check_grid(_random((20_001,), dtype, device=cuda), [[0, 1, 4097, 20_001]])


@pytest.mark.gpu
@needs_gpu
def test_gpu_large_tensor_one_host_sync():
    """On a GPU: a tensor of several slabs (default size) equals NumPy's digest, and the
    only synchronization with the host is the final ``.item()``."""
    t = _random((100 << 20,), torch.uint8, device=torch.device("cuda"))
    want = fp.partial(t.cpu(), t.shape, [0], fp.V2)  # this module's format, wsum64-v2
    dfp.partial_on_device(t[3:], t.shape, [3])  # T and the byte places made and cached
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = dfp.partial_on_device(t, t.shape, [0])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got == want
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]


@pytest.mark.parametrize("algorithm", fp.ALGORITHMS)
def test_one_element_seen_through_a_stride_is_fingerprinted_and_saved_as_its_value(algorithm):
    """``x[::2]`` of two elements is "contiguous" for torch yet cannot be viewed as bytes:
    the host paths used to crash on it (a save of such a tensor failed)."""
    from unbroken.format.shards import tensor_bytes

    x = torch.arange(2.0)[::2]
    assert x.stride() == (2,)
    assert fp.fingerprint(x, algorithm) == fp.fingerprint(torch.tensor([0.0]), algorithm)
    assert bytes(tensor_bytes(x)) == bytes(tensor_bytes(torch.tensor([0.0])))
