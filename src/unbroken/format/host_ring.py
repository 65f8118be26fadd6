"""A bounded ring of reused host buffers between a GPU and files.

A sync save copies each CUDA tensor to the host piece by piece and writes each piece while
the next one is copied; a restore reads each piece from the file while the one before is
copied to the device. The pieces pass through pinned (page-locked) buffers: a copy from or
to pinned memory runs at the bus's speed (55 GB/s measured on an H200, against 1.2 GB/s
into new pageable memory), and a buffer that is reused costs no page faults.

The buffers are allocated once per process and device, on first use, and kept: at most
``UNBROKEN_PINNED_MB`` MiB in all (default 256), however large the state; each reader
or writer thread borrows a ring of two pieces (``RINGS`` rings share the bound).
Allocating them costs about what pinning that much memory costs (tens of milliseconds
for the default), once.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch

from ..env import env_number
from .shards import row_major

PINNED_ENV = "UNBROKEN_PINNED_MB"
DEFAULT_PINNED_MB = 256
RINGS = 8  # threads that may hold a ring at once (shard_reader.MAX_READERS)
SLOTS = 2  # pieces per ring: one being used on the host, one being copied


def pinned_bound() -> int:
    """The most pinned host memory the rings of one device may hold, in bytes."""
    return int(env_number(PINNED_ENV, DEFAULT_PINNED_MB, 1)) << 20


def through_ring(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes go to and from files through a ring (a CUDA tensor's do; a
    CPU tensor's are read and written in place)."""
    return t.device.type == "cuda"


class HostRing:
    """Two host buffers of ``piece`` bytes and, for a CUDA device, a side stream for the
    copies. One thread uses a ring at a time (:func:`borrow`)."""

    def __init__(self, device: torch.device, piece: int) -> None:
        self.device = device
        self.piece = piece
        cuda = device.type == "cuda"
        self._slots = [torch.empty(piece, dtype=torch.uint8, pin_memory=cuda) for _ in range(SLOTS)]
        self._stream = torch.cuda.Stream(device=device) if cuda else None
        self._done: list[torch.cuda.Event | None] = [None] * SLOTS

    def download(self, t: torch.Tensor) -> Iterator[memoryview]:
        """``t``'s bytes (row-major) as consecutive host pieces. The next piece is copied
        while the caller uses this one, which stays valid until it asks for the next."""
        flat = _flat_bytes(t)
        n = flat.numel()
        starts = list(range(0, n, self.piece))
        if self._stream is not None:  # the copies see what work queued so far wrote
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        for i in range(min(SLOTS, len(starts))):
            self._copy_out(flat, starts[i], i)
        for i, start in enumerate(starts):
            k = i % SLOTS
            self._wait(k)
            size = min(self.piece, n - start)
            yield memoryview(self._slots[k][:size].numpy())
            if i + SLOTS < len(starts):  # the caller is done with slot k: refill it
                self._copy_out(flat, starts[i + SLOTS], k)

    def upload(self, t: torch.Tensor, fill: Callable[[memoryview], None]) -> None:
        """Fill ``t`` (contiguous) piece by piece: ``fill`` writes the next piece's bytes
        into a host view, copied to the device while the next piece is filled. On return
        every copy has completed (any stream or thread may use ``t``)."""
        flat = _flat_bytes(t)
        n = flat.numel()
        for i, start in enumerate(range(0, n, self.piece)):
            k = i % SLOTS
            self._wait(k)
            size = min(self.piece, n - start)
            host = self._slots[k][:size]
            fill(memoryview(host.numpy()))
            with self._on_stream():
                flat[start : start + size].copy_(host, non_blocking=self._stream is not None)
                self._record(k)
        for k in range(SLOTS):
            self._wait(k)

    def _copy_out(self, flat: torch.Tensor, start: int, k: int) -> None:
        size = min(self.piece, flat.numel() - start)
        with self._on_stream():
            self._slots[k][:size].copy_(
                flat[start : start + size], non_blocking=self._stream is not None
            )
            self._record(k)

    def _on_stream(self) -> contextlib.AbstractContextManager:
        return (
            torch.cuda.stream(self._stream)
            if self._stream is not None
            else contextlib.nullcontext()
        )

    def _record(self, k: int) -> None:
        if self._stream is not None:
            event = torch.cuda.Event()
            event.record(self._stream)
            self._done[k] = event

    def _wait(self, k: int) -> None:
        event, self._done[k] = self._done[k], None
        if event is not None:
            event.synchronize()


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return row_major(t).view(torch.uint8)  # not row-major: a copy on the device


class _Pool:
    """The rings of each device, made on first use and kept, lent one thread at a time."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._free: dict[torch.device, list[HostRing]] = {}
        self._made: dict[torch.device, int] = {}

    @contextlib.contextmanager
    def borrow(self, device: torch.device) -> Iterator[HostRing]:
        with self._lock:
            free = self._free.setdefault(device, [])
            while not free and self._made.get(device, 0) >= RINGS:
                self._lock.wait()
            if free:
                ring = free.pop()
            else:
                self._made[device] = self._made.get(device, 0) + 1
                ring = None
        if ring is None:
            try:
                ring = HostRing(device, max(1, pinned_bound() // (RINGS * SLOTS)))
            except BaseException:
                with self._lock:
                    self._made[device] -= 1
                    self._lock.notify()
                raise
        try:
            yield ring
        finally:
            with self._lock:
                self._free[device].append(ring)
                self._lock.notify()


_POOL = _Pool()


def borrow(device: torch.device) -> contextlib.AbstractContextManager[HostRing]:
    """A ring for ``device``, this thread's until the block ends (waits while all
    ``RINGS`` are lent)."""
    return _POOL.borrow(device)
