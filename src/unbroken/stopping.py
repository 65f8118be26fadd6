"""When to stop: preemption signals and ``UNBROKEN_STOP_AT``, agreed on every rank."""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from . import collective

logger = logging.getLogger(__name__)

STOP_AT_ENV = "UNBROKEN_STOP_AT"
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopPolicy:
    """Catches SIGTERM/SIGUSR1 (main thread only) and answers ``should_stop(step)``.

    The answer for a step is computed once, as the maximum over ranks, so every rank
    sees the same value even when the signal reached them at different instants.
    """

    def __init__(self) -> None:
        self.signalled: int | None = None
        self._previous: dict[int, Any] = {}
        self._answers: dict[int, bool] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signalled = signum
        logger.warning(
            "received %s: will stop after the next checkpoint", signal.Signals(signum).name
        )

    def should_stop(self, step: int) -> bool:
        if step in self._answers:
            return self._answers[step]
        local = self.signalled is not None or _stop_at() == step
        if collective.active():
            flag = torch.tensor([int(local)], dtype=torch.int32)
            if dist.get_backend() == "nccl":
                flag = flag.cuda()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            local = bool(flag.item())
        self._answers = {step: local}
        return local

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def _stop_at() -> int | None:
    raw = os.environ.get(STOP_AT_ENV)
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{STOP_AT_ENV}={raw!r} is not a step number") from None
