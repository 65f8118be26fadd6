"""Tensor bytes on disk: where a chunk lives, its checksum, the shard files' names.

Saves and restores go through ``torch.distributed.checkpoint`` (DCP): DCP plans who
writes which shard and who reads which byte range when the world size changes; our
storage classes decide how bytes are laid out. Each rank writes one file (two side by
side for a large shard on a local disk) of raw little-endian tensor bytes (no pickle, no
zip), hashing every chunk with xxh3-128 as it goes. The reader gets its metadata from our
JSON manifest instead of DCP's pickled ``.metadata`` file, and checks each chunk's
checksum before any byte is used. The writer is in ``shard_writer.py``, the reader in
``shard_reader.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)


@dataclasses.dataclass(frozen=True)
class ChunkLocation:
    """Where one saved chunk lives: file name, byte offset and length, xxh3-128 hex."""

    file: str
    offset: int
    length: int
    checksum: str


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """Silence DCP's warning that a process without a process group saves alone."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def shard_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.bin"


def row_major(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements in row-major order as a 1-D tensor of stride 1, on its device: a
    view where ``t`` is laid out so, else a copy. (One element seen through a stride,
    ``x[::2]`` of two, counts as contiguous for torch yet cannot be viewed as bytes.)"""
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() and flat.stride(0) != 1:
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A tensor's bytes (CPU, contiguous) as a memoryview, without a copy when possible."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(row_major(t).view(torch.uint8).numpy())


def checksum(data: memoryview | bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def metadata_from_entries(entries: dict[str, dict]) -> Metadata:
    """Build DCP metadata from the manifest's tensor entries (no unpickling)."""
    state: dict[str, Any] = {}
    storage: dict[MetadataIndex, ChunkLocation] = {}
    for key, entry in entries.items():
        dtype = getattr(torch, entry["dtype"])
        chunks = []
        for c in entry["chunks"]:
            offsets = torch.Size(c["offsets"])
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(c["sizes"])))
            storage[MetadataIndex(key, offsets)] = ChunkLocation(
                c["file"], c["offset"], c["length"], c["checksum"]
            )
        state[key] = TensorStorageMetadata(
            TensorProperties(dtype=dtype), torch.Size(entry["shape"]), chunks
        )
    return Metadata(state_dict_metadata=state, storage_data=storage)
