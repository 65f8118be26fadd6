"""launcher.run starts every rank as a fresh process: forked from a server that has only
imported torch and unbroken, each rank still gets its own process, its own random seeds,
a fresh import of the test module and the test process's environment."""

from __future__ import annotations

import os

import pytest
import torch

from . import launcher

pytestmark = pytest.mark.distributed

SEEN: list[int] = []  # module state: a rank appends to its own fresh copy


def _state(rank: int, world: int) -> dict:
    import torch.distributed as dist

    SEEN.append(rank)
    return {
        "pid": os.getpid(),
        "seed": torch.initial_seed(),
        "seen": list(SEEN),
        "env": os.environ.get("UNBROKEN_LAUNCHER_PROBE"),
        "world": dist.get_world_size(),
        "cwd": os.getcwd(),
    }


def test_ranks_are_fresh_processes(monkeypatch, tmp_path):
    monkeypatch.setenv("UNBROKEN_LAUNCHER_PROBE", "first")
    monkeypatch.chdir(tmp_path)
    first = launcher.run(_state, 2)
    monkeypatch.setenv("UNBROKEN_LAUNCHER_PROBE", "second")
    second = launcher.run(_state, 2)
    pids = {r["pid"] for r in first + second}
    assert len(pids) == 4 and os.getpid() not in pids
    assert len({r["seed"] for r in first + second}) == 4
    assert [r["seen"] for r in first + second] == [[0], [1], [0], [1]]
    assert [r["env"] for r in first + second] == ["first"] * 2 + ["second"] * 2
    assert all(r["world"] == 2 and r["cwd"] == str(tmp_path) for r in first + second)
    assert SEEN == []
