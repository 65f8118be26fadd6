"""The processes the tests start: launcher command lines on a free port, and the
processes below one (to kill what a launcher left running)."""

from __future__ import annotations

import socket
import sys
from os import PathLike
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(processes: int, *command: str | PathLike) -> list[str]:
    """``command`` (a script and its arguments) under torchrun on ``processes`` local
    ranks, its rendezvous on a free port."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes)]
    return [*launcher, "--master_port", str(free_port()), *map(str, command)]


def accelerate_launch(processes: int, *command: str | PathLike) -> list[str]:
    """``command`` under ``accelerate launch`` on ``processes`` CPU processes (gloo, no
    mixed precision, no dynamo), on a free port."""
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu"]
    launcher += ["--num_processes", str(processes), "--num_machines", "1"]
    launcher += ["--mixed_precision", "no", "--dynamo_backend", "no"]
    return [*launcher, "--main_process_port", str(free_port()), *map(str, command)]


def _parents() -> dict[int, list[int]]:
    """Every process's children, by parent id, from /proc."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # it ended meanwhile
                continue
            parents.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry.name))
    return parents


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    return _parents().get(pid, [])


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, their children, ...)."""
    parents = _parents()
    found, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        found += kids
        todo += kids
    return found
