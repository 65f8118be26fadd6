"""The ``wsum64-v2`` digest computed with torch ops on the tensor's own device.

``fingerprint.partial`` sums a CPU tensor with NumPy; a CUDA tensor copied to pageable
host memory first (about 1.2 GB/s) dominated GPU saves and restores. Here the same sum
runs where the tensor lives and only the 8-byte result reaches the host, by one
``.item()``. The ops run on CPU tensors too: CI (no GPU) proves it equals NumPy's.

The digest (``fingerprint.py``): ``sum_g word(g) * T[g mod L] * U(g div L)`` mod 2**64
over the global row-major stream of 8-byte little-endian words. int64 products and sums
wrap in two's complement on every device, which is that arithmetic; constants above
2**63 enter as their signed equivalents, and a logical right shift is an arithmetic one
masked (:func:`_lsr`). ``T`` is made on each device once and cached; ``U`` is computed
on the device (for one partial block, on the host and passed as a scalar).

A shard is a set of runs of global bytes (``partial`` explains them):

- one run (a whole tensor, a ``Shard(0)`` piece), or runs so long that a slab holds one
  at most: a run at a time, block-structured (:func:`_run_sum`): the aligned words viewed
  as ``[blocks, L]``, multiplied by ``T``, summed per block, weighted by ``U``;
- many short runs (the rows of a ``Shard(1)`` or 2-D-sharded piece): a slab of rows at a
  time, vectorized (:func:`_rows_sum`): each row is moved to its word alignment (zero
  bytes before and after it: a row's share of a word it starts or ends inside) and each
  word weighted by ``T`` gathered and ``U`` computed from its global index.

Memory: temporaries are bounded by :data:`_SLAB_BYTES` whatever the tensor's size. A
non-contiguous tensor (transposed, sliced with steps, channels_last) is first copied to
row-major order, one extra copy of its size on its device. Thread-safe: the only state
is a per-device cache of constants. Ops go on the current stream of the device.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from .shard_runs import M1 as _M1
from .shard_runs import M2 as _M2
from .shard_runs import Runs as _Runs
from .shard_runs import mix_ as _mix_
from .shard_runs import row_major_bytes as _row_major_bytes
from .shard_runs import signed as _signed

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

_MASK = (1 << 64) - 1
# The wsum64-v2 constants, as fingerprint.py defines them (persisted: never change them);
# tests/unit/test_device_fingerprint.py proves the two implementations agree.
_BLOCK = 4096  # L: words per weight block, a power of two (g mod L = g & (L - 1))
_BLOCK_BITS = 12
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment: T[i] = mix(i + golden) | 1
_SALT = _GOLDEN ^ 0x5BD1E995  # U(b) = mix(b + salt) | 1
# Bound on the device memory of temporaries, whatever the tensor's size: each step takes
# a slab of words such that its word-sized temporaries (_BLOCK_TEMPS or _ROW_TEMPS of
# them, 8 bytes a word) fit in it. Tests lower it to cross slab boundaries cheaply.
_SLAB_BYTES = 64 << 20
_BLOCK_TEMPS = 2  # block path: an aligned copy of misaligned bytes, the products
_ROW_TEMPS = 4  # row path: the realigned rows, word indices, weights, one mix temporary


def partial_on_device(
    local: torch.Tensor, global_shape: Sequence[int], offsets: Sequence[int]
) -> int:
    """This shard's share of the ``wsum64-v2`` digest of the global tensor, computed on
    ``local``'s device: the same int in [0, 2**64) as ``fingerprint.partial(..., V2)``.

    Args:
        local: the shard (any device, dtype, strides; a whole tensor is its own shard).
        global_shape: the global tensor's shape.
        offsets: where ``local`` starts in the global tensor, per dimension.

    Returns:
        The partial sum; ``fingerprint.combine`` adds the shards' partials.

    Example:
        >>> t = torch.arange(6.0, device="cuda").reshape(2, 3)
        >>> fingerprint.combine([partial_on_device(t[:, :1], t.shape, [0, 0]),
        ...                      partial_on_device(t[:, 1:], t.shape, [0, 1])])
        '...'  # == fingerprint.fingerprint(t.cpu())
    """
    import torch

    if local.numel() == 0:
        return 0
    data = _row_major_bytes(local)
    runs = _Runs.of(list(local.shape), list(global_shape), list(offsets), local.element_size())
    total = torch.zeros((), dtype=torch.int64, device=data.device)
    if runs.count == 1 or runs.length // 8 + 2 > _slab_words(_ROW_TEMPS):
        for n, start in enumerate(runs.host_starts()):
            total += _run_sum(data[n * runs.length : (n + 1) * runs.length], start)
    else:
        total += _rows_sum(data, runs)
    return int(total.item()) & _MASK


def _slab_words(temps: int) -> int:
    """Words per slab: ``temps`` word-sized temporaries fit in :data:`_SLAB_BYTES`; a
    whole number of blocks, at least one."""
    return max(_BLOCK, _SLAB_BYTES // (8 * temps) // _BLOCK * _BLOCK)


def _run_sum(data: torch.Tensor, b0: int) -> torch.Tensor:
    """Weighted sum (0-d int64) of one run of bytes ``data`` from global byte ``b0``:
    shares of the words it starts and ends inside, whole words a slab at a time."""
    import torch

    n = data.numel()
    head = min(-b0 % 8, n)
    total = torch.zeros((), dtype=torch.int64, device=data.device)
    if head:
        total += _share(data[:head], b0)
    whole, g0 = (n - head) // 8, (b0 + head) // 8
    slab = _slab_words(_BLOCK_TEMPS)
    pos = 0
    while pos < whole:  # after the first slab every slab starts on a block
        take = min(whole - pos, slab - (g0 + pos) % _BLOCK)
        chunk = data[head + 8 * pos : head + 8 * (pos + take)]
        total += _words_sum(_as_words(chunk), g0 + pos)
        pos += take
    if head + 8 * whole < n:
        total += _share(data[head + 8 * whole :], b0 + head + 8 * whole)
    return total


def _as_words(chunk: torch.Tensor) -> torch.Tensor:
    """Bytes (a multiple of 8) as int64 words; copied first if not 8-byte aligned."""
    import torch

    if chunk.storage_offset() % 8 or chunk.data_ptr() % 8:
        chunk = chunk.clone()
    return chunk.view(torch.int64)


def _share(part: torch.Tensor, b: int) -> torch.Tensor:
    """Weighted value of the bytes ``part`` inside one word, from global byte ``b``, the
    word's other bytes taken as zero: the shares of a word's bytes add up to it."""
    import torch

    g, shift = divmod(b, 8)
    table, powers = _constants(part.device)
    value = (part.to(torch.int64) * powers[shift : shift + part.numel()]).sum()
    return value * table[g % _BLOCK] * _signed(_block_weight_int(g // _BLOCK))


def _words_sum(words: torch.Tensor, g0: int) -> torch.Tensor:
    """Weighted sum (0-d int64) of int64 ``words`` from global word ``g0``: a partial
    block at either end, whole blocks as ``[blocks, L] * T`` summed per block times U."""
    import torch

    table = _constants(words.device)[0]
    n, pos = words.numel(), 0
    total = torch.zeros((), dtype=torch.int64, device=words.device)
    while pos < n:
        block, within = divmod(g0 + pos, _BLOCK)
        if within or n - pos < _BLOCK:  # a partial block: head or tail of the slab
            take = min(_BLOCK - within, n - pos)
            part = (words[pos : pos + take] * table[within : within + take]).sum()
            total += part * _signed(_block_weight_int(block))
            pos += take
            continue
        count = (n - pos) // _BLOCK
        sums = (words[pos : pos + count * _BLOCK].view(count, _BLOCK) * table).sum(dim=1)
        blocks = torch.arange(block, block + count, dtype=torch.int64, device=words.device)
        total += (sums * _block_weights(blocks)).sum()
        pos += count * _BLOCK
    return total


def _rows_sum(data: torch.Tensor, runs: _Runs) -> torch.Tensor:
    """Weighted sum (0-d int64) of many short runs, a slab of rows at a time, no Python
    loop per row: each word weighted by T gathered and U computed from its global index."""
    import torch

    device, length = data.device, runs.length
    residues = runs.residues()
    aligned = residues == [0] and length % 8 == 0  # rows are whole words already
    width = length // 8 if aligned else (residues[-1] + length + 7) // 8  # words a row
    per_slab = max(1, _slab_words(_ROW_TEMPS) // width)
    table = _constants(device)[0]
    cols = torch.arange(width, dtype=torch.int64, device=device)
    total = torch.zeros((), dtype=torch.int64, device=device)
    for first in range(0, runs.count, per_slab):
        count = min(per_slab, runs.count - first)
        rows = data[first * length : (first + count) * length]
        starts = runs.starts(first, count, device)
        if aligned:
            words = _as_words(rows).view(count, width)
        else:
            words = _realigned(rows.view(count, length), starts & 7, residues, width)
        g = (starts >> 3).unsqueeze(1) + cols  # each word's global index
        weight = table[g & (_BLOCK - 1)]
        weight *= _block_weights(g.bitwise_right_shift_(_BLOCK_BITS))
        del g
        weight *= words
        total += weight.sum()
    return total


def _realigned(
    rows: torch.Tensor, shifts: torch.Tensor, residues: list[int], width: int
) -> torch.Tensor:
    """Rows of bytes placed ``shift`` zero bytes into rows of ``width`` words, so that
    word ``j`` of row ``n`` is global word ``start_n // 8 + j`` (or the row's share of
    it). One pass per residue a start may have (at most 8), each over the whole slab."""
    import torch

    count, length = rows.shape
    buf = torch.zeros(count, 8 * width, dtype=torch.uint8, device=rows.device)
    for s in residues:
        dst = buf[:, s : s + length]
        dst.copy_(rows if len(residues) == 1 else torch.where((shifts == s)[:, None], rows, dst))
    return buf.view(torch.int64)


def _block_weights(blocks: torch.Tensor) -> torch.Tensor:
    """U(b) for int64 block numbers ``blocks``, computed in place: mix(b + salt) | 1."""
    blocks += _signed(_SALT)
    return _mix_(blocks).bitwise_or_(1)


@functools.cache
def _constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``T`` (L odd int64 weights) and the byte place values ``256**i`` (i < 8), made on
    ``device`` with torch ops once per device."""
    import torch

    table = torch.arange(_BLOCK, dtype=torch.int64, device=device) + _signed(_GOLDEN)
    powers = torch.arange(8, dtype=torch.int64, device=device).mul_(8)
    return _mix_(table).bitwise_or_(1), torch.ones_like(powers).bitwise_left_shift_(powers)


def _mix_int(x: int) -> int:  # _mix_ on the host, for one block's U as a scalar
    x &= _MASK
    x = ((x ^ (x >> 30)) * _M1) & _MASK
    x = ((x ^ (x >> 27)) * _M2) & _MASK
    return x ^ (x >> 31)


def _block_weight_int(b: int) -> int:
    return _mix_int(b + _SALT) | 1
