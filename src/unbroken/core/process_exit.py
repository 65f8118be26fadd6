"""The end of a distributed process: an orderly teardown at interpreter exit, so that no
collective's worker thread touches Python while the interpreter finalizes.

Why: gloo runs each collective on a worker thread of its process group
(``pt_gloo_runloop``), and that thread lets go of the finished work, and the tensors in
it, a moment after the caller saw the collective complete. If the caller's Python tensor
is gone by then, the worker frees it, which needs the GIL; once finalization has begun,
Python ends such a thread with ``pthread_exit``, whose unwinding meets a ``noexcept``
destructor: "terminate called without an active exception", SIGABRT, after the script's
work is done. Our own collectives wait for that release (``core/collective.py``); a
framework's do not (``accelerator.gather``, DDP's all-reduce), and on a busy machine a
worker thread can be kept off the CPU past the script's last line.

``torch.distributed.destroy_process_group()`` (torch's advice for the end of a run, and
what ``Accelerator.end_training()`` calls) is not enough alone: it forgets the groups, but
a group's worker threads are joined only by its destructor, which runs once nothing
refers to the group, and a DDP module or a cache still does at exit (measured: torch 2.13,
both workers alive after it). So the hook registered here, at exit, destroys the default
group if the script left it (not after an uncaught exception: other ranks may still be
in a collective), then waits until every gloo worker thread of the process
has stayed asleep, without running, for a short while: each has released its last work,
and nothing is left for finalization. A collective still in flight at exit (started with
``async_op=True`` and never waited for) is not covered: no thread is idle while it runs.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time

import torch.distributed as dist

logger = logging.getLogger(__name__)

GLOO_WORKER = "pt_gloo_runloop"  # the name torch gives a gloo process group's worker threads
QUIET_S = 0.05  # asleep and not run for this long: the last work was released
BOUND_S = 10.0  # never hold up the exit longer than this
_POLL_S = 0.002

_registered = False


def register() -> None:
    """Tear the process group down at interpreter exit (once per process; idempotent).
    Hooks registered later run earlier, so a script's own exit hooks may still use the
    group."""
    global _registered
    if not _registered:
        atexit.register(_at_exit)
        _registered = True


def _at_exit() -> None:
    # After an uncaught exception other ranks may still be inside a collective, where a
    # teardown can deadlock (NCCL; torchtitan destroys only after a clean end too).
    if dist.is_available() and dist.is_initialized() and not _exiting_on_error():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # at exit there is no one to raise to
            logger.debug("destroy_process_group() at exit failed: %s", exc)
    if not wait_for_idle_workers():
        logger.warning(
            "a gloo worker thread was still running %.0f s after the script ended; the "
            "process may abort at exit (SIGABRT) although its work is done",
            BOUND_S,
        )


def _exiting_on_error() -> bool:
    """Whether the script ended on an uncaught exception (Python keeps it in ``sys``)."""
    return any(getattr(sys, name, None) is not None for name in ("last_exc", "last_value"))


def wait_for_idle_workers(*, quiet_s: float = QUIET_S, bound_s: float = BOUND_S) -> bool:
    """Wait until every gloo worker thread of this process has been asleep, and has not
    run, for ``quiet_s``; True once so (at once where there are none, or off Linux),
    False after ``bound_s``. Sleeping here releases the GIL, so a worker that needs it
    to free a tensor gets it."""
    deadline = time.monotonic() + bound_s
    quiet_since = time.monotonic()
    last = _workers()
    while last:
        time.sleep(_POLL_S)
        now = time.monotonic()
        current = _workers()
        if current != last or any(state != "S" for state, _ in current.values()):
            quiet_since = now
        elif now - quiet_since >= quiet_s:
            return True
        if now > deadline:
            return False
        last = current
    return True


def _workers() -> dict[str, tuple[str, int]]:
    """Each gloo worker thread of this process: its state letter and the CPU time it has
    used (ns from ``schedstat``, clock ticks from ``stat`` where schedstat is off)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return {}
    found = {}
    for task in tasks:
        base = f"/proc/self/task/{task}"
        try:
            with open(f"{base}/comm") as f:
                if f.read().strip() != GLOO_WORKER:
                    continue
            with open(f"{base}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            found[task] = (fields[0], _cpu_time(base, fields))
        except (OSError, IndexError, ValueError):  # the thread ended meanwhile
            continue
    return found


def _cpu_time(base: str, stat_fields: list[str]) -> int:
    try:
        with open(f"{base}/schedstat") as f:
            return int(f.read().split()[0])
    except (OSError, IndexError, ValueError):
        return int(stat_fields[11]) + int(stat_fields[12])  # utime + stime
