"""What a torchdata ``StatefulDataLoader``'s state holds about its dataset, and what a
Hugging Face ``datasets.IterableDataset`` leaves out of it (torchdata 0.11, datasets 5.2).

torchdata keeps, per process (``num_workers=0``) or per worker, the dataset's own
``state_dict()`` and that of ``iter(dataset)``; where both are absent (an iterable dataset
without state) a resume replays the batches the epoch had drawn, from a fresh iterator.

A ``datasets.IterableDataset`` misses three things:

- ``load_state_dict`` only remembers the state: ``state_dict()`` reports the loaded
  position once iteration has started, not before (a save right after a restore would
  hold the start of the stream), and the remembered state applies to every later pass of
  the same epoch, not to the next one only.
- its ``shuffle(buffer_size=...)`` keeps the stream position but not the buffer.
- in some releases (datasets#8308) the reported state stops advancing after a resume.

Everything here reads private fields of torchdata and datasets defensively: where they
changed, a check finds nothing and the state passes through unchanged.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterator
from typing import Any

import torch

SINGLE_KEY = "_num_yielded"  # torchdata's state of a num_workers=0 iterator
SNAPSHOT_KEY = "_snapshot"  # ... and of a num_workers>0 one


def is_torchdata_state(state: Any) -> bool:
    """Whether ``state`` has the shape of a torchdata ``StatefulDataLoader``'s."""
    return isinstance(state, dict) and (SINGLE_KEY in state or SNAPSHOT_KEY in state)


def yielded(state: dict) -> int:
    """The batches this epoch's iterator had yielded when ``state`` was taken."""
    if SNAPSHOT_KEY in state:
        step = (state[SNAPSHOT_KEY] or {}).get("_snapshot_step", 0)
        return int(step) + int(state.get("_steps_since_snapshot", 0))
    return int(state[SINGLE_KEY])


def dataset_states(state: dict) -> list[tuple[Any, Any]]:
    """(dataset state, ``iter(dataset)`` state) of the process or of each worker."""

    def pair(part: dict) -> tuple[Any, Any]:
        fetcher = part.get("fetcher_state") or {}
        return part.get("dataset_state"), fetcher.get("dataset_iter_state")

    if SNAPSHOT_KEY in state:
        workers = state[SNAPSHOT_KEY].get("_worker_snapshots") or {}
        return [pair(w) for w in workers.values() if isinstance(w, dict)]
    return [pair(state)]


def hf_iterable(dataset: Any) -> bool:
    """Whether ``dataset`` is a Hugging Face ``datasets.IterableDataset`` (never imports it)."""
    module = sys.modules.get("datasets")
    kind = getattr(module, "IterableDataset", None) if module is not None else None
    return isinstance(kind, type) and isinstance(dataset, kind)


def dataset_epoch(loader: Any) -> int | None:
    """The epoch of a loader's dataset that has ``set_epoch()`` (datasets' IterableDataset
    and others), or None."""
    dataset = getattr(loader, "dataset", None)
    epoch = getattr(dataset, "epoch", None)
    if not callable(getattr(dataset, "set_epoch", None)):
        return None
    if isinstance(epoch, torch.Tensor) and epoch.dim() == 0 and not epoch.is_floating_point():
        epoch = int(epoch.item())
    return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None


def sampler_epoch(loader: Any) -> int | None:
    """The epoch of a loader's sampler that has ``set_epoch()`` (``DistributedSampler``,
    torchdata's ``StatefulDistributedSampler``: their order is a function of seed and
    epoch), or None."""
    sampler = getattr(loader, "sampler", None)
    epoch = getattr(sampler, "epoch", None)
    if not callable(getattr(sampler, "set_epoch", None)):
        return None
    return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None


class ResumedPass:
    """The pass a restore created, and the state it was created from.

    torchdata answers ``state_dict()`` from live objects, and a datasets stream reports
    its loaded position only once it has begun reading: until the resumed pass draws a
    batch (``num_workers=0``), or a worker hands over its first batch since the restore,
    those report the stream's start. The loaded state is the truth until then."""

    def __init__(self, iterator: Any, state: dict, fresh: Any, epoch: int | None) -> None:
        self.iterator = iterator
        # A new pass makes a new iterator, or (persistent workers) resets this one, which
        # makes a new sampler iterator.
        self.sampler_iter = getattr(iterator, "_sampler_iter", None)
        self.state = copy.deepcopy(state)
        # What each worker reported when it started (before it read anything).
        self.started = (
            _workers(copy.deepcopy(iterator.state_dict())) if SNAPSHOT_KEY in state else {}
        )
        self.fresh = fresh  # a datasets stream's position before anything was loaded
        self.epoch = epoch  # the dataset's epoch it was restored in

    def same_pass(self, loader: Any) -> bool:
        """Whether ``loader`` is still in the pass the restore created."""
        iterator = getattr(loader, "_iterator", None)
        return iterator is self.iterator and (
            getattr(iterator, "_sampler_iter", None) is self.sampler_iter
        )

    def settle(self, state: dict) -> dict:
        """``state`` with what was loaded in place of what the pass has not replaced: the
        whole state before the first batch (``num_workers=0``) or the first snapshot; the
        state of each worker that has handed over no batch since."""
        if SNAPSHOT_KEY not in state:
            return copy.deepcopy(self.state) if yielded(state) == yielded(self.state) else state
        loaded = self.state[SNAPSHOT_KEY]
        if state[SNAPSHOT_KEY].get("_snapshot_step") == loaded.get("_snapshot_step"):
            return {**state, SNAPSHOT_KEY: copy.deepcopy(loaded)}
        workers = {
            key: copy.deepcopy(_workers(self.state)[key])
            if key in self.started and key in _workers(self.state) and _same(now, self.started[key])
            else now
            for key, now in _workers(state).items()
        }
        return {**state, SNAPSHOT_KEY: {**state[SNAPSHOT_KEY], "_worker_snapshots": workers}}

    def frozen(self, state: dict) -> bool:
        """A datasets stream whose position stayed where it was loaded, or at its start,
        although the pass drew batches (datasets#8308)."""
        if SNAPSHOT_KEY in state:
            step = state[SNAPSHOT_KEY].get("_snapshot_step", 0)
            if step <= self.state[SNAPSHOT_KEY].get("_snapshot_step", 0):
                return False
        elif yielded(state) <= yielded(self.state):
            return False
        now = [_position(s) for s, _ in dataset_states(state)]
        if not now or any(p is None for p in now):
            return False
        return now == [_position(s) for s, _ in dataset_states(self.state)] or all(
            p == self.fresh for p in now
        )


def _workers(state: dict) -> dict:
    return state.get(SNAPSHOT_KEY, {}).get("_worker_snapshots") or {}


def _same(a: Any, b: Any) -> bool:
    """Equal plain state; anything ``==`` cannot decide (tensors inside) is not."""
    try:
        return bool(a == b)
    except Exception:
        return False


def stream_position(dataset: Any) -> Any:
    """A datasets stream's reported position (its examples iterable's state), or None."""
    try:
        return _position(dataset.state_dict())
    except Exception:  # not iterated yet in a way datasets can report
        return None


def _position(dataset_state: Any) -> Any:
    return dataset_state.get("examples_iterable") if isinstance(dataset_state, dict) else None


def forget_start_once_begun(iterator: Any, dataset: Any) -> None:
    """Make a restored datasets stream forget its loaded state once the resumed pass has
    begun (``num_workers=0``): datasets applies it to every pass of the same epoch, so a
    loop that does not call ``set_epoch()`` would start each later pass where the resume
    began, not at the start of the stream."""
    fetcher = getattr(iterator, "_dataset_fetcher", None)
    items = getattr(fetcher, "dataset_iter", None)
    if items is None or not hasattr(dataset, "_starting_state_dict"):
        return
    fetcher.dataset_iter = _forgetting(items, dataset)


def _forgetting(items: Iterator[Any], dataset: Any) -> Iterator[Any]:
    try:
        first = next(items)  # datasets applies the loaded state here
    except StopIteration:
        return
    finally:
        dataset._starting_state_dict = None
    yield first
    yield from items


def buffer_shuffled(dataset: Any) -> bool:
    """Whether a datasets stream is shuffled through a buffer (``.shuffle()``) whose
    content its ``state_dict()`` leaves out."""
    module = sys.modules.get("datasets.iterable_dataset")
    kind = getattr(module, "BufferShuffledExamplesIterable", None)
    if not isinstance(kind, type):
        return False
    pending, seen = [getattr(dataset, "_ex_iterable", None)], 0
    while pending and seen < 1000:
        node, seen = pending.pop(), seen + 1
        if node is None:
            continue
        if isinstance(node, kind):
            return True
        pending.append(getattr(node, "ex_iterable", None))
        pending.extend(getattr(node, "ex_iterables", None) or [])
    return False
