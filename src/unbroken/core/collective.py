"""Process-group helpers that also work without one (a plain single process).

Every rank must reach the same decisions: a check that fails on one rank is raised on
all of them (:func:`agree`), so no rank waits in a collective while another has left.

On gloo, every tensor these helpers hand a collective is kept until gloo's worker thread
has let go of it (:func:`_released`). Otherwise Python may drop it first, while the worker
still holds the finished work for a moment; the worker then frees the tensor's Python
object, which needs the GIL, and if that moment falls in interpreter finalization (the
last collective of ``close()`` just before the script returns), Python refuses it and the
process aborts with ``terminate called without an active exception`` (issue 29). The
object collectives are ours for that reason: torch's drop their tensors inside.

:func:`unwrap` turns DCP's exception that gathered every rank's failure into the one error
a caller raises (the first rank's, named).
"""

from __future__ import annotations

import contextlib
import errno
import pickle
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ..errors import CheckpointError
from ..storage.interface import Location

T = TypeVar("T")
_local = threading.local()
_U32, _U64 = (1 << 32) - 1, (1 << 64) - 1
_RELEASE_S = 5.0  # the longest wait for gloo's worker to let go of a tensor (never a hang)


@contextlib.contextmanager
def using(group: Any) -> Iterator[None]:
    """Run this thread's collectives on ``group`` (e.g. a background save's own group)."""
    previous = getattr(_local, "group", None)
    _local.group = group
    try:
        yield
    finally:
        _local.group = previous


def group() -> Any:
    """The process group of this thread's collectives (None: the default group)."""
    return getattr(_local, "group", None)


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is True on at least one (the default group)."""
    if not active():
        return flag
    box = torch.tensor([int(flag)], dtype=torch.int32)
    if dist.get_backend() == "nccl":
        box = box.cuda()
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    _released(box)
    return bool(box.item())


def _on_gloo() -> bool:
    return dist.get_backend(group()) == "gloo"


def _released(*tensors: torch.Tensor) -> None:
    """Return once no one but the caller holds ``tensors`` (CPU tensors of a finished
    collective): gloo's worker thread lets go of its work a moment after the collective
    returns. Bounded by ``_RELEASE_S``; a tensor on a GPU is not waited for.
    ``Tensor._use_count`` (torch-private: the holders of the tensor's C++ object, this
    Python object one of them) is checked for: without it, this returns at once."""
    if not hasattr(torch.Tensor, "_use_count"):
        return
    deadline = None
    while any(t.device.type == "cpu" and t._use_count() > 1 for t in tensors):
        now = time.monotonic()
        deadline = deadline or now + _RELEASE_S
        if now > deadline:
            return
        time.sleep(0.0002)


def _to_bytes(value: Any) -> torch.Tensor:
    payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    out = torch.empty(len(payload), dtype=torch.uint8)  # torch's own memory, not Python's
    out.numpy()[:] = np.frombuffer(payload, dtype=np.uint8)
    return out


def _from_bytes(data: torch.Tensor, size: int) -> Any:
    return pickle.loads(data[:size].numpy().tobytes())


def _sizes(data: torch.Tensor) -> list[int]:
    """Every rank's ``len(data)``, in rank order (one all-gather)."""
    mine = torch.tensor([data.numel()], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size())]
    dist.all_gather(sizes, mine, group=group())
    _released(mine, *sizes)
    return [int(s.item()) for s in sizes]


def _padded(data: torch.Tensor, size: int) -> torch.Tensor:
    if data.numel() == size:
        return data
    out = torch.zeros(size, dtype=torch.uint8)
    out[: data.numel()] = data
    return out


def gather_all(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order, on every rank."""
    if not active():
        return [value]
    if not _on_gloo():
        out: list[Any] = [None] * world_size()
        dist.all_gather_object(out, value, group=group())
        return out
    data = _to_bytes(value)
    sizes = _sizes(data)
    longest = max(sizes)
    mine = _padded(data, longest)
    gathered = [torch.empty(longest, dtype=torch.uint8) for _ in sizes]
    dist.all_gather(gathered, mine, group=group())
    _released(mine, *gathered)
    return [_from_bytes(t, n) for t, n in zip(gathered, sizes, strict=True)]


def gather_to_rank0(value: Any) -> list[Any] | None:
    """Every rank's ``value``, in rank order, on rank 0; None on the others. Each rank
    sends one message to rank 0, where :func:`gather_all` sends every value to every rank
    (at a thousand ranks, a thousand times the bytes and the unpickling)."""
    if not active():
        return [value]
    if not _on_gloo():
        out: list[Any] | None = [None] * world_size() if rank() == 0 else None
        dist.gather_object(value, out, dst=0, group=group())
        return out
    data = _to_bytes(value)
    sizes = _sizes(data)
    longest = max(sizes)
    mine = _padded(data, longest)
    if rank() != 0:
        dist.gather(mine, None, dst=0, group=group())
        _released(mine)
        return None
    gathered = [torch.empty(longest, dtype=torch.uint8) for _ in sizes]
    dist.gather(mine, gathered, dst=0, group=group())
    _released(mine, *gathered)
    return [_from_bytes(t, n) for t, n in zip(gathered, sizes, strict=True)]


def _broadcast_from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (two broadcasts: the size, then the bytes)."""
    if not _on_gloo():
        box = [value]
        dist.broadcast_object_list(box, src=0, group=group())
        return box[0]
    data = _to_bytes(value) if rank() == 0 else None
    size = torch.tensor([0 if data is None else data.numel()], dtype=torch.int64)
    dist.broadcast(size, src=0, group=group())
    _released(size)
    if data is None:
        data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(data, src=0, group=group())
    _released(data)
    return _from_bytes(data, data.numel())


def from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank."""
    if not active():
        return value
    return _broadcast_from_rank0(value)


def _attempt(fn: Callable[[], T]) -> tuple[T | None, Exception | None]:
    """(``fn()``, None), or (None, the exception it raised)."""
    try:
        return fn(), None
    except Exception as exc:
        return None, exc


def agree(fn: Callable[[], T], *, only_rank0: bool = False) -> T | None:
    """Run ``fn`` (on rank 0 only if asked); if it raised anywhere, raise on every rank.

    The error raised is the one of the lowest failing rank, with its rank named when
    there is more than one process.
    """
    result, error = _attempt(fn) if not only_rank0 or rank() == 0 else (None, None)
    if not active():
        if error is not None:
            raise error
        return result
    _raise_first(gather_all(None if error is None else (type(error), str(error))), error)
    return result


def on_rank0(fn: Callable[[], T]) -> T | None:
    """Run ``fn`` on rank 0 only and return its result on every rank; if it raised, raise
    on every rank (as :func:`agree` with ``only_rank0``). One broadcast: half the rounds
    of :func:`agree` followed by :func:`from_rank0`."""
    result, error = _attempt(fn) if rank() == 0 else (None, None)
    if not active():
        if error is not None:
            raise error
        return result
    summary, value = _broadcast_from_rank0(
        (None, result) if error is None else ((type(error), str(error)), None)
    )
    _raise_first([summary], error)
    return value


def agree_sharing(fn: Callable[[], T], shared: Any) -> tuple[T | None, list[Any]]:
    """Run ``fn`` on every rank as :func:`agree` does, and in the same round hand every
    rank's ``shared`` (computed before, so it does not wait for ``fn``) to every rank, in
    rank order. Returns ``fn``'s result here and the list of shared values."""
    result, error = _attempt(fn)
    if not active():
        if error is not None:
            raise error
        return result, [shared]
    summary = None if error is None else (type(error), str(error))
    gathered = gather_all((summary, shared))
    _raise_first([s for s, _ in gathered], error)
    return result, [value for _, value in gathered]


def agree_summing(fn: Callable[[], T], values: list[int]) -> tuple[T | None, list[int]]:
    """Run ``fn`` on every rank as :func:`agree` does, and in the same round add up
    ``values`` (unsigned 64-bit, wrapping; the same length on every rank) elementwise over
    the ranks: one all-reduce of a small tensor, whatever the number of ranks. A second
    round, gathering the errors, is taken only when ``fn`` raised somewhere.
    Returns ``fn``'s result here and the sums."""
    result, error = _attempt(fn)
    if not active():
        if error is not None:
            raise error
        return result, [v & _U64 for v in values]
    # Each value as two 32-bit halves, so that sums of up to 2**31 ranks stay exact in
    # int64 (a signed overflow is undefined behaviour in the backends' C++).
    halves = [v >> s & _U32 for v in values for s in (32, 0)]
    box = torch.tensor([int(error is not None), *halves], dtype=torch.int64)
    if dist.get_backend(group()) == "nccl":
        box = box.cuda()
    dist.all_reduce(box, op=dist.ReduceOp.SUM, group=group())
    _released(box)
    failed, *sums = box.tolist()
    if failed:
        _raise_first(gather_all(None if error is None else (type(error), str(error))), error)
    return result, [((hi << 32) + lo) & _U64 for hi, lo in zip(sums[::2], sums[1::2], strict=True)]


def least(values: list[int]) -> list[int]:
    """The smallest of each of ``values`` (non-negative, below 2**62, the same length on
    every rank) over the ranks: one all-reduce of a small tensor."""
    if not active():
        return list(values)
    box = torch.tensor(values, dtype=torch.int64)
    if dist.get_backend(group()) == "nccl":
        box = box.cuda()
    dist.all_reduce(box, op=dist.ReduceOp.MIN, group=group())
    _released(box)
    return box.tolist()


def agree_all(fn: Callable[[], T]) -> list[T]:
    """Run ``fn`` on every rank and return every rank's result, in rank order, on every
    rank; if it raised anywhere, raise on every rank as :func:`agree` does."""
    result, error = _attempt(fn)
    if not active():
        if error is not None:
            raise error
        return [result]  # type: ignore[list-item]
    gathered = gather_all((None, result) if error is None else ((type(error), str(error)), None))
    _raise_first([summary for summary, _ in gathered], error)
    return [value for _, value in gathered]


def _raise_first(summaries: list[Any], error: BaseException | None) -> None:
    """Raise the error of the lowest rank whose summary is not None (this rank's own
    ``error`` if it is that rank)."""
    for r, summary in enumerate(summaries):
        if summary is None:
            continue
        if error is not None and r == rank():
            raise error
        kind, message = summary
        if not (isinstance(kind, type) and issubclass(kind, Exception)):
            kind = CheckpointError
        try:
            raised = kind(f"[rank {r}] {message}")
        except Exception:
            raised = CheckpointError(f"[rank {r}] {kind.__name__}: {message}")
        raise raised


def unwrap(exc: CheckpointException, doing: str, path: Location | None = None) -> BaseException:
    """Turn DCP's multi-rank exception into the first underlying error, rank named
    (and, for a full disk, the free space at ``path``).

    An interrupt (KeyboardInterrupt, SystemExit) comes back unchanged, so a loop that
    catches ``CheckpointError`` (a full disk, say) never swallows a Ctrl-C."""
    for rank, failure in sorted(exc.failures.items()):
        inner = failure[0] if isinstance(failure, tuple) else getattr(failure, "exception", failure)
        if isinstance(inner, BaseException) and not isinstance(inner, Exception):
            return inner  # KeyboardInterrupt, SystemExit: the caller's, unchanged
        where = f"[rank {rank}] " if world_size() > 1 else ""
        if isinstance(inner, CheckpointError):
            return type(inner)(f"{where}{inner}")
        if isinstance(inner, OSError) and inner.errno == errno.ENOSPC:
            free = f", {path.free_space()} free there" if path is not None else ""
            return CheckpointError(
                f"{where}{doing} failed: the disk is full ({inner}{free}). The partial save "
                "was removed and earlier checkpoints are untouched; free space (or lower "
                "keep_last) and save again"
            )
        return CheckpointError(f"{where}{doing} failed: {type(inner).__name__}: {inner}")
    return CheckpointError(f"{doing} failed: {exc}")
