"""When to stop: preemption signals and ``UNBROKEN_STOP_AT``, agreed on every rank."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

logger = logging.getLogger(__name__)

STOP_AT_ENV = "UNBROKEN_STOP_AT"
# "local": the save of the step a stop was asked at goes to the local tier (resume-test
# --tier local), so the resume must come from there.
STOP_TIER_ENV = "UNBROKEN_STOP_TIER"
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopPolicy:
    """Catches SIGTERM/SIGUSR1 (main thread only) and answers ``should_stop(step)``.

    The answer for a step is computed once and passed through ``agree`` (in a process
    group: True on every rank when True on any), so every rank sees the same value even
    when the signal reached them at different instants.
    """

    def __init__(self, agree: Callable[[bool], bool] = bool) -> None:
        self._agree = agree
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
        answer = self._agree(self.signalled is not None or _stop_at() == step)
        self._answers = {step: answer}
        return answer

    def stopping_at(self, step: int) -> bool:
        """Whether ``should_stop(step)`` said True (the save of ``step`` is a stop's)."""
        return self._answers.get(step, False)

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


def stop_tier() -> str:
    """The tier a stop's save goes to: ``UNBROKEN_STOP_TIER`` (default ``persistent``)."""
    raw = os.environ.get(STOP_TIER_ENV, "").strip() or "persistent"
    if raw not in ("persistent", "local"):
        raise ValueError(f"{STOP_TIER_ENV}={raw!r}: use local or persistent")
    return raw
