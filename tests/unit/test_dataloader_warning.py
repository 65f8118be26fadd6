"""A loader whose dataset has no position to save is named at save (issue 30, item 7).

torchdata's ``StatefulDataLoader`` resumes an ``IterableDataset`` without
``state_dict()`` by replaying the epoch's batches from a fresh iterator (torchdata 0.11,
``stateful_dataloader.py``: "naively fast-forwarding"): slow, and exact only for a dataset
that repeats itself. Failure caught: that cost (or an inexact resume) showing up only at
the resume, with nothing at save time to say so. A map-style dataset is not named: the
loader saves its sampler's position and skips indices, never rows.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

import unbroken as ub
from unbroken.format import manifest


class Counting(torch.utils.data.IterableDataset):
    """An iterable dataset without state: the loader can only replay it."""

    def __iter__(self):
        return iter(range(64))


class Positioned(Counting):
    """The same, with its position in ``state_dict()``."""

    def __init__(self) -> None:
        self.start = self.position = 0

    def __iter__(self):
        self.position = self.start
        while self.position < 64:
            self.position += 1
            yield self.position - 1

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.start = state["position"]


def _saved_twice(folder, dataloader):
    """Draw 3 batches from each loader, save at steps 3 and 6; the Checkpointer."""
    ckpt = ub.Checkpointer(folder, model=nn.Linear(1, 1), dataloader=dataloader)
    loaders = dataloader.values() if isinstance(dataloader, dict) else [dataloader]
    iterators = [iter(loader) for loader in loaders]
    for step in (3, 6):
        for it in iterators:
            for _ in range(3):
                next(it)
        ckpt.save(step)
    return ckpt


def _replay_notes(warnings):
    return [w for w in warnings if "replays the epoch" in w]


@pytest.mark.parametrize("workers", [0, 1], ids=["in-process", "one-worker"])
def test_an_iterable_dataset_without_state_is_named_once(tmp_path, caplog, workers):
    """Two saves: one warning in ``ckpt.warnings`` naming the component, the dataset's
    type, the replay and the fix; logged once; in each manifest; in the restore report."""
    caplog.set_level(logging.WARNING, logger="unbroken")
    loader = StatefulDataLoader(Counting(), batch_size=4, num_workers=workers)
    ckpt = _saved_twice(tmp_path / "run", loader)
    (note,) = _replay_notes(ckpt.warnings)
    assert note.startswith("dataloader: ")
    assert f"{__name__}.Counting" in note
    assert "without state_dict()/load_state_dict()" in note
    assert "torchdata's StatefulDataLoader fast-forwards" in note
    assert "docs/integrations/datasets.md" in note
    logged = [r for r in caplog.records if "replays the epoch" in r.getMessage()]
    assert len(logged) == 1, [r.getMessage() for r in logged]
    for step in (3, 6):
        saved = manifest.read(tmp_path / "run" / f"step_{step:08d}")["save_warnings"]
        assert _replay_notes(saved) == [note]
    ckpt.close()
    again = ub.Checkpointer(
        tmp_path / "run",
        model=nn.Linear(1, 1),
        dataloader=StatefulDataLoader(Counting(), batch_size=4, num_workers=workers),
    )
    report = again.restore()
    assert any(note in w for w in report.warnings)
    again.close()


def test_a_dict_of_loaders_names_the_key(tmp_path):
    """Only the loader without a position is named, by its key."""
    loaders = {
        "replayed": StatefulDataLoader(Counting(), batch_size=4),
        "positioned": StatefulDataLoader(Positioned(), batch_size=4),
    }
    ckpt = _saved_twice(tmp_path / "run", loaders)
    (note,) = _replay_notes(ckpt.warnings)
    assert note.startswith("dataloader['replayed']: ")
    ckpt.close()


@pytest.mark.parametrize(
    "make",
    [
        lambda: StatefulDataLoader(Positioned(), batch_size=4),
        lambda: StatefulDataLoader(Positioned(), batch_size=4, num_workers=1),
        lambda: StatefulDataLoader(list(range(64)), batch_size=4, shuffle=True),
        lambda: StatefulDataLoader(list(range(64)), batch_size=4, shuffle=True, num_workers=1),
    ],
    ids=["stateful-iterable", "stateful-iterable-worker", "map-style", "map-style-worker"],
)
def test_loaders_that_resume_cheaply_are_not_named(tmp_path, make):
    """A dataset that saves its position, and a map-style dataset (the sampler's position
    is saved; indices are skipped, rows are not read): no warning."""
    ckpt = _saved_twice(tmp_path / "run", make())
    assert ckpt.warnings == []
    ckpt.close()
