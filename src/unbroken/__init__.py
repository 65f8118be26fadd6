"""unbroken: resume PyTorch training exactly, and prove it on every resume."""

from __future__ import annotations

from ._version import __version__
from .checkpointer import Checkpointer
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    StateMismatchError,
)
from .report import RestoreReport

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
