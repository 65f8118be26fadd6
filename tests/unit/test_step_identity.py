"""A step folder's name and its manifest agree, and a lost manifest is named (issue 10.6)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import unbroken as ub
from conftest import Problem, restore_skipping, save_steps


def _step(ckpt_dir, step):
    return ckpt_dir / f"step_{step:08d}"


def test_swapped_step_folders_are_damage_and_restore_falls_back(ckpt_dir):
    """step_00000002 holding step 1's checkpoint (folders swapped): a
    CorruptCheckpointError naming the folder and both steps; restore() skips it with a
    warning and restores an older sound step instead of calling step 1 'step 2'."""
    states = save_steps(ckpt_dir, (1, 2, 3))
    os.rename(_step(ckpt_dir, 2), ckpt_dir / "aside")
    shutil.copytree(_step(ckpt_dir, 1), _step(ckpt_dir, 2))  # step 1's checkpoint as "2"
    os.rename(_step(ckpt_dir, 3), _step(ckpt_dir, 4))  # and step 3's as "4"
    with pytest.raises(ub.CorruptCheckpointError, match=r"step_00000002.*step 2.*step 1"):
        Problem().checkpointer(ckpt_dir).restore(step=2)
    fresh, report = restore_skipping(ckpt_dir, [4, 2], to=1)
    assert "step_00000004" in report.warnings[0] and "step 3" in report.warnings[0]
    saved = states[1].model.state_dict()
    for k, v in fresh.model.state_dict().items():
        assert torch.equal(v, saved[k]), k


def test_a_step_whose_manifest_vanished_is_named_by_restore(ckpt_dir):
    """step_00000002/manifest.json deleted: restore() falls back to step 1 (as before) but
    its report warns naming the damaged folder, instead of the step vanishing silently;
    restore(step=2) says it is damaged, not that it never existed."""
    save_steps(ckpt_dir)
    (_step(ckpt_dir, 2) / "manifest.json").unlink()
    report = Problem(seed=1).checkpointer(ckpt_dir).restore()
    assert report.step == 1
    lost = [w for w in report.warnings if "step_00000002" in w]
    assert len(lost) == 1 and "no manifest.json" in lost[0] and "damaged" in lost[0]
    with pytest.raises(ub.CorruptCheckpointError, match=r"step_00000002.*damaged"):
        Problem(seed=1).checkpointer(ckpt_dir).restore(step=2)


def test_the_only_checkpoint_losing_its_manifest_is_not_a_silent_fresh_start(ckpt_dir):
    """Every manifest gone: restore() starts fresh (nothing is loadable), but the report
    names each damaged folder rather than looking like a first run."""
    save_steps(ckpt_dir)
    for step in (1, 2):
        (_step(ckpt_dir, step) / "manifest.json").unlink()
    report = Problem(seed=1).checkpointer(ckpt_dir).restore()
    assert not report.restored and report.step == 0
    assert [("step_00000001" in w, "step_00000002" in w) for w in report.warnings] == [
        (True, False),
        (False, True),
    ]
