"""The writing half of ``shards.py``: this rank's tensors to its shard file(s)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..env import env_number
from ..storage.interface import FileSink, Location
from ..storage.locate import location
from . import host_ring
from .schema import MAX_FILES_PER_RANK
from .shards import ChunkLocation, checksum, shard_file_name, tensor_bytes

FILES_ENV = "UNBROKEN_WRITE_FILES"


def write_files() -> int:
    """Files a large local shard is split into, written side by side (default 2, at
    most ``MAX_FILES_PER_RANK``)."""
    return min(int(env_number(FILES_ENV, 2, 1)), MAX_FILES_PER_RANK)


SPLIT_MIN_BYTES = 64 << 20  # each file of a split shard holds at least this much


def _write_pieces(out: FileSink, pieces: Iterator[memoryview]) -> tuple[int, str]:
    """Write consecutive pieces of one chunk; its length and xxh3-128 checksum."""
    hasher = xxhash.xxh3_128()
    size = 0
    for piece in pieces:
        out.write(piece)
        hasher.update(piece)
        size += piece.nbytes
    return size, hasher.hexdigest()


def _split(items: list[Any], files: int) -> list[list[Any]]:
    """``items`` in up to ``files`` runs (plan order kept) of about equal bytes."""
    sizes = [item.tensor_storage_size() or 0 for item in items]
    total = sum(sizes)
    count = min(files, len(items), max(1, total // SPLIT_MIN_BYTES))
    if count <= 1:
        return [list(items)]
    groups: list[list[Any]] = [[]]
    done = 0
    for item, size in zip(items, sizes, strict=True):
        # A new run starts where this item's middle lies past the current run's share.
        if groups[-1] and len(groups) < count and done + size / 2 > total * len(groups) / count:
            groups.append([])
        groups[-1].append(item)
        done += size
    return groups


class ShardWriter(StorageWriter):
    """Writes this rank's tensors to ``name`` (``rank_NNNNN.bin``) in ``directory``; fsyncs
    it. Locally a large shard is split into up to ``files`` files written in parallel
    (``rank_NNNNN.bin``, ``rank_NNNNN.1.bin``, ...): on the disks measured, two files
    written side by side finish sooner than one (docs/benchmarks.md). On an object store
    (``directory.files_per_shard`` is 1) the one object is uploaded in parallel parts
    straight from the tensors' memory.

    After ``dcp.save`` returns, the coordinator's ``metadata`` holds every chunk's
    location across ranks and ``file_records`` (on each rank) this rank's files.
    """

    def __init__(
        self,
        directory: Location | str | os.PathLike,
        *,
        rank: int,
        name: str | None = None,
        files: int = 1,
    ) -> None:
        super().__init__()
        self.directory = location(directory)
        self.rank = rank
        self.name = name or shard_file_name(rank)
        self.files = max(1, files)
        self.metadata: Metadata | None = None
        self.file_records: list[tuple[str, dict[str, object]]] = []
        # Told, before the writes start, the whole (not sharded) tensors this rank writes.
        self.on_plan: Callable[[list[str]], None] | None = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        pass  # the folder is fixed at construction (saves never pass a checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                raise TypeError(
                    f"{item.index.fqn}: only tensors go to shard files (a bug in unbroken)"
                )
        if self.on_plan is not None:
            self.on_plan([i.index.fqn for i in plan.items if i.type == WriteItemType.TENSOR])
        groups = _split(plan.items, self.directory.files_per_shard(self.files))
        if len(groups) == 1:
            results = self._write_file(self.name, groups[0], planner)
        else:
            names = [self.name] + [
                f"{self.name.removesuffix('.bin')}.{i}.bin" for i in range(1, len(groups))
            ]
            with ThreadPoolExecutor(len(groups), thread_name_prefix="unbroken-write") as pool:
                done = list(pool.map(self._write_file, names, groups, [planner] * len(groups)))
            results = [r for rs in done for r in rs]
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _write_file(self, name: str, items: list[Any], planner: SavePlanner) -> list[WriteResult]:
        """Write ``items`` to one file, checksumming each chunk; durable on return (a
        local file fsynced, an object uploaded whole)."""
        results: list[WriteResult] = []
        offset = 0
        with contextlib.ExitStack() as stack:
            out = stack.enter_context((self.directory / name).create())
            rings: dict[torch.device, host_ring.HostRing] = {}  # one per device, this file's
            for item in items:
                t = planner.resolve_data(item)
                if not self.directory.keeps_written_buffers and host_ring.through_ring(t):
                    # An object store keeps the bytes it is given until the upload ends:
                    # only a sink that copies them at once takes pieces of a reused buffer.
                    if t.device not in rings:
                        rings[t.device] = stack.enter_context(host_ring.borrow(t.device))
                    size, digest = _write_pieces(out, rings[t.device].download(t))
                else:
                    data = tensor_bytes(t)
                    out.write(data)
                    size, digest = len(data), checksum(data)
                results.append(
                    WriteResult(item.index, size, ChunkLocation(name, offset, size, digest))
                )
                offset += size
        self._record(name, offset, results)
        return results

    def _record(self, name: str, size: int, results: list[WriteResult]) -> None:
        chunk_sums = "".join(r.storage_data.checksum for r in results)
        self.file_records.append((name, {"size": size, "checksum": checksum(chunk_sums.encode())}))

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {r.index: r.storage_data for rs in results for r in rs}
        self.metadata = metadata

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True
