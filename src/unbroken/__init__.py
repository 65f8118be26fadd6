"""unbroken: resume PyTorch training exactly, and prove it on every resume."""

from __future__ import annotations

import importlib
import sys
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
    from .tiers.config import LocalTier
    from .tools.comparison import DiffReport, diff_checkpoints
    from .tools.exporting import ExportResult, export_checkpoint
    from .tools.importing import ImportResult, import_checkpoint
    from .tools.inspection import CheckpointInspection, RunInspection, inspect_checkpoint
    from .tools.verification import CheckpointVerification, VerifyReport, verify_checkpoint

__all__ = [
    "CheckpointError",
    "CheckpointInspection",
    "CheckpointNotFoundError",
    "CheckpointVerification",
    "Checkpointer",
    "CorruptCheckpointError",
    "DiffReport",
    "ExportResult",
    "ImportResult",
    "IncompleteCheckpointError",
    "LocalTier",
    "RestoreReport",
    "RunInspection",
    "StateMismatchError",
    "VerifyReport",
    "__version__",
    "diff_checkpoints",
    "export_checkpoint",
    "import_checkpoint",
    "inspect_checkpoint",
    "verify_checkpoint",
]

# Loaded on first use: Checkpointer and most tools import torch (seconds), so that
# `import unbroken`, `unbroken --help` and the error classes cost nothing, and
# inspect_checkpoint on a run folder never needs torch.
_LAZY = {
    "Checkpointer": ".checkpointer",
    "CheckpointInspection": ".tools.inspection",
    "CheckpointVerification": ".tools.verification",
    "DiffReport": ".tools.comparison",
    "ExportResult": ".tools.exporting",
    "ImportResult": ".tools.importing",
    "LocalTier": ".tiers.config",
    "RunInspection": ".tools.inspection",
    "VerifyReport": ".tools.verification",
    "diff_checkpoints": ".tools.comparison",
    "export_checkpoint": ".tools.exporting",
    "import_checkpoint": ".tools.importing",
    "inspect_checkpoint": ".tools.inspection",
    "verify_checkpoint": ".tools.verification",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'unbroken' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if "torch" in sys.modules:
    # A training process (torch is in already, so this costs no import time): watch
    # optimizer steps from now on, so that a save made by a Checkpointer built later can
    # tell gradients a step already used from pending accumulation (live/gradients.py).
    importlib.import_module(".live.gradients", __name__)
