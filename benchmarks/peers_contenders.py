"""The contenders of ``peers.py``: each way to save a training state, and to restore it.

A save contender owns one folder and saves the live model and optimizer into a new
checkpoint there, timing itself: ``blocked`` (the call the training loop waits for),
``durable`` (until the data is on disk: fsync'd, or, for a peer that never fsyncs, until
its own future resolves plus an fsync pass we add and time apart). A restore family reads
one of those checkpoints into fresh objects (``restore``, run in a fresh process).

torch-checkpointing 0.1.1 is driven as its docs say for a CPU-only host
(``docs/troubleshooting.md`` of meta-pytorch/torch_checkpointing, and ``staging.py``'s
``CheckpointStagerConfig``): ``CheckpointManager`` with ``AsyncCheckpointSaverConfig``
whose stager has ``use_pinned_memory=False, use_non_blocking_copy=False`` (the defaults
on a host without CUDA); ``save(id, {"model": model.state_dict(), "optimizer":
opt.state_dict()})`` returns the write future; ``load(id, into={"model":
model.state_dict(), "optimizer": None})`` then ``optimizer.load_state_dict`` (its
tutorial). Its local file system back-end opens files with ``O_DIRECT`` by default and
never fsyncs (``storage/filesystem.py``); ``use_direct_io=False`` is its documented
switch for file systems without direct I/O.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

import paths
import unbroken as ub

Optim = torch.optim.Optimizer


def fsync_tree(root: Path) -> None:
    """fsync every file under ``root`` and every folder (what a peer that does not fsync
    would need for its checkpoint to survive a power cut)."""
    for d, _, names in os.walk(root):
        for name in names:
            paths.fsync_path(os.path.join(d, name))
        paths.fsync_path(d)
    paths.fsync_path(root.parent)


@contextlib.contextmanager
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class Timing:
    """Seconds of one save: ``blocked`` in the call, ``durable`` until on disk (including
    ``fsync``, the pass we add for a peer that does not fsync; 0 where it does)."""

    def __init__(self, blocked: float, durable: float, fsync: float = 0.0) -> None:
        self.blocked, self.durable, self.fsync = blocked, durable, fsync


class Contender:
    """One save path. ``family`` names the restore that reads its checkpoints; ``kind``
    is ``sync`` or ``async`` (ratios compare with ours of the same kind)."""

    key = ""
    label = ""
    family = ""
    kind = "sync"
    fsyncs = True

    def __init__(self, root: Path, model: nn.Module, opt: Optim) -> None:
        self.dir = root / self.key
        self.dir.mkdir(parents=True, exist_ok=True)
        self.model, self.opt = model, opt
        self.step = 0

    def latest(self) -> Path:
        """The checkpoint the last save wrote (what a restore reads)."""
        return self.dir / f"step_{self.step}"

    def clear(self) -> None:
        """Untimed, before each save: remove the previous checkpoint."""
        paths.clear_steps(self.dir)

    def save(self) -> Timing:
        self.step += 1
        start = time.perf_counter()
        done = self._save(self.latest())
        blocked = time.perf_counter() - start
        if done is not None:
            done()
        durable = time.perf_counter() - start
        extra = 0.0
        if not self.fsyncs:
            t = time.perf_counter()
            fsync_tree(self.latest())
            extra = time.perf_counter() - t
        return Timing(blocked, durable + extra, extra)

    def _save(self, path: Path) -> Callable[[], object] | None:
        """Start the save into ``path``; return what waits for it (None: synchronous)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class Ours(Contender):
    key, label, family = "ours", "ours: save (sync, verified)", "ours"
    mode: bool | str = False

    def __init__(self, root: Path, model: nn.Module, opt: Optim) -> None:
        super().__init__(root, model, opt)
        self.ckpt = ub.Checkpointer(
            self.dir, model=model, optimizer=opt, keep_last=None, async_save=self.mode
        )

    def latest(self) -> Path:
        return self.dir  # restore() finds the one committed step in the folder

    def _save(self, path: Path) -> Callable[[], object] | None:
        self.ckpt.save(self.step)
        return self.ckpt.wait if self.mode else None

    def close(self) -> None:
        self.ckpt.close()


class OursOverlap(Ours):
    key, label, kind, mode = "ours_overlap", 'ours: async_save="overlap"', "async", "overlap"


class OursAsync(Ours):
    key, label, kind, mode = "ours_async", "ours: async_save=True", "async", True


class DcpSave(Contender):
    key, label, family = "dcp_1", "DCP save, thread_count=1", "dcp"
    threads = 1

    def _save(self, path: Path) -> None:
        paths.dcp_save(self.model, self.opt, str(path), self.threads)


class DcpSave2(DcpSave):
    key, label, threads = "dcp_2", "DCP save, thread_count=2", 2


class DcpAsync(Contender):
    key, label, family, kind = "dcp_async", "DCP async_save (defaults)", "dcp", "async"

    def _save(self, path: Path) -> Callable[[], object]:
        msd, osd = get_state_dict(self.model, self.opt)
        with _quiet():
            fut = dcp.async_save(
                {"model": msd, "optim": osd}, storage_writer=dcp.FileSystemWriter(str(path))
            )
        return fut.result


class TorchSave(Contender):
    key, label, family = "torch_save", "torch.save + fsync", "torch"

    def latest(self) -> Path:
        return self.dir / f"step_{self.step}.pt"

    def _save(self, path: Path) -> None:
        paths.torch_save(self.model, self.opt, str(path))


def _tc_config(direct_io: bool, asynchronous: bool):
    """torch-checkpointing's CPU-only configuration (see the module docstring)."""
    from torch_checkpointing import CheckpointManager, CheckpointStagerConfig
    from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    cuda = torch.cuda.is_available()
    save = (
        AsyncCheckpointSaverConfig(
            staging_config=CheckpointStagerConfig(
                use_pinned_memory=cuda, use_non_blocking_copy=cuda
            )
        )
        if asynchronous
        else SyncCheckpointSaverConfig()
    )
    return CheckpointManager.Config(
        save=save, storage_config=LocalFileSystemStorageConfig(use_direct_io=direct_io)
    )


class TcAsync(Contender):
    key, family, kind, fsyncs = "tc_async", "tc", "async", False
    label = "torch-checkpointing: async save, buffered I/O"
    direct_io, asynchronous = False, True

    def __init__(self, root: Path, model: nn.Module, opt: Optim) -> None:
        super().__init__(root, model, opt)
        self.manager = _tc_config(self.direct_io, self.asynchronous).build()

    def _save(self, path: Path) -> Callable[[], object] | None:
        payload = {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}
        fut = self.manager.save(str(path), payload)
        return fut.result if fut is not None else None

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.manager.close()


class TcSync(TcAsync):
    key, kind, asynchronous = "tc_sync", "sync", False
    label = "torch-checkpointing: sync save, buffered I/O"


class TcAsyncDirect(TcAsync):
    key, direct_io = "tc_async_odirect", True
    label = "torch-checkpointing: async save, default storage (O_DIRECT)"


CONTENDERS: list[type[Contender]] = [
    Ours, OursOverlap, OursAsync, DcpSave, DcpSave2, DcpAsync, TorchSave,
    TcSync, TcAsync, TcAsyncDirect,
]  # fmt: skip

# Which save's checkpoint each restore family reads.
RESTORE_FROM = {"ours": "ours", "dcp": "dcp_1", "torch": "torch_save", "tc": "tc_async"}
RESTORE_LABELS = {
    "ours": "ours: restore()",
    "dcp": "DCP load + set_state_dict",
    "torch": "torch.load + load_state_dict",
    "tc": "torch-checkpointing: load + load_state_dict",
}


def import_library(family: str) -> None:
    """Import what ``restore(family, ...)`` uses, so that a restore's time leaves out the
    one-time cost of importing its library (as a resumed job imports it at start-up)."""
    if family == "ours":
        import unbroken.checkpointer  # noqa: F401  (``import unbroken`` alone is lazy)
    elif family == "tc":
        _tc_config(False, asynchronous=False)


def restore(family: str, path: str, model: nn.Module, opt: Optim) -> None:
    """Read the checkpoint at ``path`` into ``model`` and ``opt`` (fresh objects)."""
    if family == "ours":
        paths.ours_restore(path, model, opt)
    elif family == "dcp":
        with _quiet():
            paths.dcp_load(model, opt, path)
    elif family == "torch":
        paths.torch_load(model, opt, path)
    elif family == "tc":
        manager = _tc_config(False, asynchronous=False).build()  # loads need no writer
        try:
            got = manager.load(path, into={"model": model.state_dict(), "optimizer": None})
            opt.load_state_dict(got["optimizer"])
        finally:
            manager.close()
    else:
        raise ValueError(f"unknown restore family {family!r}")
