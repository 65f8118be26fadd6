"""Files between ranks over ``torch.distributed`` (gloo, host memory): replicas after a
local save, missing shards before a restore.

Both ends know every file's size (from the manifest), so no header is sent: each rank
posts all its sends and receives at once, then waits. A file goes in chunks; between two
ranks the chunks are matched by tag (their order in the list both ends build alike).
Sends read the file in place (a private mapping) and receives write into the file
(a shared mapping): on a RAM-backed folder the bytes are copied once, by the network.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ..core import collective

CHUNK = 64 << 20  # bytes per message


def _pieces(size: int) -> list[tuple[int, int]]:
    return [(a, min(a + CHUNK, size)) for a in range(0, size, CHUNK)]


@contextlib.contextmanager
def _mapped(path: Path, size: int, *, write: bool) -> Iterator[np.ndarray | None]:
    if size == 0:
        if write:
            path.touch()
        yield None
        return
    if write:
        with open(path, "wb") as f:
            f.truncate(size)
    data = np.memmap(path, dtype=np.uint8, mode="r+" if write else "c", shape=(size,))
    try:
        yield data
    finally:
        if write:
            data.flush()
        del data


def exchange(sends: list[tuple[int, Path, int]], receives: list[tuple[int, Path, int]]) -> None:
    """Send each ``(rank, file, size)`` of ``sends`` to its rank and receive each of
    ``receives`` from its rank into its file, all at once; returns when all are done.
    Files to (from) one peer go in the order listed, as the peer lists them."""
    if not (sends or receives):
        return
    group = collective.group()
    works, held = [], []
    tags: dict[tuple[str, int], int] = {}
    with contextlib.ExitStack() as stack:
        for kind, items in (("send", sends), ("recv", receives)):
            for peer, path, size in items:
                data = stack.enter_context(_mapped(path, size, write=kind == "recv"))
                for a, b in _pieces(size):
                    tag = tags.get((kind, peer), 0)
                    tags[kind, peer] = tag + 1
                    with warnings.catch_warnings():  # a private mapping is never written
                        warnings.simplefilter("ignore", UserWarning)
                        t = torch.from_numpy(data[a:b])
                    held.append(t)
                    post = dist.isend if kind == "send" else dist.irecv
                    works.append(post(t, peer, group=group, tag=tag))
        for work in works:
            work.wait()
        del held


def file_rank(name: str) -> int | None:
    """The rank that wrote shard file ``name`` (``rank_00003.bin``, ``rank_00003.1.bin``)."""
    stem = os.path.basename(name)
    if not stem.startswith("rank_"):
        return None
    digits = stem[5:].split(".", 1)[0]
    return int(digits) if digits.isdigit() else None
