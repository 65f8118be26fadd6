"""The gap between restore() and the first optimizer step (issue 36, item 2).

Bug class: DESIGN.md F4's family (the values trained on are not the ones restored). A
restore verified when it ended says nothing about what the loop does next: an init in a
framework hook that runs after the restore, a pretrained load or a re-wrap after
``restore()`` trains on from values that were never restored, with the restored
optimizer, step and data position, and nothing failed. Now the first optimizer step
after a restore checks the parameters and the optimizer state against what was
installed, once per resume.
"""

from __future__ import annotations

import pytest
import torch

import unbroken as ub


def _make():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train_step(model, opt) -> None:
    model(torch.randn(8, 4)).square().mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    model, opt = _make()
    _train_step(model, opt)
    ub.Checkpointer(tmp_path / "run", model=model, optimizer=opt).save(1)
    return tmp_path / "run"


def test_a_correct_resume_steps_on(saved):
    """Forward passes in training mode change BatchNorm's running statistics before the
    first step: buffers are not checked. Several steps go through."""
    model, opt = _make()
    ckpt = ub.Checkpointer(saved, model=model, optimizer=opt)
    assert ckpt.restore().step == 1
    for _ in range(3):
        _train_step(model, opt)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda m, o: torch.nn.init.zeros_(m[0].weight), "model/0.weight"),
        (lambda m, o: m.load_state_dict(_make()[0].state_dict()), "model/0.bias"),
        (lambda m, o: o.state[m[0].weight]["exp_avg"].zero_(), "exp_avg"),
    ],
    ids=["re-initialized weight", "pretrained load", "optimizer moments cleared"],
)
def test_a_change_after_restore_fails_the_first_step_naming_it(saved, change, named):
    """Weights re-initialized, a 'pretrained' state loaded, or moments cleared between
    restore() and the first step: that step raises StateMismatchError naming the tensor
    and the likely cause, before the optimizer changes anything; the check runs once."""
    model, opt = _make()
    ckpt = ub.Checkpointer(saved, model=model, optimizer=opt)
    ckpt.restore()
    with torch.no_grad():
        change(model, opt)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(8, 4)).square().mean().backward()
    with pytest.raises(ub.StateMismatchError, match="after restore\\(\\) and before the first"):
        try:
            opt.step()
        except ub.StateMismatchError as exc:
            assert named in str(exc) and "framework hook" in str(exc)
            raise
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    opt.step()  # once per resume: the next step goes on
    ckpt.close()


def test_a_fresh_start_and_a_closed_checkpointer_check_nothing(tmp_path, saved):
    """Without a restored checkpoint there is nothing to compare; after close() the hook
    is gone."""
    model, opt = _make()
    ub.Checkpointer(tmp_path / "fresh", model=model, optimizer=opt).restore()
    torch.nn.init.zeros_(model[0].weight)
    _train_step(model, opt)
    model, opt = _make()
    ckpt = ub.Checkpointer(saved, model=model, optimizer=opt)
    ckpt.restore()
    ckpt.close()
    torch.nn.init.zeros_(model[0].weight)
    _train_step(model, opt)
