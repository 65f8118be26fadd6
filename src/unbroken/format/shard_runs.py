"""Where a shard's elements lie in its global tensor, and the 64-bit integer helpers the
torch-op fingerprints share (``device_fingerprint``: wsum64-v2; ``mix64``: mix64-v3).

int64 products and sums wrap in two's complement on every device, which is arithmetic
modulo 2**64; constants above 2**63 enter as their signed equivalents (:func:`signed`)
and a logical right shift is an arithmetic one masked (:func:`lsr`).
"""

from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_MASK = (1 << 64) - 1
M1, M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's finalizer (persisted)


def row_major_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as contiguous row-major bytes, on its device (a copy only if needed)."""
    import torch

    from .shards import row_major

    return row_major(t.detach().resolve_conj().resolve_neg()).view(torch.uint8)


@dataclass(frozen=True)
class Runs:
    """Where a shard's bytes lie in the global byte stream: ``count`` runs of ``length``
    bytes, run ``n`` (row-major over the leading dims ``sizes``) starting at global byte
    ``base + sum(i_d * strides[d])``, ``i`` the multi-index of ``n``."""

    count: int
    length: int
    base: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]  # global byte strides of the leading dims

    @classmethod
    def of(cls, sizes: list[int], shape: list[int], offsets: list[int], size: int) -> Runs:
        """As ``fingerprint.partial`` cuts them: runs span dims from the last cut one on."""
        if not sizes:  # 0-d: one element
            return cls(1, size, 0, (), ())
        strides = [size * math.prod(shape[d + 1 :]) for d in range(len(shape))]
        cut = [d for d in range(len(shape)) if sizes[d] != shape[d]]
        k = cut[-1] if cut else 0
        base = sum(offsets[d] * strides[d] for d in range(k + 1))
        lead = tuple(sizes[:k])
        return cls(math.prod(lead), sizes[k] * strides[k], base, lead, tuple(strides[:k]))

    def host_starts(self) -> list[int]:
        """Each run's first global byte (used when runs are few)."""
        indices = itertools.product(*(range(s) for s in self.sizes))
        return [self.base + sum(map(operator.mul, i, self.strides)) for i in indices]

    def starts(self, first: int, count: int, device: torch.device) -> torch.Tensor:
        """First global bytes of runs ``first .. first + count - 1``, on ``device``."""
        import torch

        n = torch.arange(first, first + count, dtype=torch.int64, device=device)
        start = torch.full_like(n, self.base)
        for size, stride in zip(reversed(self.sizes), reversed(self.strides), strict=True):
            start += (n % size) * stride
            n = n // size
        return start

    def residues(self) -> list[int]:
        """Every value ``start % 8`` of a run may take (a superset: few and cheap)."""
        found = {self.base % 8}
        for size, stride in zip(self.sizes, self.strides, strict=True):
            found = {(r + i * stride) % 8 for r in found for i in range(min(size, 8))}
        return sorted(found)


def mix_(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 ``x`` in place, mod 2**64."""
    x ^= lsr(x, 30)
    x *= signed(M1)
    x ^= lsr(x, 27)
    x *= signed(M2)
    x ^= lsr(x, 31)
    return x


def lsr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 ``x`` by ``s`` in 1..63 (``>>`` is arithmetic)."""
    return (x >> s).bitwise_and_((1 << (64 - s)) - 1)


def signed(x: int) -> int:
    """``x`` mod 2**64 as the int64 with the same bits."""
    x &= _MASK
    return x - (1 << 64) if x >> 63 else x
