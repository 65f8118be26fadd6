"""Errors raised by unbroken.

Every error names what is wrong (component, parameter FQN, file, step, rank) and what
to do about it::

    CheckpointError                   root of everything this library raises on purpose
    ├── CheckpointNotFoundError       no such checkpoint folder, or no such step
    ├── IncompleteCheckpointError     the checkpoint lacks something the caller passed
    ├── CorruptCheckpointError        a file is missing, truncated, altered or unsafe
    └── StateMismatchError            the checkpoint does not fit the live objects, or
                                      post-restore verification failed
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Root of all errors raised by unbroken."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The path is not a committed checkpoint, or the requested step does not exist."""


class IncompleteCheckpointError(CheckpointError, KeyError):
    """Something the caller passed is missing from the checkpoint.

    A component, a model parameter, an optimizer state entry, or per-rank state (rng,
    dataloader) that cannot be mapped because the world size changed. Name the component
    in ``restore(reset={...})`` to start it fresh on purpose.
    """

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class CorruptCheckpointError(CheckpointError, OSError):
    """A checkpoint file is missing, truncated, fails its checksum, or is unsafe to read."""


class StateMismatchError(CheckpointError, ValueError):
    """The checkpoint does not fit the live objects, or verification after restore failed."""
