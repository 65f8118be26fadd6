"""Copies of the state that training can no longer change, for saves in the background.

Buffers are allocated once and reused by later saves of the same shapes, so staging costs
one copy into memory that is already mapped (no page faults), not an allocation. On a
CUDA device the buffers are pinned host memory, so the copy runs at full bus speed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch.distributed.tensor import DTensor


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose memory holds ``t``'s values on this rank (a DTensor's shard)."""
    return (t.to_local() if isinstance(t, DTensor) else t).detach()


def on_device(t: torch.Tensor) -> bool:
    """Whether ``t`` lives in a device's memory (where a copy beside it is cheap)."""
    return t.is_cuda


def device_copy(part: torch.Tensor) -> torch.Tensor:
    """A copy of ``part`` beside it, on its own device."""
    return part.clone()


def _like(t: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """``part`` (a copy of ``t``'s local values) as ``t`` is: a DTensor keeps its mesh and
    placements."""
    if not isinstance(t, DTensor):
        return part
    return DTensor.from_local(
        part, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
    )


def settle(flat: dict[str, torch.Tensor]) -> None:
    """Wait for the work queued on this thread's current CUDA streams: the threads that
    then read ``flat`` (writers, fingerprints: each on its own stream) see final values,
    whatever stream the caller trains on."""
    for device in {local(t).device for t in flat.values() if local(t).is_cuda}:
        torch.cuda.current_stream(device).synchronize()


class StagingBuffers:
    """One host buffer per saved tensor key, reused across saves.

    Thread safety: one ``copy`` at a time (a save in the background copies while the
    training thread waits for it before the next save).
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}  # for copies behind training

    def _buffer(self, key: str, like: torch.Tensor) -> torch.Tensor:
        if not self._has_buffer(key, like):
            pin = like.device.type == "cuda"
            self._buffers[key] = torch.empty(
                like.shape, dtype=like.dtype, device="cpu", pin_memory=pin
            )
        return self._buffers[key]

    def copy(
        self, flat: dict[str, torch.Tensor], *, after: torch.cuda.Event | None = None
    ) -> dict[str, torch.Tensor]:
        """Host copies of ``flat`` (DTensors keep their mesh and placements).

        ``after``: a CUDA event recorded by the training thread at ``save()``; the copies
        of CUDA tensors then run on a side stream once that event has passed, so a copy in
        the background never waits for (nor delays) later work on the training stream.
        """
        out: dict[str, torch.Tensor] = {}
        pending_cuda = False
        with self._side_stream(flat, after) as stream:
            for key, t in flat.items():
                part = local(t)
                buf = self._buffer(key, part)
                non_blocking = part.device.type == "cuda"
                buf.copy_(part, non_blocking=non_blocking)
                pending_cuda |= non_blocking
                out[key] = _like(t, buf)
        if pending_cuda and stream is not None:
            stream.synchronize()
        elif pending_cuda:
            torch.cuda.synchronize()
        return out

    @contextmanager
    def _side_stream(
        self, flat: dict[str, torch.Tensor], after: torch.cuda.Event | None
    ) -> Iterator[torch.cuda.Stream | None]:
        """With ``after``: this device's side stream, current in the block, once the event
        has passed; else no stream (the current one)."""
        if after is None:
            yield None
            return
        # The tensors' device, not this thread's current one (device 0 in a new thread).
        device = next(local(t).device for t in flat.values() if local(t).is_cuda)
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        stream.wait_event(after)
        with torch.cuda.stream(stream):
            yield stream

    def hold_on_device(
        self, flat: dict[str, torch.Tensor], *, after: torch.cuda.Event | None = None
    ) -> dict[str, torch.Tensor] | None:
        """Where some tensor of ``flat`` has no host buffer yet (the first save, or new
        shapes): copies of ``flat`` on their own device, done once this returns, or None
        where there is no buffer to make, or no room on the device for the copies.

        Allocating pinned host memory takes about as long as a second per 3 GB; a copy on
        the device takes milliseconds. So a first save in the background holds the state
        on the device (one more copy of it there, until its host copy is done) and lets
        training change the live tensors sooner; :meth:`copy` of the held copies then
        allocates the buffers behind training."""
        if all(self._has_buffer(key, local(t)) for key, t in flat.items()):
            return None
        if not any(on_device(local(t)) for t in flat.values()):
            return None
        held: dict[str, torch.Tensor] = {}
        try:
            with self._side_stream(flat, after) as stream:
                for key, t in flat.items():
                    held[key] = _like(t, device_copy(local(t)))
                if stream is not None:
                    stream.synchronize()
        except torch.OutOfMemoryError:
            held.clear()  # no room: the buffers are made first, as without a hold
            return None
        return held

    def _has_buffer(self, key: str, like: torch.Tensor) -> bool:
        buf = self._buffers.get(key)
        return buf is not None and buf.shape == like.shape and buf.dtype == like.dtype

    def keep_only(self, keys: Iterable[str]) -> None:
        """Free the buffers of keys the last save no longer has."""
        for key in set(self._buffers) - set(keys):
            del self._buffers[key]
