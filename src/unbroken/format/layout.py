"""Memory layout (strides) of saved tensors.

Fused optimizer kernels pair a parameter's elements with its state's elements by memory
position, so a state tensor restored contiguous for a channels_last or transposed
parameter changes the next step. Dense layouts (a permutation of the dimensions, such as
channels_last) are recorded as strides in the manifest and restored as they were.
Tensors with gaps or overlaps (views) are stored by value and come back dense.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only annotations: the manifest's checks need no torch
    import torch

MAX_STRIDE = 2**62


def is_dense(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """True when ``stride`` lays out ``shape`` with neither gaps nor overlaps."""
    if len(shape) != len(stride):
        return False
    if any(s == 0 for s in shape):
        return True
    expected = 1
    dims = sorted((st, n) for n, st in zip(shape, stride, strict=True) if n > 1)
    for step, size in dims:
        if step != expected:
            return False
        expected *= size
    return True


def recorded_stride(t: torch.Tensor) -> list[int] | None:
    """The strides to record for a plain tensor, or None (sharded, or not dense)."""
    stride = list(t.stride())
    return stride if is_dense(t.shape, stride) else None


def valid_stride(shape: Sequence[int], stride: object) -> bool:
    """A recorded stride a manifest may carry: ints in range that lay out ``shape`` densely."""
    return (
        isinstance(stride, list)
        and all(_stride_value(s) for s in stride)
        and is_dense(shape, stride)
    )


def contiguous(shape: Sequence[int]) -> list[int]:
    """The strides of a contiguous (row-major) tensor of ``shape``."""
    out, step = [], 1
    for size in reversed(list(shape)):
        out.append(step)
        step *= max(size, 1)
    return out[::-1]


def _stride_value(s: object) -> bool:
    return isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= MAX_STRIDE


def describe(stride: Sequence[int], shape: Sequence[int]) -> str:
    """A short readable name for a layout, for error messages."""
    kind = "contiguous" if list(stride) == contiguous(shape) else "non-contiguous"
    return f"{kind} strides {tuple(stride)}"
