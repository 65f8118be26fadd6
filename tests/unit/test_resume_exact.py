"""A restore puts back the whole training state: training continues bit-exactly."""

from __future__ import annotations

import collections
import copy
import random
import warnings

import numpy as np
import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

import unbroken as ub
from conftest import Problem, assert_identical, assert_same_training_state


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


class Bookkeeping:
    """An ``extra`` whose state holds what JSON alone does not keep: an OrderedDict and
    dicts with keys out of sorted order, a defaultdict(list) with int keys that keeps
    growing after a resume, tuples, ints (one beyond 2**53) and floats (1.0, -0.0)."""

    def __init__(self) -> None:
        self.state = {
            "seen": collections.OrderedDict([("zeta", 3), ("alpha", 1)]),
            "by_phase": collections.defaultdict(list),
            "shape": (2, (3, 4.0), [5]),
            "count": 0, "total": 0.0, "ratio": 1.0, "sign": -0.0, "big": 2**60 + 1,
            "names": {7: "x", 2: "y"}, "flags": {"on": True, "level": 1},
            "scale": np.float64(0.5),
        }  # fmt: skip

    def observe(self, step: int, loss: float) -> None:
        self.state["by_phase"][step % 3].append(loss)  # a plain dict would raise KeyError
        self.state["seen"][f"step{step}"] = step
        self.state["count"] += 1
        self.state["total"] += loss

    def state_dict(self):
        return copy.deepcopy(self.state)

    def load_state_dict(self, state):
        self.state = state


def _multistep(seed: int = 0) -> Problem:
    p = Problem(seed)
    p.opt = torch.optim.AdamW(p.model.parameters(), lr=3e-2)
    # Duplicated milestones count twice (the Counter's values matter, not just its keys).
    p.sched = torch.optim.lr_scheduler.MultiStepLR(p.opt, milestones=[8, 3, 6, 6], gamma=0.5)
    return p


def _continue(p: Problem, book: Bookkeeping) -> list:
    """Steps 6..9 after the save point, then the closed form ``step(epoch)``."""
    out = []
    for step in range(6, 10):
        loss = p.step()
        book.observe(step, loss)
        out.append((loss, p.sched.get_last_lr(), [g["lr"] for g in p.opt.param_groups]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the epoch argument is deprecated
        p.sched.step(4)
    out.append(([g["lr"] for g in p.opt.param_groups], p.sched.get_last_lr()))
    return out


def test_multisteplr_and_container_state_resume_exactly(ckpt_dir):
    """A real MultiStepLR (milestones: a Counter) and an extra holding an OrderedDict, a
    defaultdict(list), tuples, ints and floats come back with identical types, key order
    and values; scheduler.step(epoch) works after the resume; losses and learning rates
    equal an uninterrupted run's bit for bit."""
    straight, book = _multistep(), Bookkeeping()
    ckpt = straight.checkpointer(ckpt_dir, extra={"book": book})
    for step in range(1, 6):
        book.observe(step, straight.step())
    ckpt.save(5)
    saved_sched, saved_book = copy.deepcopy(straight.sched.state_dict()), book.state_dict()
    expected = _continue(straight, book)

    torch.manual_seed(999)
    resumed, book2 = _multistep(seed=7), Bookkeeping()
    report = resumed.checkpointer(ckpt_dir, extra={"book": book2}).restore()
    assert report.step == 5 and report.verified
    assert type(resumed.sched.milestones) is collections.Counter
    assert list(resumed.sched.milestones.items()) == [(8, 1), (3, 1), (6, 2)]
    assert_identical(resumed.sched.state_dict(), saved_sched, "scheduler")
    assert_identical(book2.state_dict(), saved_book, "book")
    got = _continue(resumed, book2)
    assert_identical(got, expected, "losses and learning rates")
    assert_identical(book2.state_dict(), book.state_dict(), "book after the resume")
    assert_same_training_state(straight, resumed)


class IntToFloatSGD(torch.optim.SGD):
    """An SGD whose load_state_dict silently turns the int hyperparameter momentum=0 into
    0.0: equal in Python (0 == 0.0), yet not the state that was saved."""

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            group["momentum"] = float(group["momentum"])


def test_verification_catches_a_changed_scalar_type_in_non_tensor_state(ckpt_dir):
    """Post-restore verification compares non-tensor state exactly: an install that turns
    an int hyperparameter into a float is a StateMismatchError naming where."""
    model = torch.nn.Linear(2, 2)
    opt = IntToFloatSGD(model.parameters(), lr=0.1, momentum=0)
    ub.Checkpointer(ckpt_dir, model=model, optimizer=opt).save(1)
    fresh = torch.nn.Linear(2, 2)
    fresh_ckpt = ub.Checkpointer(
        ckpt_dir, model=fresh, optimizer=IntToFloatSGD(fresh.parameters(), lr=0.1, momentum=0)
    )
    with pytest.raises(ub.StateMismatchError, match=r"optimizer/param_groups/0/momentum"):
        fresh_ckpt.restore()
