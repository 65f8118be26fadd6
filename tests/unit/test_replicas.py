"""Rank 0's judgment of the plain tensors every rank holds (issue 36, item 13): which hold
more than one value, and a refusal that names each with the ranks holding each value."""

from __future__ import annotations

import pytest

from unbroken.core import replicas
from unbroken.errors import CheckpointError

# Four ranks' values: "a" equal everywhere; "b" two values (ranks 0, 2 and 1, 3); "c" held
# by two ranks only, equal there; "d" three values.
HELD = [
    {"model/a": 1, "model/b": 5, "model/d": 7},
    {"model/a": 1, "model/b": 6, "model/c": 3, "model/d": 8},
    {"model/a": 1, "model/b": 5, "model/d": 9},
    {"model/a": 1, "model/b": 6, "model/c": 3, "model/d": 9},
]


def test_only_tensors_whose_holders_disagree_are_found_with_the_ranks_grouped():
    """A tensor equal on all its holders (every rank, or some ranks: pipeline stages) is
    never named; one that differs comes with its holders grouped by value."""
    assert replicas.differing(HELD) == {"model/b": [[0, 2], [1, 3]], "model/d": [[0], [1], [2, 3]]}
    assert replicas.differing([{"model/a": 1}, {"model/a": 1}]) == {}
    replicas.refuse_differing(4, [{"model/a": 1}, {"model/a": 1}])  # nothing to refuse


def test_the_refusal_names_each_tensor_its_ranks_and_what_to_do():
    """Before the fix a save of such tensors was committed (each written from one rank)."""
    with pytest.raises(CheckpointError) as caught:
        replicas.refuse_differing(12, HELD)
    message = str(caught.value)
    assert message.startswith("step 12 was not saved: 2 plain (non-DTensor) tensor(s)")
    assert "model/b (ranks 0, 2 hold one value, ranks 1, 3 another)" in message
    assert "model/d (3 different values: rank 0 / rank 1 / ranks 2, 3)" in message
    assert "model/a" not in message and "model/c" not in message
    assert "broadcast_buffers=True" in message and "distribute_tensor" in message


def test_a_long_list_is_cut_after_ten():
    held = [{f"model/t{i:02d}": r for i in range(13)} for r in range(2)]
    with pytest.raises(CheckpointError, match=r"model/t09 \(.*\); and 3 more\. Nothing"):
        replicas.refuse_differing(1, held)
