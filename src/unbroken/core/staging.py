"""Copies of the state that training can no longer change, for saves in the background.

Buffers are allocated once and reused by later saves of the same shapes, so staging costs
one copy into memory that is already mapped (no page faults), not an allocation. On a
CUDA device the buffers are pinned host memory, so the copy runs at full bus speed.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


class StagingBuffers:
    """One host buffer per saved tensor key, reused across saves."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def _buffer(self, key: str, like: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            pin = like.device.type == "cuda"
            buf = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pin)
            self._buffers[key] = buf
        return buf

    def copy(self, flat: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Host copies of ``flat`` (DTensors keep their mesh and placements)."""
        out: dict[str, torch.Tensor] = {}
        pending_cuda = False
        for key, t in flat.items():
            local = t.to_local() if isinstance(t, DTensor) else t
            buf = self._buffer(key, local.detach())
            non_blocking = local.device.type == "cuda"
            buf.copy_(local.detach(), non_blocking=non_blocking)
            pending_cuda |= non_blocking
            if isinstance(t, DTensor):
                buf = DTensor.from_local(
                    buf, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                    stride=t.stride(),
                )  # fmt: skip
            out[key] = buf
        if pending_cuda:
            torch.cuda.synchronize()
        for key in set(self._buffers) - set(flat):
            del self._buffers[key]
        return out
