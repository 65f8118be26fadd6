"""TEST-ONLY: what Megatron-FSDP (megatron-core's vendored copy and the ``megatron-fsdp``
package) needs beyond ``tests/megatron_cpu.py`` to train on a CPU-only torch: CUDA
streams and events that do nothing (the CPU runs every operation in order), and a
current device index while a ``MegatronFSDP`` is built (it formats ``cuda:{index}``).
Import it first thing in a test script, never from the library.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch

import megatron_cpu


class _Event:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _Stream:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None) -> _Event:
        return event or _Event()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_STREAM = _Stream()


def install() -> None:
    """Streams and events as no-ops for the rest of this process (idempotent)."""
    megatron_cpu.install()
    if getattr(torch, "_megatron_fsdp_cpu_shim", False):
        return
    torch._megatron_fsdp_cpu_shim = True
    torch.cuda.Stream = _Stream
    torch.cuda.Event = _Event
    torch.cuda.current_stream = lambda *args, **kwargs: _STREAM
    torch.cuda.default_stream = lambda *args, **kwargs: _STREAM
    torch.cuda.stream = lambda *args, **kwargs: nullcontext()
    torch.Tensor.record_stream = lambda self, stream: None


@contextmanager
def device_index() -> Iterator[None]:
    """``torch.cuda.current_device()`` answers 0 (an index) while a ``MegatronFSDP`` is
    built; Megatron-Core's own code, after, expects the CPU device the shim gives."""
    shimmed = torch.cuda.current_device
    torch.cuda.current_device = lambda: 0
    try:
        yield
    finally:
        torch.cuda.current_device = shimmed


install()
