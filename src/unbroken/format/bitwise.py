"""The one rule for "the same value": the same bits.

Exactness is what the library promises, so every comparison that decides whether a
resume was exact compares bits, never numbers:

- Tensors compare as raw words (:func:`equal`; :func:`differing` per element): a NaN
  equals the same NaN (same payload), and -0.0 differs from 0.0. The restore check
  (core/verify.py), the in-place install (live/exchange.py), tied weights
  (tools/tying.py) and the optimizer watch (run/optimizer_watch.py) use
  :func:`equal`; an element-by-element diff of two tensors uses :func:`differing`.
- Python floats (tracked metrics read back from a metrics record, floats in a saved
  state's JSON skeleton) compare by their IEEE-754 bits (:func:`same_float`), except that
  any NaN equals any NaN: JSON stores a non-finite value as text (``"nan"``) and keeps no
  NaN payload, so two NaNs read back cannot be told apart. -0.0 still differs from 0.0.
  The replay check (run/replay_check.py), the resume test (proof/replay.py), the
  check of non-tensor state after a restore (format/tree.py ``difference``) and the
  comparison of two checkpoints' state (format/state_compare.py) use it.

Comparing int64 words is about 7x faster than comparing bytes. Torch is imported only
by the tensor functions: a manifest's checks, which use the float rule, need none.
"""

from __future__ import annotations

import math
import struct
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the float rule needs no torch (a manifest's checks import this module)
    import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.to_local() if isinstance(t, DTensor) else t).detach()


def words(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (a DTensor's local shard) in row-major order, as the widest
    integer words that divide them."""
    import torch

    raw = _local(t).contiguous().reshape(-1).view(torch.uint8)
    for size, dtype in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if raw.numel() % size == 0:
            return raw.view(dtype)
    return raw


def equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same bytes in the same order (shape and dtype are
    the caller's to compare).

    Example::

        bitwise.equal(torch.tensor([math.nan]), torch.tensor([math.nan]))  # True
        bitwise.equal(torch.tensor([0.0]), torch.tensor([-0.0]))  # False
    """
    import torch

    wa, wb = words(a), words(b)
    return wa.dtype == wb.dtype and torch.equal(wa, wb)


def differing(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per element of ``a`` and ``b`` (same shape and dtype; a DTensor's local shard), in
    row-major order: do the stored bits differ? A 1-d bool tensor of ``a.numel()``.

    Raises:
        ValueError: the two differ in dtype or number of elements.

    Example::

        bitwise.differing(torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.0]))
        # tensor([ True, False])
    """
    import torch

    la, lb = _local(a), _local(b)
    if la.dtype != lb.dtype or la.numel() != lb.numel():
        raise ValueError(
            f"cannot compare {la.dtype} x {la.numel()} with {lb.dtype} x {lb.numel()} "
            "element by element"
        )
    n, size = la.numel(), la.element_size()
    if n == 0:
        return torch.zeros(0, dtype=torch.bool)
    fa, fb = la.contiguous().reshape(-1), lb.contiguous().reshape(-1)
    # An integer dtype of the element's width reinterprets it.
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(size)
    if as_int is not None:
        return fa.view(as_int) != fb.view(as_int)
    # Wider elements (complex128): compare their bytes, any of them.
    return (fa.view(torch.uint8).view(n, size) != fb.view(torch.uint8).view(n, size)).any(dim=1)


def same_float(x: float, y: float) -> bool:
    """Whether two tracked metric values are the same: the same IEEE-754 bits, except
    that any NaN equals any NaN (a metrics record keeps no NaN payload); -0.0 differs
    from 0.0.

    Example::

        same_float(math.nan, -math.nan)  # True
        same_float(0.0, -0.0)  # False
    """
    if math.isnan(x) and math.isnan(y):
        return True
    return struct.pack("<d", x) == struct.pack("<d", y)
