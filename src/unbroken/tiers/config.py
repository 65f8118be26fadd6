"""``LocalTier``: what a user asks of the local tier (``Checkpointer(local=...)``)."""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class LocalTier:
    """A second, fast tier of checkpoints: each node keeps its ranks' shards of the last
    ``keep_last`` local steps in a folder in memory (``/dev/shm`` survives a process
    crash), and ``replicas`` other nodes keep a copy of them (surviving a node's loss).

    Args:
        path: this node's folder in memory (a RAM-backed file system, not a network
            one). One job at a time may use it; the job's checkpoints go in a subfolder
            named after its persistent folder.
        replicas: how many other nodes hold a copy of each node's shards (0: none).
        keep_last: local steps each node keeps (the memory held is about
            ``keep_last + 1`` times this node's share of the state, times
            ``1 + replicas``).

    Example::

        ckpt = ub.Checkpointer("s3://bucket/run", model=model, optimizer=opt,
                               local=ub.LocalTier("/dev/shm/unbroken", replicas=1))
        ckpt.save(step, tier="local")   # every few steps
        ckpt.save(step)                 # every few hundred
    """

    path: str | os.PathLike = "/dev/shm/unbroken"
    replicas: int = 1
    keep_last: int = 2

    def __post_init__(self) -> None:
        if not isinstance(self.path, str | os.PathLike) or not os.fspath(self.path):
            raise ValueError(f"LocalTier path must be a folder's path, got {self.path!r}")
        if "://" in os.fspath(self.path):
            raise ValueError(
                f"LocalTier path {os.fspath(self.path)!r} is a URL: the local tier is a "
                "folder of this node's (a RAM-backed one such as /dev/shm/unbroken)"
            )
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int):
            raise ValueError(f"LocalTier replicas must be an int >= 0, got {self.replicas!r}")
        if self.replicas < 0:
            raise ValueError(f"LocalTier replicas must be >= 0, got {self.replicas}")
        if isinstance(self.keep_last, bool) or not isinstance(self.keep_last, int):
            raise ValueError(f"LocalTier keep_last must be an int >= 1, got {self.keep_last!r}")
        if self.keep_last < 1:
            raise ValueError(f"LocalTier keep_last must be >= 1, got {self.keep_last}")
