"""Bad input gets a clear error naming the FQN, file or argument, and what to do."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import unbroken as ub
from conftest import Problem


def test_shape_mismatch_names_fqn_and_both_shapes(ckpt_dir):
    p = Problem()
    p.step()
    ub.Checkpointer(ckpt_dir, model=p.model).save(1)
    other = nn.Module()
    other.inp, other.drop, other.out = nn.Linear(4, 9), nn.Dropout(), nn.Linear(9, 1)
    other.register_buffer("seen", torch.zeros((), dtype=torch.int64))
    with pytest.raises(
        ub.StateMismatchError, match=r"model/inp.weight: saved shape \(8, 4\), live shape \(9, 4\)"
    ):
        ub.Checkpointer(ckpt_dir, model=other).restore()


def test_checkpoint_fqn_missing_from_live_model(ckpt_dir):
    p = Problem()
    ub.Checkpointer(ckpt_dir, model=p.model).save(1)
    smaller = nn.Module()
    smaller.inp, smaller.out = nn.Linear(4, 8), nn.Linear(8, 1)
    smaller.register_buffer("seen", torch.zeros((), dtype=torch.int64))
    smaller.extra = nn.Linear(1, 1)
    with pytest.raises(ub.IncompleteCheckpointError, match=r"extra\.weight"):
        ub.Checkpointer(ckpt_dir, model=smaller).restore()
    del smaller.extra
    smaller.out = nn.Identity()
    with pytest.raises(ub.StateMismatchError, match=r"out\.weight"):
        ub.Checkpointer(ckpt_dir, model=smaller).restore()


def test_path_that_is_a_file(tmp_path):
    f = tmp_path / "model.pt"
    f.write_bytes(b"x")
    with pytest.raises(ub.CheckpointError, match="is a file"):
        ub.Checkpointer(f, model=nn.Linear(1, 1))


def test_folder_of_another_tool(tmp_path):
    (tmp_path / ".metadata").write_bytes(b"pickle")
    (tmp_path / "__0_0.distcp").write_bytes(b"data")
    with pytest.raises(ub.CheckpointError, match="unbroken import"):
        ub.Checkpointer(tmp_path, model=nn.Linear(1, 1)).restore()


def test_unknown_step(ckpt_dir):
    p = Problem()
    p.checkpointer(ckpt_dir).save(4)
    with pytest.raises(ub.CheckpointError, match=r"step 7 is not a committed checkpoint.*\[4\]"):
        p.checkpointer(ckpt_dir).restore(step=7)


def test_unknown_reset_name(ckpt_dir):
    with pytest.raises(ValueError, match="optimiser"):
        Problem().checkpointer(ckpt_dir).restore(reset={"optimiser"})


@pytest.mark.parametrize("step", [-1, 1.5, True])
def test_bad_step(ckpt_dir, step):
    with pytest.raises(ValueError, match="step must be an int"):
        Problem().checkpointer(ckpt_dir).save(step)


def test_optimizer_param_outside_model(ckpt_dir):
    p = Problem()
    stray = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([*p.model.parameters(), stray], lr=0.1)
    with pytest.raises(ub.CheckpointError, match="not a parameter of the model"):
        ub.Checkpointer(ckpt_dir, model=p.model, optimizer=opt).save(1)


def test_bad_extra_names():
    with pytest.raises(ValueError, match="extra key 'model'"):
        ub.Checkpointer("x", model=nn.Linear(1, 1), extra={"model": nn.Linear(1, 1)})
    with pytest.raises(TypeError, match="state_dict"):
        ub.Checkpointer("x", model=nn.Linear(1, 1), extra={"thing": object()})


def test_errors_share_one_root_and_builtin_bases():
    assert issubclass(ub.IncompleteCheckpointError, ub.CheckpointError)
    assert issubclass(ub.CorruptCheckpointError, OSError)
    assert issubclass(ub.StateMismatchError, ValueError)
    assert str(ub.IncompleteCheckpointError("plain message")) == "plain message"


def test_public_api_is_sorted_and_complete():
    assert ub.__all__ == sorted(ub.__all__)
    for name in ub.__all__:
        assert hasattr(ub, name)
