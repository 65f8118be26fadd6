"""The ways to save and restore a training state that the benchmarks compare.

(a) the disk floor: the state's raw bytes written with plain file writes + fsync, and
    read back with ``readinto``; (b) ``torch.save``/``torch.load`` of the full state;
(c) raw ``torch.distributed.checkpoint`` through ``get_state_dict``/``set_state_dict``;
(d) ours, ``unbroken.Checkpointer``. Each is a plain function, so the single-process
benchmark, the FSDP2 worker and the profiler run exactly the same code.
"""

from __future__ import annotations

import os
import shutil
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import unbroken as ub


def raw_bytes(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy."""
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


def fsync_path(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def clear(path: str | os.PathLike) -> None:
    """Remove a file or folder if present, and flush the removal to disk (untimed setup:
    a later timed write must not pay for this one's journal commit or discards)."""
    p = Path(path)
    if p.is_dir():
        shutil.rmtree(p)
    elif p.exists():
        p.unlink()
    os.sync()


def clear_steps(folder: str | os.PathLike) -> None:
    """Remove every step a checkpointer saved in ``folder`` (untimed setup, as ``clear``)."""
    for p in Path(folder).glob("step_*"):
        clear(p)


# (a) the disk floor ------------------------------------------------------------------


def write_raw(tensors: list[torch.Tensor], path: str) -> None:
    with open(path, "wb") as f:
        for t in tensors:
            f.write(raw_bytes(t))
        f.flush()
        os.fsync(f.fileno())


def read_raw(targets: list[torch.Tensor], path: str) -> None:
    """Read the file written by :func:`write_raw` into existing tensors."""
    with open(path, "rb", buffering=0) as f:
        for t in targets:
            buf = raw_bytes(t)
            if f.readinto(buf) != len(buf):
                raise OSError(f"{path} is shorter than the state")


def read_raw_new(like: list[torch.Tensor], path: str) -> list[torch.Tensor]:
    """Read it into newly allocated tensors (pays the first touch of every page)."""
    out = [torch.empty_like(t) for t in like]
    read_raw(out, path)
    return out


def read_files_new(files: list[str], piece: int = 16 << 20) -> list[torch.Tensor]:
    """Read whole files, one after another, into new tensors of ``piece`` bytes (the
    size of the benchmark's state tensors): the floor of a rank's cold restore."""
    out: list[torch.Tensor] = []
    for path in files:
        size = os.path.getsize(path)
        targets = [
            torch.empty(min(piece, size - at), dtype=torch.uint8) for at in range(0, size, piece)
        ]
        read_raw(targets, path)
        out += targets
    return out


def copy_into(targets: list[torch.Tensor], tensors: list[torch.Tensor]) -> None:
    """One copy of the state into memory already allocated and touched."""
    for dst, src in zip(targets, tensors, strict=True):
        dst.copy_(src)


# (b) torch.save / torch.load of the full state -----------------------------------------


def torch_save(model: nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    fsync_path(path)


def torch_load(model: nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])


# (c) raw torch.distributed.checkpoint --------------------------------------------------


def dcp_save(model: nn.Module, opt: torch.optim.Optimizer, path: str, threads: int) -> None:
    msd, osd = get_state_dict(model, opt)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(
            {"model": msd, "optim": osd},
            storage_writer=dcp.FileSystemWriter(path, thread_count=threads),
        )


def dcp_load(model: nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    """Load into the live objects: templates from ``get_state_dict`` (which, for an
    optimizer without state, first runs a zero-gradient step to create it)."""
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=dcp.FileSystemReader(path))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


# (d) ours ------------------------------------------------------------------------------


def ours_restore(path: str, model: nn.Module, opt: torch.optim.Optimizer) -> ub.RestoreReport:
    """What a resumed process runs: a Checkpointer over the live objects, ``restore()``."""
    with ub.Checkpointer(path, model=model, optimizer=opt) as ckpt:
        report = ckpt.restore()
    if not (report.restored and report.verified):
        raise RuntimeError(f"restore did not restore and verify: {report}")
    return report


def async_checkpointer(
    path: str, model: nn.Module, opt: torch.optim.Optimizer
) -> tuple[ub.Checkpointer | None, str]:
    """A Checkpointer with ``async_save=True``, or None and the reason it is refused."""
    try:
        return ub.Checkpointer(
            path, model=model, optimizer=opt, keep_last=None, async_save=True
        ), ""
    except (ValueError, TypeError, NotImplementedError) as exc:
        return None, f"{type(exc).__name__}: {exc}"


def wait_committed(ckpt: ub.Checkpointer, step: int, timeout: float) -> bool:
    """Poll until ``step`` is committed (True), or give up after ``timeout`` seconds."""
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        if ckpt.latest_step() == step:
            return True
        time.sleep(0.002)
    return False
