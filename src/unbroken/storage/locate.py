"""From a path or URL as a user gives it to the storage that serves it.

``s3://``, ``memory://`` and any other fsspec URL but ``file://`` name an object store
(fsspec, and s3fs for S3, are imported only then: ``import unbroken`` never needs them);
anything else is a local path.
"""

from __future__ import annotations

import os

from .interface import CheckpointDir, Location
from .local_files import LocalPath
from .local_medium import LocalMedium
from .run_folder import RunFolder
from .store_medium import StoreMedium
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


def pinned(root: str | os.PathLike | Location) -> str | Location:
    """``root`` made independent of the working directory, once: a local path (or
    ``file://`` URL) relative to it is joined to it now, *without* resolving symbolic
    links or ``..`` (``pathlib``'s ``absolute()``: the same folder the path names now,
    as if the absolute path had been given; a link in it is followed at each use, as
    for any absolute path). A store's URL, an absolute path or a ``Location`` is
    returned as it is (an absolute path as text)."""
    if isinstance(root, StorePath):
        return root
    if isinstance(root, LocalPath):
        return root if root.is_absolute() else LocalPath(root.absolute())
    text = os.fspath(root)
    if is_url(text):
        return text
    return str(LocalPath(text.removeprefix("file://")).absolute())


def checkpoint_dir(root: str | os.PathLike | Location) -> CheckpointDir:
    """The run folder ``root``: the one run-folder policy (``run_folder.RunFolder``) over a
    local disk, or over the object store its URL names.

    Raises:
        CheckpointError: ``root`` is a file (an object), not a folder; a URL whose store
            is not installed or that names a bucket without a folder.
    """
    if isinstance(root, StorePath):
        return RunFolder(StoreMedium(str(root)))
    text = os.fspath(root)
    return RunFolder(StoreMedium(text) if is_url(text) else LocalMedium(text))
