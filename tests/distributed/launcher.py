"""Run a function on N gloo ranks in fresh processes and collect the results.

Each rank is a new process forked from a forkserver that has imported torch,
torch.distributed and unbroken once per test process (spawning re-imported them in
every rank, 3-10 s each on 2 busy cores). The server only imports: it has run no torch
op, made no process group and started no OpenMP threads, so a rank begins as a spawned
one did. Like a spawned rank it takes the test process's current environment, stdout
and stderr (multiprocessing itself carries the working directory and sys.path), and its
torch and numpy generators are seeded from the OS as a new process seeds them.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import pickle
import sys
import traceback
from collections.abc import Callable
from multiprocessing import forkserver, reduction
from typing import Any

from processes import free_port

# What every rank imports anyway; the test module itself is imported by each rank.
PRELOAD = ["torch", "torch.distributed", "numpy", "unbroken", "conftest"]


def _same(value: Any) -> Any:
    return value


class _ParentFd:
    """The test process's file descriptor ``fd``, handed to the rank through the
    forkserver (which started with the descriptors of an earlier test's capture)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        return (_same, (reduction.DupFd(self.fd),))


def _worker(fn, rank, world, port, args, queue, env, stdout, stderr) -> None:
    os.dup2(stdout.detach(), 1)
    os.dup2(stderr.detach(), 2)
    os.environ.clear()
    os.environ.update(env)
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

    # Fresh OS entropy, as a new process seeds itself (Python's random reseeds at fork).
    torch.seed()
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()
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


_server_started = False


def _context() -> mp.context.BaseContext:
    """The forkserver context, its server started once per test process with PRELOAD
    imported, under OMP_NUM_THREADS=1 (only the server's environment: the test process's
    own is restored at once)."""
    global _server_started
    ctx = mp.get_context("forkserver")
    if not _server_started:
        ctx.set_forkserver_preload(PRELOAD)
        before = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            forkserver.ensure_running()
        finally:
            if before is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = before
        # Stopped and waited for at exit, not left to init: its ranks' CPU time then counts
        # toward this process's children, as a spawned rank's did.
        atexit.register(forkserver._forkserver._stop)
        _server_started = True
    return ctx


def run(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 240) -> list[Any]:
    """``fn(rank, world, *args)`` on each rank; returns per-rank results in rank order.

    A failure on any rank raises ``RuntimeError`` with every failing rank's traceback.
    """
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    inherit = (dict(os.environ), _ParentFd(1), _ParentFd(2))
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world, port, args, queue, *inherit))
        for r in range(world)
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
