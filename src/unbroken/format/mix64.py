"""The ``mix64-v3`` fingerprint: every unit mixed on its own, then summed.

``wsum64`` weighed words by odd constants modulo 2**64, so a change confined to high
bits stayed there: two float64 sign flips (2**63 each) cancelled, and in general 2**(64-k)
flips of bit k did. Here each unit goes through a 64-bit mixing function first::

    fp(t) = sum_u  mix(x(u) ^ key(u))      (mod 2**64),   key(u) = u * GOLDEN + SALT

where ``u`` is the global (row-major) unit index, ``x(u)`` the unit's bytes as a
little-endian unsigned integer, and ``mix`` splitmix64's finalizer (a bijection whose
every output bit depends on every input bit). A unit is one element; an element wider
than 8 bytes is several 8-byte units. Any change of units turns their terms into
unrelated 64-bit values, so no fixed pattern of changes (sign flips, flips of one bit
position, swaps, permutations, a negation) cancels but by chance, about 2**-64.

Units never straddle a shard (shards cut between elements), so the sum stays additive
over shards: each shard adds its own units with their global indices, on any device.

Two implementations, the same digest bit for bit (tests/unit/test_mix64.py):

- the host kernel ``mix64_kernel`` (C, built at install, one core, no GIL), for CPU tensors;
- torch ops (:func:`partial_torch`) on the tensor's own device, and on the CPU where the
  kernel was not built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .shard_runs import Runs, mix_, row_major_bytes, signed

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

try:  # the optional compiled kernel (setup.py); torch ops compute the same without it
    from . import mix64_kernel as _kernel
except ImportError:  # pragma: no cover - only where no compiler was found at install
    _kernel = None

_MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
SALT = 0xD1B54A32D192ED03  # persisted with the format: never change either constant
_BATCH_RUNS = 1 << 20  # run starts made at a time (8 bytes each)
# Bound on temporaries of the torch path: each step holds a few int64 tensors of this
# many units (values, indices, the mix). Tests lower it to cross slab boundaries.
_SLAB_UNITS = 4 << 20


def has_kernel() -> bool:
    """Whether the compiled host kernel is available (else CPU tensors use torch ops)."""
    return _kernel is not None


def partial(local: torch.Tensor, global_shape: Sequence[int], offsets: Sequence[int]) -> int:
    """This shard's share of the ``mix64-v3`` digest of the global tensor, in [0, 2**64).

    Args:
        local: the shard (any device, dtype, strides; a whole tensor is its own shard).
        global_shape: the global tensor's shape.
        offsets: where ``local`` starts in the global tensor, per dimension.
    """
    if local.numel() == 0:
        return 0
    if local.device.type == "cpu" and _kernel is not None:
        return _partial_host(local, global_shape, offsets)
    return partial_torch(local, global_shape, offsets)


def _unit(local: torch.Tensor) -> int:
    return min(local.element_size(), 8)


def _partial_host(local: torch.Tensor, global_shape: Sequence[int], offsets: Sequence[int]) -> int:
    import torch

    data = row_major_bytes(local).numpy()
    unit = _unit(local)
    runs = Runs.of(list(local.shape), list(global_shape), list(offsets), local.element_size())
    total = 0
    cpu = torch.device("cpu")
    for first in range(0, runs.count, _BATCH_RUNS):
        count = min(_BATCH_RUNS, runs.count - first)
        starts = (runs.starts(first, count, cpu) // unit).numpy()
        chunk = data[first * runs.length : (first + count) * runs.length]
        total += _kernel.run_sum(chunk, unit, runs.length // unit, starts)
    return total & _MASK


def partial_torch(local: torch.Tensor, global_shape: Sequence[int], offsets: Sequence[int]) -> int:
    """:func:`partial` with torch ops on ``local``'s device; only the sum leaves it."""
    import torch

    if local.numel() == 0:
        return 0
    data = row_major_bytes(local)
    unit = _unit(local)
    runs = Runs.of(list(local.shape), list(global_shape), list(offsets), local.element_size())
    run_units = runs.length // unit
    total = torch.zeros((), dtype=torch.int64, device=data.device)
    if run_units >= _SLAB_UNITS:  # long runs: one at a time, a slab of each at a time
        for n, start in enumerate(runs.host_starts()):
            for pos in range(0, run_units, _SLAB_UNITS):
                take = min(_SLAB_UNITS, run_units - pos)
                begin = n * runs.length + pos * unit
                index = torch.arange(take, dtype=torch.int64, device=data.device)
                index += start // unit + pos
                total += _terms(data[begin : begin + take * unit], unit, index).sum()
        return int(total.item()) & _MASK
    per_slab = max(1, _SLAB_UNITS // run_units)
    cols = torch.arange(run_units, dtype=torch.int64, device=data.device)
    for first in range(0, runs.count, per_slab):
        count = min(per_slab, runs.count - first)
        index = (runs.starts(first, count, data.device) // unit).unsqueeze(1) + cols
        rows = data[first * runs.length : (first + count) * runs.length]
        total += _terms(rows, unit, index.view(-1)).sum()
    return int(total.item()) & _MASK


def _terms(raw: torch.Tensor, unit: int, index: torch.Tensor) -> torch.Tensor:
    """``mix(x(u) ^ key(u))`` for the units in bytes ``raw`` at global indices ``index``
    (int64 arithmetic wraps modulo 2**64 on every device; ``index`` is reused)."""
    import torch

    if unit == 1:
        values = raw.to(torch.int64)
    else:
        words = {2: torch.int16, 4: torch.int32, 8: torch.int64}[unit]
        values = raw.view(words).to(torch.int64)
        if unit < 8:  # zero-extend, as the kernel reads unsigned units
            values.bitwise_and_((1 << (8 * unit)) - 1)
    key = index.mul_(signed(GOLDEN)).add_(signed(SALT))
    return mix_(key.bitwise_xor_(values))
