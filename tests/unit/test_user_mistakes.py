"""The mistakes users make are loud (issue 11): each would otherwise end in a silent fresh
start, a mixed run or a swallowed interrupt (DESIGN.md F3: nothing starts fresh silently)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import unbroken as ub
from conftest import Problem
from unbroken.format import shards


def test_ctrl_c_during_save_propagates_unchanged(ckpt_dir, monkeypatch):
    """Ctrl-C during save(): the KeyboardInterrupt reaches the caller as itself (a loop
    catching CheckpointError must not swallow it), the partial save is cleaned up, the
    last committed checkpoint is untouched, and the next save works."""
    p = Problem()
    ckpt = p.checkpointer(ckpt_dir)
    ckpt.save(1)

    def interrupted(self, plan, planner):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(shards.ShardWriter, "write_data", interrupted)
        with pytest.raises(KeyboardInterrupt):
            try:
                ckpt.save(2)
            except ub.CheckpointError:  # the disk-full pattern of our docs
                pytest.fail("the interrupt became a CheckpointError")
    assert ckpt.steps() == [1]
    assert not [e for e in ckpt_dir.iterdir() if e.name.startswith(".partial")]
    ckpt.save(2)
    assert ckpt.steps() == [1, 2]


@pytest.mark.parametrize(
    "step",
    [np.int64(3), np.int32(3), torch.tensor(3), torch.tensor(3, dtype=torch.int32)],
    ids=["np.int64", "np.int32", "tensor-int64", "tensor-int32"],
)
def test_step_accepts_numpy_and_0d_integer_tensors(ckpt_dir, step):
    """save(step) and track(step) take the integer types training loops hold."""
    p = Problem()
    ckpt = p.checkpointer(ckpt_dir)
    ckpt.track(step, loss=1.0)
    ckpt.save(step)
    assert ckpt.steps() == [3]
    assert isinstance(ckpt.steps()[0], int)


@pytest.mark.parametrize("step", [3.0, torch.tensor(3.0), torch.tensor([3]), True, -1], ids=str)
def test_step_refuses_what_is_not_a_step(ckpt_dir, step):
    """A float, a vector, a bool or a negative number is not a step: a clear ValueError."""
    with pytest.raises(ValueError, match="step must be"):
        Problem().checkpointer(ckpt_dir).save(step)
