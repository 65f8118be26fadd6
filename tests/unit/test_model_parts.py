"""Models given as dicts, parts without state, and tensors that cannot be saved (issue 10.5)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import unbroken as ub


def test_dict_names_whose_fqns_collide_are_refused(tmp_path):
    """{"a": m1, "a.0": m2}: m1's ``0.weight`` and m2's ``weight`` both join to
    ``a.0.weight``, so optimizer state (keyed by joined FQN) would mix; refused at
    construction naming both dict keys and the FQN."""
    torch.manual_seed(0)
    m1, m2 = nn.Sequential(nn.Linear(2, 2)), nn.Linear(2, 2)
    opt = torch.optim.SGD([*m1.parameters(), *m2.parameters()], lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match=r"model\['a'\].*model\['a\.0'\].*'a\.0\.weight'"):
        ub.Checkpointer(tmp_path / "c", model={"a": m1, "a.0": m2}, optimizer=opt)
    assert not (tmp_path / "c").exists()
    # dotted keys are fine while the joined names stay distinct
    ckpt = ub.Checkpointer(tmp_path / "d", model={"a": m1, "a.1": m2}, optimizer=opt)
    ckpt.save(1)
    assert ckpt.restore().components["optimizer"] == "restored"


@pytest.mark.parametrize("as_dict", [True, False], ids=["dict-part", "whole-model"])
def test_model_part_without_state_is_simply_empty(tmp_path, as_dict):
    """nn.Identity (no parameters, no buffers) as a dict part or as the whole model saves
    and restores as empty state, not 'default process group not initialized'."""
    torch.manual_seed(0)
    net = nn.Linear(3, 2)
    model = {"net": net, "act": nn.Identity()} if as_dict else nn.Identity()
    ckpt = ub.Checkpointer(tmp_path / "c", model=model)
    ckpt.save(1)
    want = {k: v.clone() for k, v in net.state_dict().items()}
    with torch.no_grad():
        net.weight.zero_()
    report = ckpt.restore()
    assert report.verified and report.components["model"] == "restored"
    if as_dict:
        for k, v in net.state_dict().items():
            assert torch.equal(v, want[k]), k


def test_sparse_buffer_is_refused_naming_it(tmp_path):
    """A sparse buffer fails the save with an error naming its key (not DCP's
    'unsupported memory format'), before anything is written."""
    model = nn.Linear(2, 2)
    indices = torch.tensor([[0, 2]])
    model.register_buffer(
        "mask", torch.sparse_coo_tensor(indices, [1.0, 2.0], (4,), check_invariants=True)
    )
    ckpt = ub.Checkpointer(tmp_path / "c", model=model)
    with pytest.raises(ub.CheckpointError, match=r"'model/mask' is sparse_coo.*dense"):
        ckpt.save(1)
    assert ckpt.steps() == []
