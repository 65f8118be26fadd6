"""Nested state splits into JSON and tensors and comes back with the same types."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from unbroken.format import tree


def test_round_trip_keeps_types_and_values():
    value = {
        "a": 1, "b": 2.5, "c": None, "d": True, "e": "s", "f": (1, (2.0, "x")),
        "g": [torch.arange(3), {"h": torch.ones(2, dtype=torch.bfloat16)}],
        3: "int key", "nan": float("nan"), "inf": float("-inf"), "dt": torch.float16,
        "np": np.arange(4, dtype=np.uint32), "npf": np.float32(1.5),
    }  # fmt: skip
    tensors: dict = {}
    skeleton = tree.encode(value, "comp", tensors)
    skeleton = json.loads(json.dumps(skeleton, allow_nan=False))
    assert sorted(tensors) == ["comp/g/0", "comp/g/1/h"]
    assert tree.tensor_keys(skeleton) == ["comp/g/0", "comp/g/1/h"]
    back = tree.decode(skeleton, tensors)
    assert back["f"] == (1, (2.0, "x")) and isinstance(back["f"], tuple)
    assert back[3] == "int key" and back["dt"] is torch.float16
    assert np.isnan(back["nan"]) and back["inf"] == float("-inf")
    assert back["np"].dtype == np.uint32 and back["np"].tolist() == [0, 1, 2, 3]
    assert type(back["npf"]) is np.float32
    assert back["g"][0] is tensors["comp/g/0"]


def test_slashes_in_keys_are_escaped():
    tensors: dict = {}
    tree.encode({"a/b": torch.zeros(1), "a%2Fb": torch.ones(1)}, "x", tensors)
    assert sorted(tensors) == ["x/a%252Fb", "x/a%2Fb"]


def test_unsupported_values_are_named_by_path():
    with pytest.raises(TypeError, match="comp/list/1"):
        tree.encode({"list": [1, object()]}, "comp", {})
