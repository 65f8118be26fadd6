"""Megatron's model-parallel RNG tracker as the ``megatron_rng`` component
(``unbroken.integrations._megatron_state.RNGTrackerState``): its generator states are
saved and put back as they were, so dropout in Megatron's attention draws the same masks
after a resume. A stand-in tracker (Megatron's real one needs CUDA) with the same
``get_states``/``set_states`` contract; no process group, no Megatron."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import unbroken as ub
from unbroken.integrations._megatron_state import RNGTrackerState


class _Tracker:
    """What Megatron 0.16's ``CudaRNGStatesTracker`` does with its states."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.states_ = {"model-parallel-rng": g.get_state()}

    def get_states(self) -> dict:
        return dict(self.states_)

    def set_states(self, states: dict) -> None:
        self.states_ = states


def test_the_tracker_states_come_back_as_saved(tmp_path):
    tracker = _Tracker(seed=5)
    saved = tracker.get_states()["model-parallel-rng"].clone()
    ckpt = ub.Checkpointer(
        tmp_path, model=nn.Linear(2, 2), extra={"megatron_rng": RNGTrackerState(lambda: tracker)}
    )
    ckpt.save(1)
    ckpt.close()
    tracker.states_ = _Tracker(seed=6).get_states()
    report = ub.Checkpointer(
        tmp_path, model=nn.Linear(2, 2), extra={"megatron_rng": RNGTrackerState(lambda: tracker)}
    ).restore()
    assert report.components["megatron_rng"] == "restored"
    state = tracker.get_states()["model-parallel-rng"]
    assert state.dtype == torch.uint8 and torch.equal(state, saved)


def test_a_tracker_without_tensor_states_is_refused():
    tracker = _Tracker(seed=5)
    tracker.states_ = {"model-parallel-rng": torch.Generator()}  # a graph-safe tracker
    with pytest.raises(TypeError, match="'model-parallel-rng' as a Generator"):
        RNGTrackerState(lambda: tracker).state_dict()
