"""Run a function on N gloo ranks in fresh spawned processes and collect the results."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import traceback
from collections.abc import Callable
from typing import Any

from processes import free_port


def _worker(fn, rank, world, port, args, queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        try:
            # Plain pickle bytes: the queue's own pickler would share tensor memory
            # with a process that is about to exit.
            queue.put((rank, "ok", pickle.dumps(fn(rank, world, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException as exc:
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    # Delivered now, not at exit: a gloo process can abort during interpreter finalization
    # (a torch-level exit problem, seen once), and the queue's feeder thread would lose the
    # result with it; the parent then waited out its timeout on a test that had passed.
    queue.close()
    queue.join_thread()


def run(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 240) -> list[Any]:
    """``fn(rank, world, *args)`` on each rank; returns per-rank results in rank order.

    A failure on any rank raises ``RuntimeError`` with every failing rank's traceback.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world, port, args, queue)) for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, Any]] = {}
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=timeout)
            results[rank] = (status, value)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = [f"rank {r}: {v}" for r, (s, v) in sorted(results.items()) if s == "error"]
    if errors:
        raise RuntimeError("\n".join(errors))
    return [pickle.loads(results[r][1]) for r in range(world)]
