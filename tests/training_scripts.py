"""What the tests' training scripts share: one step's update, its tail, and the end of
the process.

:func:`regression_step` is one optimizer step on a mean squared error. :func:`end_step`
is the tail of a training step (save at the step's cadence, at the last step, or when a
stop is asked for; stop when asked). :func:`end_process` is the last call of a
multi-process script: it returns, and the interpreter finalizes normally.

Why :func:`end_process` exists: gloo runs each collective on a worker thread of its
process group, and that thread lets go of the finished work (and the tensors in it) a
moment after the caller saw the collective complete. A tensor whose Python object was
dropped first is then freed by the worker, which needs the GIL; if that moment falls in
interpreter finalization, Python refuses the GIL to a foreign thread and the process
aborts ("terminate called without an active exception", SIGABRT) after its work is done
(docs/pitfalls.md; seen with FSDP1 on gloo). Our own collectives wait for gloo to let go
of their tensors; FSDP's, DTensor's and the frameworks' do not. So the process groups
must be gone before finalization: a group's destructor (run without the GIL) joins its
worker threads, and a joined thread holds nothing. ``destroy_process_group()`` only
forgets the groups; they are destroyed once nothing refers to them, and after a run
two things still do:

- Device meshes: torch's DTensor caches (sharding propagation, redistribute planners)
  keep every mesh they saw for the life of the process, and a mesh keeps its groups in
  its registry. The registries of the meshes still alive are emptied here (their groups
  are destroyed: the meshes could not be used again anyway).
- Default arguments: ``torch.distributed.nn.functional`` takes ``group.WORLD`` as a
  default, evaluated when it is imported; imported after ``init_process_group``, it
  keeps the default group for good. This module imports it first, when the default is
  still None.

:func:`end_process` then checks that no gloo worker thread is left, and raises, naming
what to look for, if one is: a certain failure instead of an abort now and then.

Scripts import this module from ``tests/`` (put on ``sys.path`` by the script itself),
before they start a process group.
"""

from __future__ import annotations

import gc
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional  # imported before any group exists: see above

GLOO_WORKER = "pt_gloo_runloop"  # the name torch gives a gloo process group's worker threads


def regression_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, x: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step on the mean squared error of ``model(x)`` against ``y``, the
    gradients clipped to a norm of 1 and the scheduler stepped; (loss, gradient norm)."""
    loss = (model(x) - y).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return loss, grad_norm


def end_step(ckpt: Any, step: int, *, every: int | None = None, last: int | None = None) -> bool:
    """The tail of training step ``step``: save it when ``every`` divides it, when it is
    ``last``, or when a stop is asked for (``UNBROKEN_STOP_AT``, a signal); True when
    the loop must stop. ``should_stop`` is asked once, so the save and the stop agree."""
    stop = ckpt.should_stop(step)
    if stop or step == last or (every is not None and step % every == 0):
        ckpt.save(step)
    return stop


def _gloo_workers() -> list[str]:
    """The gloo worker threads of this process (Linux; elsewhere none are seen)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    found = []
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                if f.read().strip() == GLOO_WORKER:
                    found.append(task)
        except OSError:  # the thread ended meanwhile
            continue
    return found


def _release_meshes() -> None:
    """Empty the group registry of every device mesh still alive: torch's DTensor caches
    (sharding propagation, redistribute planners) keep meshes for the life of the
    process, and a mesh keeps its process groups, destroyed or not."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:
        return
    for obj in gc.get_objects():
        if isinstance(obj, DeviceMesh) and isinstance(getattr(obj, "_pg_registry", None), dict):
            obj._pg_registry.clear()


def end_process() -> None:
    """End a script's distributed run so that the interpreter can finalize normally:
    everything of the run let go (``gc``), every rank past its last collective (a
    barrier), the process groups destroyed and their gloo worker threads joined. Call it
    after ``main()`` returned (its models, optimizers and checkpointers gone); without a
    process group it only collects.

    Raises:
        RuntimeError: a gloo worker thread outlived the process groups (something still
            refers to one), which could abort the process at exit.
    """
    gc.collect()  # FSDP modules, DDP reducers, optimizers: they hold the groups
    if not (dist.is_available() and dist.is_initialized()):
        return
    dist.barrier()
    dist.destroy_process_group()
    _release_meshes()
    gc.collect()
    left = _gloo_workers()
    if left:
        raise RuntimeError(
            f"{len(left)} gloo worker thread(s) outlived destroy_process_group(): something "
            "still refers to a process group (a module-level object, a cache, a default "
            "argument taken at import after init_process_group); find it with "
            "gc.get_referrers and let it go before tests/training_scripts.end_process()"
        )


def single_process_env() -> None:
    """The launcher's variables for a script run as one process without torchrun (a free
    port for the rendezvous); torchrun's own are kept."""
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(name, value)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        from processes import free_port

        os.environ["MASTER_PORT"] = str(free_port())


def end_deepspeed_process() -> None:
    """:func:`end_process` for a DeepSpeed script: its module-level objects keep the
    process groups alive, so after the last barrier the process exits without
    finalizing (nothing is left to write: checkpoints commit before save returns)."""
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def sharded_regression(world: int, seed: int, width: int = 13) -> tuple[Any, Any]:
    """A small learnable model (y = sum(sin(x)) from 4 inputs) sharded by FSDP2 over
    every rank of the job (``init_device_mesh("cpu", (world,))``), and its AdamW. 13
    rows shard unevenly over 2 and 3 ranks (7+6, 5+5+3)."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(4, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1)
    )
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=2e-2, weight_decay=0.01)


def sharded_step(model: Any, opt: Any, step: int, rank: int) -> float:
    """One AdamW step of :func:`sharded_regression`'s model; each rank's batch of each
    step is drawn from its own seed (``1000 * step + rank``). Returns the loss."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(32, 4, generator=g)
    loss = (model(x) - torch.sin(x).sum(dim=1, keepdim=True)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()
