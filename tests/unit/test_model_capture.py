"""The model's state as captured for a save: ``module.state_dict()`` where torch's model
state-dict API would return exactly that (a faster path), torch's API wherever a wrapper
renames anything.

Bug class F3 (a wrapping change orphans state): whichever path is taken, the captured
keys are the normalized FQNs, the same for a model and its compiled or checkpoint-wrapped
self, and the values are the live tensors.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from unbroken.live import torch_compat
from unbroken.live.state import ModelComponent


class Tied(nn.Module):
    """Tied weights, both kinds of buffer, extra state and a nested container."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)) for _ in range(2)
        )
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("seen", torch.zeros(3))
        self.register_buffer("scratch", torch.ones(2), persistent=False)
        self.norm = nn.BatchNorm1d(4)
        self.count = 7

    def get_extra_state(self) -> dict:
        return {"count": self.count}

    def set_extra_state(self, state: dict) -> None:
        self.count = state["count"]


class Renaming(nn.Module):
    """A module that tells torch's API to drop a name from FQNs (``_fqn_modifiers``)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(3, 3)

    def _fqn_modifiers(self) -> dict[str, str]:
        return {"inner": ""}


def _torch_api(module: nn.Module) -> dict:
    return dict(get_model_state_dict(module, options=StateDictOptions(strict=False)))


def _same(captured: dict, expected: dict) -> None:
    assert list(captured) == list(expected)  # same keys, same order
    for key, value in expected.items():
        got = captured[key]
        if isinstance(value, torch.Tensor):
            assert got.data_ptr() == value.data_ptr() and got.dtype == value.dtype, key
            assert got.shape == value.shape and torch.equal(got, value), key
        else:
            assert got == value, key


def test_an_unwrapped_model_is_captured_as_torch_would():
    model = Tied()
    assert torch_compat.is_unwrapped(model)
    captured = ModelComponent(model).capture()
    _same(captured, _torch_api(model))
    assert "scratch" not in captured and captured["_extra_state"] == {"count": 7}
    assert captured["head.weight"].data_ptr() == captured["embed.weight"].data_ptr()


def test_a_dict_of_unwrapped_models_is_captured_per_model():
    parts = {"encoder": Tied(), "decoder": nn.Linear(4, 2)}
    captured = ModelComponent(parts).capture()
    assert list(captured) == ["encoder", "decoder"]
    for name, module in parts.items():
        _same(captured[name], _torch_api(module))


def test_wrapped_models_go_through_torch_and_keep_their_fqns():
    """compile, activation checkpointing and _fqn_modifiers rename: torch's API is used,
    and the keys are the plain model's."""
    plain = Tied()
    plain_keys = list(_torch_api(plain))
    compiled = torch.compile(plain)
    wrapped = Tied()
    wrapped.blocks[0] = checkpoint_wrapper(wrapped.blocks[0])
    for model in (compiled, wrapped):
        assert not torch_compat.is_unwrapped(model)
        captured = ModelComponent(model).capture()
        _same(captured, _torch_api(model))
        assert list(captured) == plain_keys
    renaming = Renaming()
    assert not torch_compat.is_unwrapped(renaming)
    _same(ModelComponent(renaming).capture(), _torch_api(renaming))
