"""``dataloader``: the data position, restored so that the next batches *and* every random
draw after them are the ones an uninterrupted run makes.

Two things outside a loader's own ``state_dict()`` break that with torchdata's
``StatefulDataLoader`` (checked against torchdata 0.11):

- creating the iterator draws a base seed from the loader's ``generator`` or, without one,
  from the global torch RNG. A resumed run creates it after ``restore()`` put the RNGs
  back, so every later dropout mask shifts by one draw. We create the resumed iterator
  inside ``restore()``, before the ``rng`` component is put back; the loader hands that
  iterator to the training loop's next ``iter(loader)``.
- a loader's ``generator`` shuffles every epoch, but its state is not in ``state_dict()``:
  the next epoch after a resume was shuffled differently. We save and restore it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .state import StatefulComponent

GENERATOR_KEY = "unbroken:generator"

PLAIN_LOADER_FIX = (
    "a torch.utils.data.DataLoader has no state_dict(): its position cannot be saved, so "
    "a resumed run would start the epoch over. Use torchdata's StatefulDataLoader (pip "
    "install torchdata; `from torchdata.stateful_dataloader import StatefulDataLoader`, "
    "same arguments), or, for a DistributedSampler loop, pass a small object holding the "
    "epoch and the batches consumed (see 'A DistributedSampler loop' in docs/pitfalls.md)"
)


class ExactLoader:
    """A ``Stateful`` view of one data loader that also keeps what its state_dict misses."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def _generator(self) -> torch.Generator | None:
        g = getattr(self.loader, "generator", None)
        return g if isinstance(g, torch.Generator) else None

    def state_dict(self) -> Any:
        state = self.loader.state_dict()
        g = self._generator()
        if g is not None and isinstance(state, dict):
            if GENERATOR_KEY in state:
                raise ValueError(f"the data loader's state_dict() uses the key {GENERATOR_KEY!r}")
            state = {**state, GENERATOR_KEY: g.get_state()}
        return state

    def load_state_dict(self, state: Any) -> None:
        generator_state = None
        if isinstance(state, dict) and GENERATOR_KEY in state:
            state = dict(state)
            generator_state = state.pop(GENERATOR_KEY)
        self.loader.load_state_dict(state)
        if _creates_iterator_in_state_dict(self.loader):
            self.loader.state_dict()  # the resumed iterator, made now (see module docstring)
        g = self._generator()
        if g is not None and generator_state is not None:
            g.set_state(generator_state)


def _creates_iterator_in_state_dict(loader: Any) -> bool:
    # torchdata's StatefulDataLoader: state_dict() with no live iterator creates one from
    # the loaded state and returns it from the next iter(loader).
    return hasattr(loader, "_initial_iter_for_state_dict") and hasattr(loader, "next_iter_state")


def dataloader_component(dataloader: Any) -> StatefulComponent:
    """The per-rank ``dataloader`` component for one loader or a dict name -> loader."""
    named = dict(dataloader) if _is_mapping_of_loaders(dataloader) else {None: dataloader}
    for name, loader in named.items():
        label = "dataloader" if name is None else f"dataloader[{name!r}]"
        if not (callable(getattr(loader, "state_dict", None))
                and callable(getattr(loader, "load_state_dict", None))):  # fmt: skip
            if isinstance(loader, torch.utils.data.DataLoader):
                raise TypeError(f"{label}: {PLAIN_LOADER_FIX}")
            raise TypeError(
                f"{label} must have state_dict() and load_state_dict(), got "
                f"{type(loader).__qualname__}"
            )
    adapted = {k: ExactLoader(v) for k, v in named.items()}
    obj = adapted.get(None, adapted)
    return StatefulComponent("dataloader", obj, kind="dataloader", per_rank=True)


def _is_mapping_of_loaders(obj: Any) -> bool:
    return isinstance(obj, Mapping) and not callable(getattr(obj, "state_dict", None))
