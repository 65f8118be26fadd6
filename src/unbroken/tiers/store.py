"""The local tier of one Checkpointer (``Checkpointer(local=LocalTier(...))``): its
nodes, this node's folder, the replication thread, and the checks made at its start."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..core import collective
from ..errors import CheckpointError
from ..storage.posix import nearest_existing, size_text
from .config import LocalTier
from .node_folder import NodeFolder
from .nodes import Nodes
from .replication import Job, Replicator

logger = logging.getLogger(__name__)

# File systems that are not this node's memory or disk: a local tier there is refused.
NETWORK_FS = {
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph",
    "glusterfs", "fuse.sshfs", "fuse.s3fs", "fuse.gcsfuse", "fuse.juicefs", "9p", "afs",
}  # fmt: skip


def fs_type(path: str | os.PathLike) -> str | None:
    """The type of the file system holding ``path`` (from /proc/mounts), or None."""
    real = os.path.realpath(path)
    best, kind = "", None
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                parts = line.split()
                if len(parts) < 3:
                    continue
                point = parts[1].replace("\\040", " ")
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, parts[2]
    except OSError:
        return None
    return kind


class LocalStore:
    """The running local tier; made by the Checkpointer (collective)."""

    def __init__(self, tier: LocalTier, persistent: str, estimate: int) -> None:
        self.tier = tier
        self.nodes = Nodes.discover()
        self.folder = NodeFolder(tier.path, persistent)
        self.group = dist.new_group(backend="gloo") if collective.active() else None
        sizes = collective.gather_all(estimate)
        collective.agree(lambda: self._start(sizes))
        if self.nodes.count == 1 and tier.replicas > 0 and collective.rank() == 0:
            warnings.warn(
                f"LocalTier(replicas={tier.replicas}): this job runs on one node, so no "
                "replica can be placed; the local tier survives a process crash, and the "
                "loss of the node falls back to the persistent tier",
                stacklevel=3,
            )
        self._replicator = Replicator(self.folder, self.group)

    # -- placement -----------------------------------------------------------------------

    def targets(self, rank: int) -> list[int]:
        return self.nodes.targets(rank, self.tier.replicas)

    def sources(self, rank: int) -> list[int]:
        return self.nodes.sources(rank, self.tier.replicas)

    # -- the start's checks (each node's leader) ---------------------------------------

    def _start(self, sizes: list[int]) -> None:
        rank = collective.rank()
        if not self.nodes.is_leader(rank):
            return
        path = self.folder.path
        kind = fs_type(nearest_existing(path))
        if kind in NETWORK_FS:
            raise CheckpointError(
                f"the local tier folder {path} is on a network file system ({kind}): it "
                "would be as slow as the persistent tier and shared between nodes. Give "
                "LocalTier a folder in this node's memory, e.g. /dev/shm/unbroken"
            )
        try:
            self.folder.root.mkdir(parents=True, exist_ok=True)
            probe = self.folder.root / f".probe-{os.getpid()}"
            probe.write_bytes(b"unbroken")
            probe.unlink()
        except OSError as exc:
            raise CheckpointError(
                f"the local tier folder {path} is not writable ({exc.strerror or exc}); "
                "give LocalTier a folder this user can write, e.g. /dev/shm/unbroken"
            ) from None
        self.folder.hold()
        self.folder.clean_leftovers()
        node = self.nodes.node_of(rank)
        mine = self.nodes.ranks[node]
        per_step = sum(sizes[r] for r in mine)
        per_step += sum(sizes[s] for r in mine for s in self.sources(r))
        need = per_step * (self.tier.keep_last + 1)
        held = _bytes_under(self.folder.root)
        free = shutil.disk_usage(path).free + held
        if need > free:
            self.folder.release()
            raise CheckpointError(
                f"the local tier folder {path} is too small: keep_last={self.tier.keep_last} "
                f"local steps (and one being saved) of node {node}'s shards plus the "
                f"replicas it keeps need about {size_text(need)} (estimated "
                f"from the model's tensors), and {size_text(free)} is free. "
                "Lower keep_last or replicas, or give the folder more room"
            )

    # -- save, restore -------------------------------------------------------------------

    def queue_replicas(self, step: int, job: Job) -> None:
        """Replication of a committed local step behind training; then retention."""
        self._prune(step)
        if job.sends or job.receives:
            self._replicator.submit(job)

    def _prune(self, newest: int) -> None:
        if not self.nodes.is_leader(collective.rank()):
            return
        steps = [s for s in self.folder.steps() if s != newest]
        for step in steps[: max(0, len(steps) + 1 - self.tier.keep_last)]:
            self.folder.remove(step)

    def steps(self) -> list[int]:
        """The local steps every node has committed, ascending (one round)."""
        held = collective.gather_all(self.folder.steps())
        common = set(held[0]).intersection(*held[1:]) if held else set()
        return sorted(common)

    def drop_newer(self, step: int) -> None:
        """Local steps newer than the one restored are an abandoned branch: removed."""
        if self.nodes.is_leader(collective.rank()):
            for s in self.folder.steps():
                if s > step:
                    self.folder.remove(s)

    def wait(self) -> None:
        """Until every queued replication is done."""
        self._replicator.wait()

    @property
    def failures(self) -> list[str]:
        return list(self._replicator.failures)

    def close(self) -> None:
        try:
            self._replicator.close()
        finally:
            self.folder.release()


def _bytes_under(root: Path) -> int:
    total = 0
    for here, _, names in os.walk(root):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(here, name)).st_size
    return total


def estimate_bytes(model: Any, has_optimizer: bool) -> int:
    """This rank's state, estimated before any step: the model's local tensors, and two
    moments per parameter when an optimizer is passed (AdamW's)."""
    import torch
    from torch.distributed.tensor import DTensor

    modules = model.values() if isinstance(model, dict) else [model]
    total = 0
    for m in modules:
        if not isinstance(m, torch.nn.Module):
            continue
        for p in m.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            total += local.numel() * local.element_size() * (3 if has_optimizer else 1)
        for b in m.buffers():
            local = b.to_local() if isinstance(b, DTensor) else b
            total += local.numel() * local.element_size()
    return total
