"""A committed checkpoint's folder, checked before a byte of its tensors is read.

The manifest (size, JSON, checksum, schema), the files it lists (storage's rules: each
present, of its size, a plain file, not sparse; nothing unlisted beside them), every listed
tensor referenced by a component, and whether this machine can read the bytes (byte order)
and recompute the fingerprints. ``restore()`` and retention apply it; ``unbroken verify``
applies the same rules and goes on to read every byte.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from ..errors import CorruptCheckpointError
from ..storage.interface import Location
from . import manifest, schema


def check_folder(
    folder: Location, notes: list[str] | None = None, held: Collection[str] | None = None
) -> dict[str, Any]:
    """The manifest of the committed checkpoint in ``folder``, once the folder is sound.
    A manifest read wrong and then sound adds its note to ``notes``. ``held``: the files
    that must be there (a node's copy of a local step holds only those it reads); default
    every file the manifest lists.

    Raises:
        CorruptCheckpointError: naming the file that is missing, resized, sparse, a link,
            not listed in the manifest, or unreadable (permissions).
        CheckpointError: its tensor bytes are in another byte order than this machine's,
            or its fingerprints use an algorithm this version does not know.
    """
    try:
        return _check(folder, notes, held)
    except CorruptCheckpointError:
        raise
    except OSError as exc:  # no permission, gone meanwhile: the checkpoint is unusable
        raise CorruptCheckpointError(
            f"{exc.filename or folder} cannot be read ({exc.strerror or exc}); fix its "
            "permissions, or use an older step"
        ) from None


def _check(
    folder: Location, notes: list[str] | None, held: Collection[str] | None
) -> dict[str, Any]:
    doc = manifest.read(folder, notes)  # refuses a linked folder or manifest
    files = doc["files"]
    problems = folder.problems(files if held is None else {n: files[n] for n in held})
    if problems:
        raise CorruptCheckpointError(f"{problems[0][1]}; use an older step")
    unreferenced = schema.unreferenced(doc)
    if unreferenced:
        raise CorruptCheckpointError(
            f"{folder}: the manifest lists tensor(s) no component references "
            f"({', '.join(unreferenced[:5])}): it was altered; use an older step"
        )
    manifest.require_native_byteorder(folder, doc)
    manifest.require_known_fingerprints(folder, doc)
    return doc
