"""unbroken: resume PyTorch training exactly, and prove it on every resume."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._version import __version__
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    StateMismatchError,
)
from .report import RestoreReport

if TYPE_CHECKING:
    from .checkpointer import Checkpointer

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "Checkpointer",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "RestoreReport",
    "StateMismatchError",
    "__version__",
]


def __getattr__(name: str) -> Any:
    # Checkpointer imports torch (seconds); loaded on first use, so that `unbroken --help`
    # and the error classes cost nothing.
    if name == "Checkpointer":
        from .checkpointer import Checkpointer

        globals()["Checkpointer"] = Checkpointer
        return Checkpointer
    raise AttributeError(f"module 'unbroken' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
