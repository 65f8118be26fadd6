"""``dataloader``: the data position, restored so that the next batches *and* every random
draw after them are the ones an uninterrupted run makes.

What a loader's own ``state_dict()`` misses with torchdata's ``StatefulDataLoader``
(checked against torchdata 0.11 and datasets 5.2; the details in ``live/loader_state.py``):

- creating the iterator draws a base seed from the loader's ``generator`` or, without one,
  from the global torch RNG. A resumed run creates it after ``restore()`` put the RNGs
  back, so every later dropout mask shifts by one draw. We create the resumed iterator
  inside ``restore()``, before the ``rng`` component is put back; the loader hands that
  iterator to the training loop's next ``iter(loader)``.
- a loader's ``generator`` shuffles every epoch, but its state is not in ``state_dict()``:
  the next epoch after a resume was shuffled differently. We save and restore it.
- a dataset's epoch (``set_epoch()``: a Hugging Face ``datasets.IterableDataset`` shuffles
  its shards by it and resumes only a state of the same epoch) is not in it either: the
  loop could not tell which epoch to go on with, and the workers of the iterator made
  inside ``restore()`` may start reading before the loop calls ``set_epoch()``; a resume
  in epoch 2 read epoch 0 from its start. We save the epoch and set it before the
  iterator is made.
- likewise a sampler's epoch (``DistributedSampler.set_epoch()``: its shuffle is a function
  of seed and epoch): the iterator made inside ``restore()`` drew epoch 0's order for the
  rest of a later epoch, whatever the loop set afterwards. We save it and set it first.
- until the resumed pass draws a batch, torchdata reports a datasets stream at its start
  (datasets applies a loaded state only once iteration begins; with workers, each worker
  until it hands over a batch): a save right after a restore recorded the start, and the
  next resume read the stream again. We keep the loaded state until the pass replaced it.
- datasets applies a loaded state to every later pass of the same epoch: without
  ``set_epoch()`` between passes, each pass after a resume began where the resume did
  (``num_workers=0``). The stream forgets it once the resumed pass has begun.

Some positions cannot be saved cheaply or exactly; every save records them
(:meth:`LoaderComponent.save_warnings`: the manifest's ``save_warnings``,
``Checkpointer.warnings``, logged once): an iterable dataset without state (a resume
replays the epoch's batches), a datasets stream shuffled through a buffer (its state leaves
the buffer out), persistent workers that began a pass where the resume did, a datasets
stream whose state stopped advancing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from . import loader_state
from .state import StatefulComponent

GENERATOR_KEY = "unbroken:generator"
EPOCH_KEY = "unbroken:dataset_epoch"
SAMPLER_EPOCH_KEY = "unbroken:sampler_epoch"
_OURS = (GENERATOR_KEY, EPOCH_KEY, SAMPLER_EPOCH_KEY)
DATASETS_PAGE = "docs/integrations/datasets.md"

PLAIN_LOADER_FIX = (
    "a torch.utils.data.DataLoader has no state_dict(): its position cannot be saved, so "
    "a resumed run would start the epoch over. Use torchdata's StatefulDataLoader (pip "
    "install torchdata; `from torchdata.stateful_dataloader import StatefulDataLoader`, "
    "same arguments), or, for a DistributedSampler loop, pass a small object holding the "
    "epoch and the batches consumed (see 'A DistributedSampler loop' in docs/pitfalls.md)"
)


class ExactLoader:
    """A ``Stateful`` view of one data loader that also keeps what its state_dict misses.

    Not thread-safe: used by the training thread (``save()`` captures in it)."""

    def __init__(self, loader: Any, label: str = "dataloader") -> None:
        self.loader = loader
        self.label = label
        self.notes: list[str] = []  # what the last state_dict() found (save_warnings)
        self._resumed: loader_state.ResumedPass | None = None
        # A later pass of a persistent-worker datasets stream began in the resumed epoch.
        self._replayed_passes = False

    def _generator(self) -> torch.Generator | None:
        g = getattr(self.loader, "generator", None)
        return g if isinstance(g, torch.Generator) else None

    def state_dict(self) -> Any:
        state = self.loader.state_dict()
        if loader_state.is_torchdata_state(state):
            state = self._settled(state)
        self.notes = self._findings(state)
        extra = {}
        g = self._generator()
        if g is not None:
            extra[GENERATOR_KEY] = g.get_state()
        epoch = loader_state.dataset_epoch(self.loader)
        if epoch is not None:
            extra[EPOCH_KEY] = epoch
        sampler_epoch = loader_state.sampler_epoch(self.loader)
        if sampler_epoch is not None:
            extra[SAMPLER_EPOCH_KEY] = sampler_epoch
        if extra and isinstance(state, dict):
            taken = sorted(set(extra) & set(state))
            if taken:
                raise ValueError(f"the data loader's state_dict() uses the key {taken[0]!r}")
            state = {**state, **extra}
        return state

    def load_state_dict(self, state: Any) -> None:
        generator_state = epoch = sampler_epoch = None
        if isinstance(state, dict) and any(key in state for key in _OURS):
            state = dict(state)
            generator_state = state.pop(GENERATOR_KEY, None)
            epoch = state.pop(EPOCH_KEY, None)
            sampler_epoch = state.pop(SAMPLER_EPOCH_KEY, None)
        if sampler_epoch is not None and loader_state.sampler_epoch(self.loader) is not None:
            self.loader.sampler.set_epoch(sampler_epoch)  # before the resumed iterator is made
        dataset = getattr(self.loader, "dataset", None)
        if epoch is not None and loader_state.dataset_epoch(self.loader) is not None:
            dataset.set_epoch(epoch)  # before any worker starts reading (module docstring)
        fresh = loader_state.stream_position(dataset) if loader_state.hf_iterable(dataset) else None
        self.loader.load_state_dict(state)
        self._resumed = None
        if _creates_iterator_in_state_dict(self.loader):
            self._make_resumed_iterator(state, fresh)
        g = self._generator()
        if g is not None and generator_state is not None:
            g.set_state(generator_state)

    def _make_resumed_iterator(self, state: Any, fresh: Any) -> None:
        self.loader.state_dict()  # the resumed iterator, made now (see module docstring)
        iterator = getattr(self.loader, "_iterator", None)
        if iterator is None or not loader_state.is_torchdata_state(state):
            return
        epoch = loader_state.dataset_epoch(self.loader)
        self._resumed = loader_state.ResumedPass(iterator, state, fresh, epoch)
        dataset = self.loader.dataset
        if loader_state.hf_iterable(dataset) and not getattr(self.loader, "num_workers", 0):
            loader_state.forget_start_once_begun(iterator, dataset)

    def _settled(self, state: dict) -> dict:
        """The loader's state, with the loaded one where the resumed pass has not yet
        replaced it; a new pass ends the resumed one."""
        resumed = self._resumed
        if resumed is None:
            return state
        if resumed.same_pass(self.loader):
            return resumed.settle(state)
        self._resumed = None
        dataset = getattr(self.loader, "dataset", None)
        if (
            getattr(self.loader, "persistent_workers", False)
            and loader_state.hf_iterable(dataset)
            and loader_state.dataset_epoch(self.loader) == resumed.epoch
        ):
            self._replayed_passes = True
        return state

    def _findings(self, state: Any) -> list[str]:
        """What makes resuming this loader costly or inexact (module docstring)."""
        dataset = getattr(self.loader, "dataset", None)
        kind = _type_name(dataset)
        torchdata = loader_state.is_torchdata_state(state)
        notes = []
        if (
            isinstance(dataset, torch.utils.data.IterableDataset)
            and torchdata
            and all(s is None and i is None for s, i in loader_state.dataset_states(state))
        ):
            notes.append(_replayed(self.label, kind))
        if not loader_state.hf_iterable(dataset):
            return notes
        if loader_state.buffer_shuffled(dataset):
            notes.append(_buffer_left_out(self.label, kind))
        if self._replayed_passes:
            notes.append(_persistent_restart(self.label, kind))
        if self._resumed is not None and torchdata and self._resumed.frozen(state):
            notes.append(_frozen(self.label, kind))
        return notes


def _replayed(label: str, kind: str) -> str:
    return (
        f"{label}: its dataset ({kind}) is an IterableDataset without "
        "state_dict()/load_state_dict(), so the checkpoint holds no position in it: "
        "resuming replays the epoch from its start, drawing (reading, transforming, "
        "collating) and dropping every batch the epoch had produced before training goes on "
        "(torchdata's StatefulDataLoader fast-forwards that many batches), slow for long "
        "epochs and exact only if the dataset yields the same items in the same order each "
        "time it is iterated. Give the dataset state_dict()/load_state_dict() that save and "
        "restore its position, e.g. use a Hugging Face datasets IterableDataset "
        f"(load_dataset(..., streaming=True) or Dataset.to_iterable_dataset()); see {DATASETS_PAGE}"
    )


def _buffer_left_out(label: str, kind: str) -> str:
    return (
        f"{label}: its dataset ({kind}) is shuffled through a buffer "
        "(.shuffle(buffer_size=...)); datasets' state_dict() keeps the stream's position but "
        "not the buffer's content, so a resume drops up to buffer_size examples and shuffles "
        "the rest differently: not exact. Shuffle with a buffer that is saved with the "
        f"position (unbroken.integrations.datasets.ShuffleBuffer, {DATASETS_PAGE}), or "
        "shuffle a map-style Dataset with the loader's shuffle=True"
    )


def _persistent_restart(label: str, kind: str) -> str:
    return (
        f"{label}: with persistent_workers=True its dataset ({kind}) began a new pass in the "
        "epoch it was restored in: the workers keep the restored state and datasets applies "
        "it to every pass of that epoch, so the pass began where the resume did, not at the "
        "start of the stream. Call dataset.set_epoch(epoch) with a new epoch before each "
        f"pass (the loop in {DATASETS_PAGE}), or use persistent_workers=False"
    )


def _frozen(label: str, kind: str) -> str:
    return (
        f"{label}: its dataset ({kind}) reports the position it was restored at (or the "
        "stream's start) although batches were drawn since: its state_dict() stopped "
        "advancing after the resume (datasets#8308: releases from 5.0 until its fix), so "
        "resuming this checkpoint would read the stream again from there. Upgrade datasets "
        "to a release with the fix (5.2.0 has it)"
    )


def _type_name(obj: Any) -> str:
    kind = type(obj)
    return f"{kind.__module__}.{kind.__qualname__}"


def _creates_iterator_in_state_dict(loader: Any) -> bool:
    # torchdata's StatefulDataLoader: state_dict() with no live iterator creates one from
    # the loaded state and returns it from the next iter(loader).
    return hasattr(loader, "_initial_iter_for_state_dict") and hasattr(loader, "next_iter_state")


class LoaderComponent(StatefulComponent):
    """The per-rank ``dataloader`` component: one :class:`ExactLoader` or a dict of them."""

    def __init__(self, loaders: dict[str | None, ExactLoader]) -> None:
        super().__init__("dataloader", loaders.get(None, loaders), kind="dataloader", per_rank=True)
        self.loaders = loaders

    def save_warnings(self) -> list[str]:
        """What the last capture found that makes a resume costly or inexact."""
        return [note for exact in self.loaders.values() for note in exact.notes]


def dataloader_component(dataloader: Any) -> LoaderComponent:
    """The per-rank ``dataloader`` component for one loader or a dict name -> loader."""
    named = dict(dataloader) if _is_mapping_of_loaders(dataloader) else {None: dataloader}
    adapted = {}
    for name, loader in named.items():
        label = "dataloader" if name is None else f"dataloader[{name!r}]"
        if not (
            callable(getattr(loader, "state_dict", None))
            and callable(getattr(loader, "load_state_dict", None))
        ):
            if isinstance(loader, torch.utils.data.DataLoader):
                raise TypeError(f"{label}: {PLAIN_LOADER_FIX}")
            raise TypeError(
                f"{label} must have state_dict() and load_state_dict(), got "
                f"{type(loader).__qualname__}"
            )
        adapted[name] = ExactLoader(loader, label)
    return LoaderComponent(adapted)


def _is_mapping_of_loaders(obj: Any) -> bool:
    return isinstance(obj, Mapping) and not callable(getattr(obj, "state_dict", None))
