"""A restore puts back the whole training state: training continues bit-exactly."""

from __future__ import annotations

import random

import numpy as np
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from conftest import Problem, assert_same_training_state


class Counter:
    """An ``extra`` component: a stateful object with a tensor and plain values."""

    def __init__(self) -> None:
        self.calls = 0
        self.history = torch.zeros(3)

    def state_dict(self):
        return {"calls": self.calls, "history": self.history.clone(), "tag": ("a", 1.5)}

    def load_state_dict(self, state):
        self.calls = state["calls"]
        self.history = state["history"]
        assert state["tag"] == ("a", 1.5)


def _loader():
    data = torch.arange(120, dtype=torch.float32).reshape(60, 2)
    return StatefulDataLoader(
        data, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(1)
    )


def test_training_continues_identically_after_restore(ckpt_dir):
    """Model, AdamW moments and step, scheduler, dataloader position, RNGs and extras."""
    straight = Problem()
    loader, counter = _loader(), Counter()
    ckpt = straight.checkpointer(ckpt_dir, dataloader=loader, extra={"counter": counter})
    assert not ckpt.restore().restored
    batches = iter(loader)
    for _ in range(5):
        straight.step()
        next(batches)
        counter.calls += 1
    ckpt.save(5)
    expected = [
        (straight.step(), next(batches).tolist(), random.random(), np.random.rand())
        for _ in range(4)
    ]
    # A different process would start from scratch: new objects, different seeds.
    torch.manual_seed(999), random.seed(999), np.random.seed(999)
    resumed = Problem(seed=7)
    loader2, counter2 = _loader(), Counter()
    report = resumed.checkpointer(
        ckpt_dir, dataloader=loader2, extra={"counter": counter2}
    ).restore()
    assert report.restored and report.step == 5 and report.verified
    assert set(report.components.values()) == {"restored"}
    assert counter2.calls == 5
    batches2 = iter(loader2)
    got = [
        (resumed.step(), next(batches2).tolist(), random.random(), np.random.rand())
        for _ in range(4)
    ]
    assert got == expected
    assert_same_training_state(straight, resumed)


def test_learnable_problem_really_learns():
    """Guard for the resume tests: a flat loss would hide a reset optimizer."""
    p = Problem()
    losses = [p.step() for _ in range(60)]
    assert sum(losses[-10:]) < 0.5 * sum(losses[:10])


def test_fresh_start_when_no_checkpoint(ckpt_dir, problem):
    report = problem.checkpointer(ckpt_dir).restore()
    assert (report.step, report.restored, report.path) == (0, False, None)
    assert report.components["model"] == "absent"
    assert "fresh start" in str(report)


def test_restore_a_given_step_and_listing(ckpt_dir, problem):
    ckpt = problem.checkpointer(ckpt_dir, keep_last=None)
    weights = {}
    for step in (1, 2, 3):
        problem.step()
        ckpt.save(step)
        weights[step] = problem.model.inp.weight.detach().clone()
    assert ckpt.steps() == [1, 2, 3] and ckpt.latest_step() == 3
    fresh = Problem(seed=5)
    report = fresh.checkpointer(ckpt_dir).restore(step=2)
    assert report.step == 2
    assert torch.equal(fresh.model.inp.weight, weights[2])
    assert str(report).startswith("restored step 2")
