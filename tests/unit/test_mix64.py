"""The ``mix64-v3`` fingerprint has no structured blind spots (issue 36, item 1).

Bug class (DESIGN.md: "verified" must be true): ``wsum64-v2`` is linear modulo 2**64 with
odd weights, so negating a float64 adds 2**63 to its word and any even number of such
flips cancels: two negated weights were called identical by ``unbroken diff``, and a
+-1 probe redrawn with 32 of 64 signs changed passed ``resume-test``. The randomized test
below applies many structured changes to tensors of every dtype: with v2 some go unseen
(that test is kept as the proof of the old blind spot); with v3 none may.

Also: the compiled host kernel and the torch ops (the device path, and the CPU fallback
without the kernel) give the same digest bit for bit, whole or in any shard layout.
"""

from __future__ import annotations

import random

import pytest
import torch

from unbroken.format import fingerprint as fp
from unbroken.format import mix64

DTYPES = [
    torch.float64,
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
]


def _tensor(dtype: torch.dtype, shape=(24, 40), seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=g, dtype=torch.float64)
    if dtype == torch.bool:
        return base > 0
    if dtype.is_complex:
        return torch.complex(base, base.flip(0)).to(dtype)
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        return (base * 1000).clamp(info.min, info.max).to(dtype)
    return base.to(dtype)


def _structured_changes(t: torch.Tensor, rng: random.Random):
    """(name, changed copy) for the changes a linear sum modulo 2**64 can miss."""
    flat = t.reshape(-1)
    words = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    size = t.element_size()
    unit = min(size, 8)
    raw = flat.view(torch.uint8).view(words[unit]) if size > 1 else flat.view(torch.uint8)

    def with_bits(edit) -> torch.Tensor:
        bits = raw.clone()
        edit(bits)
        out = bits.view(torch.uint8) if size > 1 else bits
        return out.view(t.dtype).reshape(t.shape)

    top = 8 * unit - 1

    def bit_mask(bit: int) -> torch.Tensor:  # bit `bit` set, in raw's (signed) dtype
        signed = raw.dtype != torch.uint8 and bit == top
        return torch.tensor(-(1 << bit) if signed else 1 << bit, dtype=raw.dtype)

    for count in (2, 4, 32):  # an even number of top-bit (sign) flips
        idx = torch.tensor(rng.sample(range(raw.numel()), min(count, raw.numel())))

        def flip(bits, idx=idx):
            bits[idx] ^= bit_mask(top)

        yield f"{count} sign flips", with_bits(flip)
    for bit in (rng.randrange(8 * unit), top - 1):  # one bit position, a set of elements
        idx = torch.tensor(rng.sample(range(raw.numel()), min(16, raw.numel())))
        mask = bit_mask(bit)

        def flip_bit(bits, idx=idx, mask=mask):
            bits[idx] ^= mask

        yield f"bit {bit} flipped in 16 elements", with_bits(flip_bit)
    units = raw.numel()
    i, j = rng.sample(range(units), 2)
    swap = torch.arange(units)
    swap[i], swap[j] = j, i
    yield "two units swapped", with_bits(lambda bits: bits.copy_(bits[swap]))
    perm = torch.randperm(units, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
    yield "permuted", with_bits(lambda bits: bits.copy_(bits[perm]))
    yield "reversed", with_bits(lambda bits: bits.copy_(bits.flip(0)))
    yield "every sign flipped (negated)", with_bits(lambda bits: bits.__ixor__(bit_mask(top)))
    if t.dtype in (torch.int64, torch.int32, torch.int16, torch.int8):
        yield "integer negation", -t
    row = units // t.shape[0]
    rows = torch.cat([torch.arange(row, 2 * row), torch.arange(row), torch.arange(2 * row, units)])
    yield "rows swapped", with_bits(lambda bits: bits.copy_(bits[rows]))


def _changes_missed(algorithm: str, trials: int = 6) -> list[str]:
    missed = []
    rng = random.Random(36)
    for dtype in DTYPES:
        for trial in range(trials):
            t = _tensor(dtype, seed=trial)
            before = fp.fingerprint(t, algorithm)
            for name, changed in _structured_changes(t, rng):
                if torch.equal(changed.view(torch.uint8), t.view(torch.uint8)):
                    continue  # no change at all (e.g. a permutation of equal values)
                if fp.fingerprint(changed, algorithm) == before:
                    missed.append(f"{dtype}: {name}")
    return missed


def test_no_structured_change_goes_unseen():
    assert _changes_missed(fp.ALGORITHM) == []


def test_the_old_format_was_blind_to_even_sign_flips():
    """What the new format ends: v2 misses paired sign flips of float64 values."""
    missed = _changes_missed(fp.V2, trials=2)
    assert any("float64: 2 sign flips" in m for m in missed)


def test_two_negated_float64_weights_differ():
    w = torch.randn(8, 8, dtype=torch.float64)
    changed = w.clone()
    changed[0, 0], changed[5, 3] = -changed[0, 0], -changed[5, 3]
    assert fp.fingerprint(changed, fp.V2) == fp.fingerprint(w, fp.V2)  # the old blind spot
    assert fp.fingerprint(changed) != fp.fingerprint(w)


def test_a_rademacher_probe_redrawn_differs():
    g = torch.Generator().manual_seed(0)
    probe = torch.randint(0, 2, (64,), generator=g).to(torch.float64) * 2 - 1
    other = probe.clone()
    other[torch.randperm(64, generator=g)[:32]] *= -1
    assert fp.fingerprint(other) != fp.fingerprint(probe)


def _layouts():  # shard layouts of an (11, 37) tensor: slices and their offsets
    yield [((slice(None), slice(None)), (0, 0))]
    yield [((slice(0, 7), slice(None)), (0, 0)), ((slice(7, None), slice(None)), (7, 0))]
    yield [((slice(None), slice(0, 13)), (0, 0)), ((slice(None), slice(13, None)), (0, 13))]
    yield [
        ((slice(0, 5), slice(0, 3)), (0, 0)),
        ((slice(0, 5), slice(3, None)), (0, 3)),
        ((slice(5, None), slice(0, 31)), (5, 0)),
        ((slice(5, None), slice(31, None)), (5, 31)),
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_and_torch_ops_agree_in_every_layout(dtype, monkeypatch):
    t = _tensor(dtype, shape=(11, 37), seed=3)
    whole = fp.fingerprint(t)
    monkeypatch.setattr(mix64, "_SLAB_UNITS", 16)  # cross slab boundaries
    monkeypatch.setattr(mix64, "_BATCH_RUNS", 3)
    for layout in _layouts():
        for how in (mix64.partial, mix64.partial_torch):
            parts = [how(t[s], t.shape, list(off)) for s, off in layout]
            assert fp.combine(parts) == whole, (how.__name__, layout)
    scalar = t[2, 5].clone()
    assert fp.combine([mix64.partial_torch(scalar, (), [])]) == fp.fingerprint(scalar)
    assert fp.combine([mix64.partial(scalar, (), [])]) == fp.fingerprint(scalar)


def test_non_contiguous_and_long_runs(monkeypatch):
    t = torch.randn(64, 48)
    whole = fp.fingerprint(t)
    assert fp.fingerprint(t.t().contiguous().t()) == whole
    monkeypatch.setattr(mix64, "_SLAB_UNITS", 100)  # runs longer than a slab
    assert fp.combine([mix64.partial_torch(t, t.shape, [0, 0])]) == whole
    parts = [
        mix64.partial_torch(t[:, :20], t.shape, [0, 0]),
        mix64.partial(t[:, 20:], t.shape, [0, 20]),
    ]
    assert fp.combine(parts) == whole


def _reference(t: torch.Tensor) -> str:
    """The definition in format/mix64.py, in plain Python integers."""
    mask = (1 << 64) - 1

    def mix(x: int) -> int:
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    data = t.contiguous().reshape(-1).view(torch.uint8).tolist()
    unit = min(t.element_size(), 8)
    total = 0
    for u in range(len(data) // unit):
        x = int.from_bytes(bytes(data[u * unit : (u + 1) * unit]), "little")
        total += mix(x ^ ((u * mix64.GOLDEN + mix64.SALT) & mask))
    return f"{total & mask:016x}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_both_implementations_follow_the_definition(dtype):
    t = _tensor(dtype, shape=(3, 7), seed=1)
    assert fp.fingerprint(t) == _reference(t)
    assert fp.combine([mix64.partial_torch(t, t.shape, [0, 0])]) == _reference(t)


def test_the_compiled_kernel_is_built():
    """make test installs with a compiler: the host path must not fall back silently."""
    assert mix64.has_kernel()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_pieces_equal_the_host_kernel(dtype, monkeypatch):
    """On a GPU: v3 partials computed on the device add up to the host's digest."""
    t = _tensor(dtype, shape=(11, 37), seed=5)
    whole = fp.fingerprint(t)
    on_gpu = t.cuda()
    for slab in (mix64._SLAB_UNITS, 16):
        monkeypatch.setattr(mix64, "_SLAB_UNITS", slab)
        for layout in _layouts():
            parts = [fp.partial(on_gpu[s], t.shape, list(off)) for s, off in layout]
            assert fp.combine(parts) == whole, layout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32], ids=str)
def test_gpu_large_tensor_equals_the_host_and_syncs_once(dtype):
    """On a GPU: a tensor of several slabs (default slab size), whole and as a Shard(1)
    half, gives the host kernel's digest; only the final ``.item()`` waits for the device."""
    import warnings

    g = torch.Generator().manual_seed(9)
    host = torch.randint(0, 256, (96 << 20,), dtype=torch.uint8, generator=g).view(dtype)
    host = host.view(-1, 1024 // host.element_size())
    gpu = host.cuda()
    half = host.shape[1] // 2
    want_whole = mix64.partial(host, host.shape, [0, 0])
    want_half = mix64.partial(host[:, half:], host.shape, [0, half])
    mix64.partial_torch(gpu[:8], host.shape, [0, 0])  # warm-up outside the watched calls
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got_whole = mix64.partial_torch(gpu, host.shape, [0, 0])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got_whole == want_whole
    assert mix64.partial_torch(gpu[:, half:], host.shape, [0, half]) == want_half
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]
