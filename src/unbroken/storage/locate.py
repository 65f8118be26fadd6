"""From a path or URL as a user gives it to the storage that serves it.

``s3://``, ``memory://`` and any other fsspec URL but ``file://`` name an object store
(fsspec, and s3fs for S3, are imported only then: ``import unbroken`` never needs them);
anything else is a local path.
"""

from __future__ import annotations

import os

from .interface import CheckpointDir, Location
from .local_dir import LocalCheckpointDir
from .local_files import LocalPath
from .store_dir import StoreCheckpointDir
from .store_path import StorePath


def is_url(text: str) -> bool:
    """Whether ``text`` names an object store (``s3://``, ``memory://``, ...), not a
    local path (plain, or ``file://``)."""
    return "://" in text and not text.startswith("file://")


def location(path: str | os.PathLike | Location) -> Location:
    """A checkpoint's folder or file as given by a user: a ``StorePath`` for a store's
    URL, else a ``LocalPath`` (``file://`` URLs too). A ``Location`` passes through."""
    if isinstance(path, StorePath | LocalPath):
        return path
    text = os.fspath(path)
    return StorePath.parse(text) if is_url(text) else LocalPath(text.removeprefix("file://"))


def checkpoint_dir(root: str | os.PathLike | Location) -> CheckpointDir:
    """The run folder ``root``: on a local disk, or on the object store its URL names.

    Raises:
        CheckpointError: ``root`` is a file (an object), not a folder; a URL whose store
            is not installed or that names a bucket without a folder.
    """
    if isinstance(root, StorePath):
        return StoreCheckpointDir(str(root))
    text = os.fspath(root)
    return StoreCheckpointDir(text) if is_url(text) else LocalCheckpointDir(text)
