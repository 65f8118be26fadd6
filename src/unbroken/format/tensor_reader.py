"""Whole logical tensors of a committed checkpoint, read from its chunk list alone.

Restores go through DCP and need live objects; the command-line tools do not have any.
:class:`TensorReader` reads one tensor at a time straight from the manifest's chunk list
(file, byte offset, length, xxh3-128 checksum, offsets within the global shape), so
memory stays bounded by the largest tensor, and nothing is ever unpickled. Every chunk's
checksum is checked before its bytes are used; a chunk that fails it is read again
(``REREADS`` times, as a restore does) before it counts as damage.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import xxhash

from ..errors import CheckpointError, CorruptCheckpointError
from ..storage.interface import ChunkReader, Location
from ..storage.locate import location
from .manifest import DTYPES, REREADS, require_native_byteorder

logger = logging.getLogger(__name__)


class TensorReader:
    """Reads whole tensors of one committed checkpoint, verifying every chunk.

    Keeps the shard files open until :meth:`close` (or the end of a ``with`` block).
    Not thread-safe: one reader per thread.

    Args:
        folder: the checkpoint's step folder.
        doc: its manifest, as returned by ``unbroken.format.manifest.read(folder)``.
        on_bytes: called with the byte count of each chunk read (for progress bars).

    Attributes:
        warnings: a note for each chunk that failed its checksum but was sound when read
            again (bytes a disk or store answered wrong once, not damage).

    Example::

        doc = manifest.read(folder)
        with TensorReader(folder, doc) as reader:
            weight = reader.read("model/fc.weight")
    """

    def __init__(
        self,
        folder: Location | str | os.PathLike,
        doc: dict[str, Any],
        *,
        on_bytes: Callable[[int], None] | None = None,
    ) -> None:
        self.folder = location(folder)
        self.doc = doc
        self.on_bytes = on_bytes
        self._files: dict[str, ChunkReader] = {}
        self.warnings: list[str] = []
        require_native_byteorder(self.folder, doc)

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def read(self, key: str) -> torch.Tensor:
        """The whole logical tensor ``key`` (CPU, saved dtype and shape).

        Raises:
            CorruptCheckpointError: a file is missing or truncated, or a chunk fails its
                checksum; the message names the file.
            CheckpointError: the manifest lists no tensor ``key``.
        """
        entry = self.doc["tensors"].get(key)
        if entry is None:
            raise CheckpointError(f"{self.folder}: the manifest lists no tensor {key!r}")
        dtype = DTYPES[entry["dtype"]]
        out = torch.empty(entry["shape"], dtype=dtype)
        for chunk in entry["chunks"]:
            region = out
            for dim, (start, size) in enumerate(zip(chunk["offsets"], chunk["sizes"], strict=True)):
                region = region.narrow(dim, start, size)
            if region.is_contiguous():  # e.g. a dim-0 shard: read straight into place
                self._fill(region, chunk, key)
            else:
                staging = torch.empty(chunk["sizes"], dtype=dtype)
                self._fill(staging, chunk, key)
                region.copy_(staging)
        return out

    def _fill(self, target: torch.Tensor, chunk: dict[str, Any], key: str) -> None:
        path = self.folder / chunk["file"]
        length = chunk["length"]
        if target.numel() * target.element_size() != length:
            raise CorruptCheckpointError(
                f"{path}: chunk of {key!r} is recorded as {length} bytes, which does not "
                f"fit its shape {chunk['sizes']} and dtype; the manifest is damaged"
            )
        data = memoryview(target.reshape(-1).view(torch.uint8).numpy() if length else b"")
        for attempt in range(1 + REREADS):  # read again where the bytes came in wrong
            if length:
                self._read_whole(path, chunk, key, data)
            if xxhash.xxh3_128_hexdigest(data) == chunk["checksum"]:
                if attempt:
                    self.warnings.append(reread(key, attempt, path, chunk["offset"]))
                break
        else:
            raise CorruptCheckpointError(
                f"{path}: bytes of {key!r} at offset {chunk['offset']} fail their checksum, "
                f"read {1 + REREADS} times (the file was altered or damaged)"
            )
        if self.on_bytes is not None:
            self.on_bytes(length)

    def _read_whole(self, path: Location, chunk: dict[str, Any], key: str, buf: memoryview) -> None:
        f = self._open(path, chunk["file"])
        got = 0
        while got < buf.nbytes:
            n = _read_into(f, chunk["offset"] + got, buf[got:], path)
            if not n:
                raise CorruptCheckpointError(
                    f"{path} is truncated: {key!r} needs bytes {chunk['offset']}.."
                    f"{chunk['offset'] + buf.nbytes}, the file ends at {chunk['offset'] + got}"
                )
            got += n

    def _open(self, path: Location, name: str) -> ChunkReader:
        f = self._files.get(name)
        if f is None:
            # The rules of restore (storage: a plain file, never a link, of its recorded
            # size, not sparse), checked before any memory is spent on its bytes.
            record = self.doc["files"].get(name)
            why = path.file_problem(record["size"]) if record else f"{path} is unlisted"
            if why is not None:
                raise CorruptCheckpointError(why)
            try:
                f = path.open_chunks()
            except FileNotFoundError:
                raise CorruptCheckpointError(f"{path} is missing") from None
            except OSError as exc:  # no permission, a link: as unusable as missing
                raise CorruptCheckpointError(
                    f"{path} cannot be read ({exc.strerror or exc})"
                ) from None
            self._files[name] = f
        return f


def reread(key: str, rereads: int, path: Location, offset: int) -> str:
    """The note (also logged) for a chunk that failed its checksum and was sound when read
    again: the bytes came in wrong, the file is sound."""
    times = "once" if rereads == 1 else f"{rereads} times"
    note = (
        f"a chunk of {key!r} read wrong {times} from {path} (offset {offset}), read again and sound"
    )
    logger.warning("%s", note)
    return note


def _read_into(f: ChunkReader, offset: int, buf: memoryview, path: Location) -> int:
    try:
        return f.read_into(offset, buf)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path} is missing") from None
    except OSError as exc:  # an I/O error: the file is as unusable as a missing one
        raise CorruptCheckpointError(f"{path} cannot be read ({exc.strerror or exc})") from None
