"""The reading half of ``shards.py``: a checkpoint's chunks into this rank's load
targets, every chunk checked against its checksum before any byte is used."""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future as ReadFuture
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..env import env_number
from ..errors import CorruptCheckpointError
from ..storage.interface import Location
from ..storage.locate import location
from . import host_ring
from .shards import ChunkLocation, checksum, metadata_from_entries
from .tensor_reader import REREADS, reread

READ_THREADS_ENV = "UNBROKEN_READ_THREADS"
MAX_READERS = 8  # reads in flight per process on a local disk
READ_RUN_MIN_BYTES = 32 << 20  # a reader thread reads at least this much in a row


def read_threads() -> int:
    """Threads that may read a local shard's files at once: ``MAX_READERS`` where this
    process has two CPUs or more to itself (:func:`cpu_share`), else 1 (its files are
    read one after another). ``UNBROKEN_READ_THREADS`` overrides. Measured on two cores:
    two ranks restore sooner reading their files one after another than with a thread
    per file each, one process sooner with several reads in flight (:func:`_runs`)."""
    if os.environ.get(READ_THREADS_ENV, "").strip():
        return int(env_number(READ_THREADS_ENV, 1, 1))
    return MAX_READERS if cpu_share() >= 2 else 1


def cpu_share() -> int:
    """The CPUs this process may count as its own: those it may run on, divided among the
    ranks torchrun started on this machine (``LOCAL_WORLD_SIZE``) unless it is pinned to
    its own."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpus = cpus or 1
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    if cpus < (os.cpu_count() or cpus):  # pinned: these CPUs are this process's share
        local = 1
    return cpus // local


def _runs(files: list[list[tuple[int, int]]], limit: int) -> list[list[int]]:
    """Cut each file's chunks ((index, bytes) in file order) into runs of consecutive
    chunks of at least ``READ_RUN_MIN_BYTES``, about ``limit`` runs in all (at least one
    per file), shared among the files by their size: several reads in flight keep a cold
    disk busy. Measured (fresh processes, paired runs, two files per shard): at 0.30 GB,
    cold, four runs per file restored 6-45% sooner than one; at 1.21 GB 1.23-1.26 s
    against 1.44-2.17 s cold, 0.80-0.85 s against 0.87-0.94 s warm."""
    sizes = [sum(n for _, n in chunks) for chunks in files]
    total = sum(sizes) or 1
    out: list[list[int]] = []
    for chunks, size in zip(files, sizes, strict=True):
        count = max(1, min(size // READ_RUN_MIN_BYTES, limit * size // total))
        runs: list[list[int]] = [[]]
        done = 0
        for i, n in chunks:
            # A new run starts where this chunk's middle lies past the current run's share.
            if runs[-1] and len(runs) < count and done + n / 2 > size * len(runs) / count:
                runs.append([])
            runs[-1].append(i)
            done += n
        out += runs
    return out


class ShardReader(StorageReader):
    """Reads chunks written by :class:`ShardWriter`, verifying each chunk's checksum.

    ``entries`` are the manifest's tensor entries; ``directory`` the checkpoint folder.
    A chunk that fails its checksum is read again (``REREADS`` times) into the same memory
    before it counts as damage: bytes a store or disk answered wrong once are not a
    damaged checkpoint. Each chunk that needed it is logged and noted in ``warnings``.
    """

    def __init__(
        self,
        directory: Location | str | os.PathLike,
        entries: dict[str, dict],
        *,
        on_loaded: Callable[[str], None] | None = None,
        warnings: list[str] | None = None,
    ) -> None:
        super().__init__()
        self.warnings = [] if warnings is None else warnings  # chunks read right only again
        self.directory = location(directory)
        self.metadata = metadata_from_entries(entries)
        self.entries = entries
        self.on_loaded = on_loaded
        # Target (FQN) -> the one chunk read straight into it, whose checksum is therefore
        # the xxh3-128 of the target's bytes (set by read_data).
        self.read_whole: dict[str, ChunkLocation] = {}
        # Whether some tensor is cut here otherwise than at save (assembled from parts of
        # saved chunks): the layout changed, whatever the world size.
        self.recut = False

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        cache: dict[MetadataIndex, torch.Tensor] = {}
        remaining = Counter(req.dest_index.fqn for req in plan.items)
        single = {fqn for fqn, n in remaining.items() if n == 1}
        uses = Counter(req.storage_index for req in plan.items)
        items = sorted(plan.items, key=lambda r: self._location(r.storage_index).offset)
        with contextlib.ExitStack() as files:
            opened: dict[str, Any] = {}
            ahead = self._read_ahead(items, planner, uses, files)
            if not ahead:  # one reader: each file start to end, as it was written
                items.sort(key=lambda r: self._location(r.storage_index).file)
            # What this loop reads itself first (alongside the readers), then the chunks
            # read ahead as they arrive, so each is fingerprinted as soon as it is in.
            ahead_index = {future: i for i, (_, future) in ahead.items()}
            own = (i for i in range(len(items)) if i not in ahead)
            arrived = (ahead_index[f] for f in as_completed(ahead_index))
            for i in itertools.chain(own, arrived):
                req = items[i]
                if req.type != LoadItemType.TENSOR:
                    raise CorruptCheckpointError(
                        f"{req.storage_index.fqn}: the checkpoint asks for a non-tensor read"
                    )
                whole = i in ahead
                if whole:  # read (and checked) already, in parallel
                    target = ahead[i][0]
                    ahead[i][1].result()
                else:
                    target = planner.resolve_tensor(req).detach()
                    # The common case (same world size): bytes go straight into the
                    # target, no staging buffer, no second copy.
                    whole = uses[req.storage_index] == 1 and self._fits_whole(req, target)
                    if whole:
                        self._read_chunk(req.storage_index, files, opened, into=target)
                if whole:
                    if req.dest_index.fqn in single:
                        self.read_whole[req.dest_index.fqn] = self._location(req.storage_index)
                else:
                    chunk = cache.get(req.storage_index)
                    if chunk is None:
                        # A device target's chunk is read onto its device (through the
                        # ring) and cut there: no pageable copy, no blocking transfer.
                        on = target.device if host_ring.through_ring(target) else None
                        chunk = self._read_chunk(req.storage_index, files, opened, device=on)
                        cache[req.storage_index] = chunk
                    piece = chunk
                    for dim, (start, length) in enumerate(
                        zip(req.storage_offsets, req.lengths, strict=True)
                    ):
                        piece = piece.narrow(dim, start, length)
                    if target.shape != piece.shape:
                        raise CorruptCheckpointError(
                            f"{req.storage_index.fqn}: chunk shape {tuple(piece.shape)} does "
                            f"not fit the read target {tuple(target.shape)}"
                        )
                    target.copy_(piece)
                    uses[req.storage_index] -= 1
                    if uses[req.storage_index] == 0:
                        cache.pop(req.storage_index, None)
                self.recut = self.recut or not self._same_cut(req, planner)
                planner.commit_tensor(req, target)
                remaining[req.dest_index.fqn] -= 1
                if remaining[req.dest_index.fqn] == 0 and self.on_loaded is not None:
                    self.on_loaded(req.dest_index.fqn)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_ahead(
        self, items: list, planner: LoadPlanner, uses: Counter, stack: contextlib.ExitStack
    ) -> dict[int, tuple[torch.Tensor, Any]]:
        """Chunks that go straight into their targets, fetched (and checked) in parallel
        ahead of the loop that commits them: position in ``items`` -> (target, future).
        On an object store every such chunk is its own request (a request has a latency
        that a local read does not; ranges of one large chunk are already fetched in
        parallel by ``Store.read_into``). On a local disk each file is cut into runs of
        consecutive chunks (:func:`_runs`), each read start to end by a thread, so that
        several reads are in flight on a cold disk; where this process has less than two
        CPUs to itself (:func:`read_threads`), the caller's loop reads file after file."""
        whole: dict[int, torch.Tensor] = {}
        for i, req in enumerate(items):
            if req.type != LoadItemType.TENSOR:
                continue
            target = planner.resolve_tensor(req).detach()
            if uses[req.storage_index] == 1 and self._fits_whole(req, target):
                whole[i] = target
        requests = self.directory.chunk_requests
        if requests is not None:  # every read a request with a latency: one per chunk
            workers = requests
            groups = [[i] for i in whole]
        else:
            by_file: dict[str, list[int]] = {}
            for i in whole:
                by_file.setdefault(self._location(items[i].storage_index).file, []).append(i)
            limit = read_threads()
            if limit < 2:
                return {}
            groups = _runs(
                [
                    [(i, self._location(items[i].storage_index).length) for i in run]
                    for run in by_file.values()
                ],
                limit,
            )
            if len(groups) < 2:
                return {}
            workers = len(groups)
        futures: dict[int, ReadFuture[None]] = {i: ReadFuture() for i in whole}
        pool = stack.enter_context(ThreadPoolExecutor(workers, thread_name_prefix="unbroken-read"))
        # Every reader waits until all are started: a thread started while others read
        # into new memory took 5-40 ms to start (measured), holding up the caller's loop.
        go = threading.Event()
        stack.callback(lambda: [f.cancel() for f in futures.values()])
        stack.callback(go.set)  # before the pool's shutdown waits for its threads

        def read(indices: list[int]) -> None:
            go.wait()
            with contextlib.ExitStack() as own:
                opened: dict[str, Any] = {}
                for i in indices:
                    if not futures[i].set_running_or_notify_cancel():
                        return  # cancelled: the caller gave up
                    try:
                        self._read_chunk(items[i].storage_index, own, opened, into=whole[i])
                    except BaseException as exc:
                        futures[i].set_exception(exc)
                        return  # the caller raises it; the rest of this file is not read
                    futures[i].set_result(None)

        for group in groups:
            pool.submit(read, group)
        go.set()
        return {i: (whole[i], futures[i]) for i in whole}

    def _location(self, index: MetadataIndex) -> ChunkLocation:
        return self.metadata.storage_data[index]

    def _chunk_sizes(self, index: MetadataIndex) -> torch.Size:
        meta = self.metadata.state_dict_metadata[index.fqn]
        return next(c.sizes for c in meta.chunks if c.offsets == index.offset)

    def _same_cut(self, req: Any, planner: LoadPlanner) -> bool:
        """Whether ``req`` reads one whole saved chunk into a whole load target of its
        shape (the tensor is cut here as it was at save)."""
        sizes = tuple(self._chunk_sizes(req.storage_index))
        whole_target = planner.lookup_tensor(req.dest_index)  # not narrowed to the read
        return (
            all(o == 0 for o in req.storage_offsets)
            and tuple(req.lengths) == sizes
            and tuple(whole_target.shape) == sizes
        )

    def _fits_whole(self, req: Any, target: torch.Tensor) -> bool:
        sizes = self._chunk_sizes(req.storage_index)
        meta = self.metadata.state_dict_metadata[req.storage_index.fqn]
        return (
            all(o == 0 for o in req.storage_offsets)
            and tuple(req.lengths) == tuple(sizes)
            and tuple(target.shape) == tuple(sizes)
            and target.dtype == meta.properties.dtype
            and (target.device.type == "cpu" or host_ring.through_ring(target))
            and target.is_contiguous()
        )

    def _read_chunk(
        self,
        index: MetadataIndex,
        files: contextlib.ExitStack,
        opened: dict[str, Any],
        into: torch.Tensor | None = None,
        device: torch.device | None = None,
    ) -> torch.Tensor:
        """Read one chunk (into ``into`` if given, else into new memory on ``device``,
        the host by default) and verify its checksum."""
        loc = self._location(index)
        sizes = self._chunk_sizes(index)
        dtype = self.metadata.state_dict_metadata[index.fqn].properties.dtype
        out = into if into is not None else torch.empty(sizes, dtype=dtype, device=device)
        expected = out.numel() * out.element_size()
        path = self.directory / loc.file
        if loc.length != expected:
            raise CorruptCheckpointError(
                f"{path}: chunk of {index.fqn!r} is recorded as {loc.length} bytes but its "
                f"shape {tuple(sizes)} and dtype {dtype} need {expected}; the manifest is damaged"
            )
        if expected and host_ring.through_ring(out):
            return self._read_to_device(index, loc, files, opened, out)
        data = memoryview(out.reshape(-1).view(torch.uint8).numpy() if expected else b"")
        for attempt in range(1 + REREADS):  # read again where the bytes came in wrong
            if expected:
                self._read_piece(index, loc.offset, data, files, opened)
            if checksum(data) == loc.checksum:
                return self._sound(index, attempt, out)
        raise _failed_checksum(path, index, loc)

    def _read_piece(self, index: MetadataIndex, at: int, buf: memoryview, *files: Any) -> None:
        """``buf``'s bytes from ``at`` in the file of ``index``'s chunk, every one of them
        (``files``: the open files and where they are kept, as :meth:`_reader` takes)."""
        loc = self._location(index)
        path = self.directory / loc.file
        try:
            got = self._reader(loc, *files).read_into(at, buf)
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"{path} is missing; this checkpoint cannot be restored, use an older step"
            ) from None
        except OSError as exc:  # no permission, an I/O error: as unusable as missing
            raise CorruptCheckpointError(
                f"{path} cannot be read ({exc.strerror or exc}); this checkpoint cannot be "
                "restored: fix the file's permissions, or use an older step"
            ) from None
        if got != buf.nbytes:
            raise CorruptCheckpointError(
                f"{path} is truncated: {index.fqn!r} needs bytes {loc.offset}.."
                f"{loc.offset + loc.length}, the file ends before; use an older step"
            )

    def _sound(self, index: MetadataIndex, rereads: int, out: torch.Tensor) -> torch.Tensor:
        """``out``, its chunk sound; a chunk sound only when read again is noted."""
        if rereads:  # list.append: safe from the reader threads
            loc = self._location(index)
            self.warnings.append(reread(index.fqn, rereads, self.directory / loc.file, loc.offset))
        return out

    def _reader(self, loc: ChunkLocation, files: contextlib.ExitStack, opened: dict) -> Any:
        if loc.file not in opened:
            path = self.directory / loc.file
            opened[loc.file] = files.enter_context(contextlib.closing(path.open_chunks()))
        return opened[loc.file]

    def _read_to_device(
        self,
        index: MetadataIndex,
        loc: ChunkLocation,
        files: contextlib.ExitStack,
        opened: dict[str, Any],
        out: torch.Tensor,
    ) -> torch.Tensor:
        """Read one chunk into a device tensor through a ring of pinned buffers: each
        piece is read and checksummed on the host while the one before is copied to the
        device. ``out`` is a new load target: bytes that fail the checksum reach nothing
        live, and the chunk is read again (``REREADS`` times) into it."""
        path = self.directory / loc.file
        hasher, done = xxhash.xxh3_128(), 0

        def fill(piece: memoryview) -> None:
            nonlocal done
            self._read_piece(index, loc.offset + done, piece, files, opened)
            hasher.update(piece)
            done += piece.nbytes

        for attempt in range(1 + REREADS):
            with host_ring.borrow(out.device) as ring:
                ring.upload(out, fill)
            if hasher.hexdigest() == loc.checksum:
                return self._sound(index, attempt, out)
            hasher, done = xxhash.xxh3_128(), 0
        raise _failed_checksum(path, index, loc)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True


def _failed_checksum(path: Location, index: MetadataIndex, loc: ChunkLocation) -> Exception:
    return CorruptCheckpointError(
        f"{path}: bytes of {index.fqn!r} at offset {loc.offset} fail their checksum, "
        f"read {1 + REREADS} times (the file was altered or damaged); use an older step"
    )
