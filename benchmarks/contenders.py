"""Every way the benchmarks save a training state and restore it, behind one API.

A :class:`Contender` owns one folder and saves the live model and optimizer into a new
checkpoint there, timing itself (:class:`Timing`): ``blocked`` is the call the training
loop waits for; ``durable`` runs until the data is on disk (fsync'd by the contender or,
where ``fsyncs`` is False, plus an fsync pass of its files and folders that we add and
time apart); ``copied``, where a save copies behind the training loop, until that copy is
done. :func:`restore` reads a family's checkpoint into a model and an optimizer. Every
contender is device-aware: the state may live on CUDA (the device is synchronized after
a copy is awaited; torch-checkpointing stages into pinned memory there; ``torch.load``
maps onto the device). The floors, the state's raw bytes written and read with plain
file calls, are functions beside them.

- ours: ``unbroken.Checkpointer``, sync ``save()`` (verified), ``async_save=True`` and
  ``async_save="overlap"``; restored by ``restore()`` of a new Checkpointer.
- DCP: ``get_state_dict`` -> ``dcp.save(FileSystemWriter(thread_count=N))`` or
  ``dcp.async_save``; restored by ``get_state_dict`` templates -> ``dcp.load`` ->
  ``set_state_dict``.
- ``torch.save`` of ``{"model", "optimizer"}`` + fsync; ``torch.load`` +
  ``load_state_dict``.
- torch-checkpointing 0.1.1 (optional: the ``bench`` extra), driven as its docs say
  (``docs/troubleshooting.md`` of meta-pytorch/torch_checkpointing and ``staging.py``'s
  ``CheckpointStagerConfig``): ``CheckpointManager`` with ``AsyncCheckpointSaverConfig``
  whose stager pins memory and copies non-blocking only on CUDA; ``save(id, {"model":
  model.state_dict(), "optimizer": opt.state_dict()})`` returns the write future;
  ``load(id, into={"model": ..., "optimizer": None})`` then
  ``optimizer.load_state_dict``. Its local back-end opens files with ``O_DIRECT`` by
  default and never fsyncs; ``use_direct_io=False`` is its documented switch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import unbroken as ub
from common import synchronize

Optim = torch.optim.Optimizer
TC_MISSING = "not installed"

# The floors and the file helpers --------------------------------------------------------


def raw_bytes(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy."""
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


def fsync_path(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file under ``root`` (or ``root`` itself) and every folder: what a
    contender that does not fsync needs for its checkpoint to survive a power cut."""
    for d, _, names in os.walk(root):
        for name in names:
            fsync_path(os.path.join(d, name))
        fsync_path(d)
    if root.is_file():
        fsync_path(root)
    fsync_path(root.parent)


def clear(path: str | os.PathLike) -> None:
    """Remove a file or folder if present, and flush the removal to disk (untimed setup:
    a later timed write must not pay for this one's journal commit or discards)."""
    p = Path(path)
    if p.is_dir():
        shutil.rmtree(p)
    elif p.exists():
        p.unlink()
    os.sync()


def clear_steps(folder: str | os.PathLike) -> None:
    """Remove every step saved in ``folder`` (untimed setup, as :func:`clear`)."""
    for p in Path(folder).glob("step_*"):
        clear(p)


def write_raw(tensors: list[torch.Tensor], path: str | os.PathLike) -> None:
    """The write floor: the state's bytes, one file, plain writes + fsync."""
    with open(path, "wb") as f:
        for t in tensors:
            f.write(raw_bytes(t))
        f.flush()
        os.fsync(f.fileno())


def read_raw(targets: list[torch.Tensor], path: str | os.PathLike) -> None:
    """The read floor: the file :func:`write_raw` wrote, into existing tensors."""
    with open(path, "rb", buffering=0) as f:
        for t in targets:
            buf = raw_bytes(t)
            if f.readinto(buf) != len(buf):
                raise OSError(f"{path} is shorter than the state")


def read_raw_new(like: list[torch.Tensor], path: str | os.PathLike) -> list[torch.Tensor]:
    """Read it into newly allocated tensors (pays the first touch of every page)."""
    out = [torch.empty_like(t) for t in like]
    read_raw(out, path)
    return out


def read_files_new(files: list[str], piece: int = 16 << 20) -> list[torch.Tensor]:
    """Read whole files, one after another, into new tensors of ``piece`` bytes (the
    size of the benchmark's state tensors): the floor of a rank's cold restore."""
    out: list[torch.Tensor] = []
    for path in files:
        size = os.path.getsize(path)
        targets = [
            torch.empty(min(piece, size - at), dtype=torch.uint8) for at in range(0, size, piece)
        ]
        read_raw(targets, path)
        out += targets
    return out


def copy_into(targets: list[torch.Tensor], tensors: list[torch.Tensor], non_blocking=False) -> None:
    """One copy of the state into memory already allocated and touched."""
    for dst, src in zip(targets, tensors, strict=True):
        dst.copy_(src, non_blocking=non_blocking)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP without a process group says so on every call."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def tc_installed() -> bool:
    return importlib.util.find_spec("torch_checkpointing") is not None


def tc_version() -> str:
    try:
        return importlib.metadata.version("torch-checkpointing")
    except importlib.metadata.PackageNotFoundError:
        return f"{TC_MISSING} (PackageNotFoundError)"


def _tc_config(direct_io: bool, asynchronous: bool, cuda: bool):
    """torch-checkpointing's configuration for this host (see the module docstring)."""
    from torch_checkpointing import CheckpointManager, CheckpointStagerConfig
    from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    stager = CheckpointStagerConfig(use_pinned_memory=cuda, use_non_blocking_copy=cuda)
    save = (
        AsyncCheckpointSaverConfig(staging_config=stager)
        if asynchronous
        else SyncCheckpointSaverConfig()
    )
    storage = LocalFileSystemStorageConfig(use_direct_io=direct_io)
    return CheckpointManager.Config(save=save, storage_config=storage)


# The contenders -------------------------------------------------------------------------


@dataclasses.dataclass
class Timing:
    """Seconds of one save (see the module docstring); ``fsync`` is the pass we added
    (0 where the contender fsyncs), already counted in ``durable``."""

    blocked: float
    durable: float
    fsync: float = 0.0
    copied: float | None = None


class Contender:
    """One way to save. ``family`` names the restore that reads its checkpoints; ``kind``
    is ``sync`` or ``async``; ``fsyncs`` False: we add (and time) an fsync pass."""

    key = label = family = ""
    kind = "sync"
    fsyncs = True

    def __init__(self, root: Path, model: nn.Module, opt: Optim, device: torch.device) -> None:
        self.dir = root / self.key
        self.dir.mkdir(parents=True, exist_ok=True)
        self.model, self.opt, self.device = model, opt, device
        self.step = 0

    def latest(self) -> Path:
        """The checkpoint the last save wrote (what a restore reads)."""
        return self.dir / f"step_{self.step}"

    def clear(self) -> None:
        """Untimed, before each save: remove the previous checkpoint."""
        clear_steps(self.dir)

    def save(self) -> Timing:
        self.step += 1
        start = time.perf_counter()
        done = self._save(self.latest())
        blocked = time.perf_counter() - start
        copied = None
        if self._await_copy():
            synchronize(self.device)
            copied = time.perf_counter() - start
        if done is not None:
            done()
        durable = time.perf_counter() - start
        added = 0.0
        if not self.fsyncs:
            fsync_tree(self.latest())
            added = time.perf_counter() - start - durable
        return Timing(blocked, durable + added, added, copied)

    def _save(self, path: Path) -> Callable[[], object] | None:
        """Start the save into ``path``; return what waits for it (None: synchronous)."""
        raise NotImplementedError

    def _await_copy(self) -> bool:
        """Wait for a copy the save left running behind the caller; False: none."""
        return False

    def close(self) -> None:
        pass


def variant(cls: type[Contender], **attrs: object) -> type[Contender]:
    """``cls`` with other class attributes (a key, a label, ``fsyncs``...)."""
    return type(cls.__name__, (cls,), attrs)


class Ours(Contender):
    key, label, family = "ours", "ours: save (sync, verified)", "ours"
    mode: bool | str = False

    def __init__(self, root: Path, model: nn.Module, opt: Optim, device: torch.device) -> None:
        super().__init__(root, model, opt, device)
        self.ckpt = ub.Checkpointer(
            self.dir, model=model, optimizer=opt, keep_last=None, async_save=self.mode
        )

    def latest(self) -> Path:
        return self.dir  # restore() finds the one committed step in the folder

    def _save(self, path: Path) -> Callable[[], object] | None:
        self.ckpt.save(self.step)
        return self.ckpt.wait if self.mode else None

    def _await_copy(self) -> bool:
        if self.mode != "overlap":
            return False
        # The next optimizer step waits for the copy ("overlap"'s step pre-hook). No
        # parameter has a gradient here, so the step changes nothing.
        self.opt.step()
        return True

    def close(self) -> None:
        self.ckpt.close()


class OursOverlap(Ours):
    key, label, kind, mode = "ours_overlap", 'ours: async_save="overlap"', "async", "overlap"


class OursAsync(Ours):
    key, label, kind, mode = "ours_async", "ours: async_save=True", "async", True


def dcp_save(model: nn.Module, opt: Optim, path: str | os.PathLike, threads: int = 1) -> None:
    msd, osd = get_state_dict(model, opt)
    with _quiet():
        writer = dcp.FileSystemWriter(str(path), thread_count=threads)
        dcp.save({"model": msd, "optim": osd}, storage_writer=writer)


class DcpSave(Contender):
    key, label, family, threads = "dcp_1", "DCP save, thread_count=1", "dcp", 1

    def _save(self, path: Path) -> None:
        dcp_save(self.model, self.opt, path, self.threads)


DcpSave2 = variant(DcpSave, key="dcp_2", label="DCP save, thread_count=2", threads=2)


class DcpAsync(Contender):
    key, label, family, kind = "dcp_async", "DCP async_save (defaults)", "dcp", "async"

    def _save(self, path: Path) -> Callable[[], object]:
        msd, osd = get_state_dict(self.model, self.opt)
        with _quiet():
            writer = dcp.FileSystemWriter(str(path))
            return dcp.async_save({"model": msd, "optim": osd}, storage_writer=writer).result


class TorchSave(Contender):
    key, label, family = "torch_save", "torch.save + fsync", "torch"

    def latest(self) -> Path:
        return self.dir / f"step_{self.step}.pt"

    def _save(self, path: Path) -> None:
        torch.save({"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}, path)
        fsync_path(path)


class TcAsync(Contender):
    key, family, kind, fsyncs = "tc_async", "tc", "async", False
    label = "torch-checkpointing: async save, buffered I/O"
    direct_io, asynchronous = False, True

    def __init__(self, root: Path, model: nn.Module, opt: Optim, device: torch.device) -> None:
        super().__init__(root, model, opt, device)
        cuda = device.type == "cuda"
        self.manager = _tc_config(self.direct_io, self.asynchronous, cuda).build()

    def _save(self, path: Path) -> Callable[[], object] | None:
        payload = {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}
        fut = self.manager.save(str(path), payload)
        return fut.result if fut is not None else None

    def _await_copy(self) -> bool:
        # Its async save() returns while its staging copy runs; the state must not change
        # before that copy ends (its saver compares the state before and after staging).
        staging = getattr(self.manager, "_staging_future", None)
        if staging is None:
            return False
        staging.result()
        return True

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.manager.close()


TcSync = variant(
    TcAsync, key="tc_sync", kind="sync", asynchronous=False,
    label="torch-checkpointing: sync save, buffered I/O",
)  # fmt: skip
TcAsyncDirect = variant(
    TcAsync, key="tc_async_odirect", direct_io=True,
    label="torch-checkpointing: async save, default storage (O_DIRECT)",
)  # fmt: skip

# The restores ---------------------------------------------------------------------------


def import_library(family: str) -> None:
    """Import what :func:`restore` uses, so that a restore's time leaves out the one-time
    cost of importing its library (as a resumed job imports it at start-up)."""
    if family == "ours":
        ub.Checkpointer  # noqa: B018  (``import unbroken`` alone imports it lazily)
    elif family == "tc" and tc_installed():
        _tc_config(False, asynchronous=False, cuda=False)


def restore(
    family: str, path: str | os.PathLike, model: nn.Module, opt: Optim, device=None
) -> bool:
    """Read the checkpoint at ``path`` into ``model`` and ``opt`` (existing or fresh
    objects); True where the library verified what it restored (ours, or it raises)."""
    if family == "ours":
        with ub.Checkpointer(path, model=model, optimizer=opt) as ckpt:
            report = ckpt.restore()
        if not (report.restored and report.verified):
            raise RuntimeError(f"restore did not restore and verify: {report}")
        return True
    if family == "dcp":  # templates from get_state_dict (for an optimizer without state,
        msd, osd = get_state_dict(model, opt)  # it first runs a zero-gradient step)
        state = {"model": msd, "optim": osd}
        with _quiet():
            dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    elif family == "torch":
        state = torch.load(path, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    elif family == "tc":
        manager = _tc_config(False, asynchronous=False, cuda=False).build()  # no writer
        try:
            got = manager.load(str(path), into={"model": model.state_dict(), "optimizer": None})
            opt.load_state_dict(got["optimizer"])
        finally:
            manager.close()
    else:
        raise ValueError(f"unknown restore family {family!r}")
    return False
