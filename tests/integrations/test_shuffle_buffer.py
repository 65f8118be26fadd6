"""``unbroken.integrations.datasets.ShuffleBuffer`` resumes a buffer-shuffled stream
exactly (issue 36, item 12 b: docs/integrations/datasets.md made every user copy it; it
is importable now, and the page imports it).

The property the page promises: a state taken in the middle of a pass (the stream's
position, the buffer's rows, the random stream) and loaded into a fresh buffer over a
fresh stream gives the same continuation, row for row, in that pass and the next epoch's;
through a torchdata ``StatefulDataLoader`` too, batch for batch.
"""

from __future__ import annotations

import json

import pytest
import torch

from .recipes import recipes

datasets = pytest.importorskip("datasets")  # the [datasets] extra; installed in dev
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

from unbroken.integrations.datasets import ShuffleBuffer  # noqa: E402

ROWS = 100


def _stream():
    table = datasets.Dataset.from_dict({"x": list(range(ROWS))})
    return table.to_iterable_dataset(num_shards=4)


def _json(state: dict) -> dict:
    """As the checkpoint keeps it: JSON in the manifest."""
    return json.loads(json.dumps(state))


def _ids(rows) -> torch.Tensor:
    return torch.tensor([row["x"] for row in rows])


@pytest.mark.parametrize("taken", [1, 7, 40, 95])
def test_a_state_taken_mid_pass_continues_the_same(taken):
    """The rows after the state, and the next epoch's pass, equal the uninterrupted
    buffer's (torch.equal), whether the buffer was filling (1, 7) or full (40, 95)."""
    straight = ShuffleBuffer(_stream(), buffer_size=16, seed=3)
    rows = iter(straight)
    head = [next(rows) for _ in range(taken)]
    state = _json(straight.state_dict())
    tail = list(rows)
    straight.set_epoch(1)
    following = list(straight)

    resumed = ShuffleBuffer(_stream(), buffer_size=16, seed=3)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state  # restored, not iterated yet: the same state
    again = list(resumed)
    resumed.set_epoch(1)
    assert torch.equal(_ids(again), _ids(tail))
    assert torch.equal(_ids(list(resumed)), _ids(following))
    assert sorted(_ids(head + tail).tolist()) == list(range(ROWS))  # every row, once
    assert _ids(head + tail).tolist() != list(range(ROWS))  # shuffled
    assert _ids(following).tolist() != _ids(head + tail).tolist()  # another order per epoch


def test_a_loader_over_it_resumes_batch_for_batch():
    """The documented use: a StatefulDataLoader's state taken after 5 batches, loaded
    into a fresh loader over a fresh buffer, draws the same batches after it."""
    loader = StatefulDataLoader(ShuffleBuffer(_stream(), buffer_size=16, seed=0), batch_size=8)
    batches = iter(loader)
    for _ in range(5):
        next(batches)
    state = _json(loader.state_dict())
    tail = [batch["x"] for batch in batches]

    again = StatefulDataLoader(ShuffleBuffer(_stream(), buffer_size=16, seed=0), batch_size=8)
    again.load_state_dict(state)
    resumed = [batch["x"] for batch in again]
    assert len(resumed) == len(tail) == 8
    assert all(torch.equal(a, b) for a, b in zip(resumed, tail, strict=True))


def test_a_state_saved_before_any_pass_starts_fresh():
    data = ShuffleBuffer(_stream(), buffer_size=16, seed=0)
    state = _json(data.state_dict())
    fresh = ShuffleBuffer(_stream(), buffer_size=16, seed=0)
    fresh.load_state_dict(state)
    assert torch.equal(_ids(list(fresh)), _ids(list(ShuffleBuffer(_stream(), 16, seed=0))))


@pytest.mark.parametrize("size", [0, -1, 2.5, True])
def test_a_bad_buffer_size_is_refused(size):
    with pytest.raises(ValueError, match="buffer_size must be an int >= 1"):
        ShuffleBuffer(_stream(), buffer_size=size, seed=0)


def test_the_page_imports_it_instead_of_copying_it():
    """The stream recipe imports the class; no page defines its own."""
    code = recipes("datasets.md")["stream"]
    assert "from unbroken.integrations.datasets import ShuffleBuffer" in code
    assert "class ShuffleBuffer" not in code
