"""Layout-independent digests of tensor values.

A fingerprint must come out the same whether a tensor is whole on one process or split
into shards across many, so that a checkpoint saved on 2 ranks can be verified after a
restore on 3. We use a position-weighted sum over the tensor's raw words, modulo 2**64::

    fp(t) = sum_g  word(g) * T[g mod L] * U(g div L)      (mod 2**64)

where ``g`` is the global (row-major) word index, ``T`` is a fixed table of odd 64-bit
constants and ``U`` a 64-bit mix of the block number. Each shard adds up its own words
with their global indices and the partial sums add up to the whole tensor's digest.
Any change of a single element always changes the digest (the weights are odd); it is
a check against silent loss and casting, not a cryptographic hash (files carry xxh3
checksums for integrity).

Format ``wsum64-v1``: persisted in manifests, so the constants below must never change.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence

import numpy as np
import torch

ALGORITHM = "wsum64-v1"
_MASK = (1 << 64) - 1
_BLOCK = 4096  # L: words per weight block
_SLAB_BLOCKS = 64  # blocks processed per vectorized step (2 MiB of int64)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


_TABLE = np.array([_splitmix64(i) | 1 for i in range(_BLOCK)], dtype=np.uint64).view(np.int64)
_SALT = np.uint64(0x9E3779B97F4A7C15 ^ 0x5BD1E995)
_WORD_DTYPES = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _block_weights(first_block: int, count: int) -> np.ndarray:
    """U(b) for b in [first_block, first_block + count): splitmix64 of ``b + salt``, odd."""
    x = np.arange(first_block, first_block + count, dtype=np.uint64) + _SALT
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return ((x ^ (x >> np.uint64(31))) | np.uint64(1)).view(np.int64)


def _words(t: torch.Tensor) -> tuple[np.ndarray, int]:
    """The tensor's bytes as a 1-D array of integer words, and words per element."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    size = t.element_size()
    word = min(size, 8)
    raw = t.view(torch.uint8) if size != 1 else t.view(torch.int8)
    return raw.view(_WORD_DTYPES[word]).numpy(), size // word


def _run_sum(words: np.ndarray, g0: int) -> int:
    """Weighted sum of a contiguous run of words starting at global word index ``g0``.

    NumPy on one core, on purpose: it releases the GIL and keeps off torch's intra-op
    thread pool, so fingerprinting beside I/O (or training) does not oversubscribe cores.
    Integer products and sums wrap modulo 2**64, which is the arithmetic we want.
    """
    n = words.size
    total = 0
    pos = 0
    slab = np.empty((_SLAB_BLOCKS, _BLOCK), dtype=np.int64)
    with np.errstate(over="ignore"):
        while pos < n:
            block, within = divmod(g0 + pos, _BLOCK)
            if within or n - pos < _BLOCK:  # a partial block: head or tail of the run
                take = min(_BLOCK - within, n - pos)
                seg = words[pos : pos + take].astype(np.int64)
                part = int((seg * _TABLE[within : within + take]).sum())
                total += part * int(_block_weights(block, 1)[0])
                pos += take
                continue
            nblocks = min((n - pos) // _BLOCK, _SLAB_BLOCKS)
            seg = words[pos : pos + nblocks * _BLOCK].reshape(nblocks, _BLOCK)
            prod = slab[:nblocks]
            np.multiply(seg, _TABLE, out=prod, casting="unsafe")
            total += int((prod.sum(axis=1) * _block_weights(block, nblocks)).sum())
            pos += nblocks * _BLOCK
    return total & _MASK


def partial(local: torch.Tensor, global_shape: Sequence[int], offsets: Sequence[int]) -> int:
    """This shard's share of the digest of the global tensor (an int in [0, 2**64))."""
    words, per_elem = _words(local)
    if local.numel() == 0:
        return 0
    sizes = list(local.shape)
    shape = list(global_shape)
    if len(sizes) == 0:
        return _run_sum(words, 0)
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    partial_dims = [d for d in range(len(shape)) if sizes[d] != shape[d]]
    k = partial_dims[-1] if partial_dims else 0
    run = sizes[k] * strides[k]  # elements per contiguous run
    total = 0
    for n, idx in enumerate(_leading_indices(sizes[:k])):
        start = sum((offsets[d] + idx[d]) * strides[d] for d in range(k)) + offsets[k] * strides[k]
        chunk = words[n * run * per_elem : (n + 1) * run * per_elem]
        total += _run_sum(chunk, start * per_elem)
    return total & _MASK


def _leading_indices(sizes: Sequence[int]) -> Iterator[tuple[int, ...]]:
    return itertools.product(*(range(s) for s in sizes))


def combine(partials: Sequence[int]) -> str:
    """Digest of a tensor from the partial sums of its shards, as 16 hex digits."""
    return f"{sum(partials) & _MASK:016x}"


def fingerprint(t: torch.Tensor) -> str:
    """Digest of a whole (unsharded) tensor."""
    return combine([partial(t, t.shape, [0] * t.dim())])
