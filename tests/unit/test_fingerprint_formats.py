"""Checkpoints record which fingerprint format they use, and every reader honours it.

New checkpoints are fingerprinted with ``mix64-v3``; ones written with ``wsum64-v1`` or
``wsum64-v2`` (a checkpoint written by 7bc53bb is kept in tests/fixtures) still restore
verified, pass ``unbroken verify`` and compare equal to a copy of the same state, and
``inspect``/``verify`` name their weaker format (issue 36, item 1). A manifest naming the wrong format (or one this version does not know) is
never restored unverified: post-restore verification (DESIGN.md: "every resume must
prove it") fails loudly, and nothing live changes.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import tamper
import unbroken as ub
from conftest import Problem, assert_same_training_state
from unbroken.format import fingerprint as fp
from unbroken.tools.comparison import diff
from unbroken.tools.inspection import inspect_checkpoint
from unbroken.tools.verification import verify_folder as audit

FIXTURES = Path(__file__).parents[1] / "fixtures"


def _trained(ckpt_dir, steps: int = 3) -> Problem:
    p = Problem()
    ckpt = p.checkpointer(ckpt_dir)
    for _ in range(steps):
        p.step()
    ckpt.save(steps)
    ckpt.close()
    return p


def _doc(ckpt_dir, step: int = 3) -> dict:
    return tamper.read(ckpt_dir / f"step_{step:08d}")


def _rewrite(ckpt_dir, edit, step: int = 3) -> None:
    tamper.edit(ckpt_dir / f"step_{step:08d}", edit)  # re-sealed: a checksum is no defence


def _live(p: Problem) -> dict:
    return {k: v.clone() for k, v in p.model.state_dict().items()}


def test_new_checkpoints_record_v3(tmp_path):
    _trained(tmp_path / "c")
    assert _doc(tmp_path / "c")["fingerprint_algorithm"] == fp.V3
    assert audit(tmp_path / "c" / "step_00000003").warnings == []
    assert inspect_checkpoint(tmp_path / "c", step=3).fingerprint_note is None


def test_a_checkpoint_of_7bc53bb_restores_verified_and_is_named_weaker(tmp_path):
    """The golden v2 checkpoint restores exactly and verified; inspect and verify say
    that its format is the older, weaker one."""
    folder = tmp_path / "old"
    shutil.copytree(FIXTURES / "v2_checkpoint", folder)
    assert _doc(folder)["fingerprint_algorithm"] == fp.V2
    fresh = Problem(seed=1, dtype=torch.float64)
    report = fresh.checkpointer(folder).restore()
    assert report.restored and report.verified and report.step == 3
    same = Problem(dtype=torch.float64)  # what the fixture's run trained
    for _ in range(3):
        same.step()
    for key, value in same.model.state_dict().items():
        assert torch.equal(fresh.model.state_dict()[key], value), key
    result = audit(folder / "step_00000003")
    assert result.ok and any("wsum64-v2" in w and "older format" in w for w in result.warnings)
    detail = inspect_checkpoint(folder, step=3)
    assert detail.fingerprint_format == fp.V2 and "even number" in detail.fingerprint_note


def test_a_v1_checkpoint_restores_verified_and_audits(tmp_path, monkeypatch):
    monkeypatch.setattr(fp, "ALGORITHM", fp.V1)
    saved = _trained(tmp_path / "v1")
    monkeypatch.undo()
    assert _doc(tmp_path / "v1")["fingerprint_algorithm"] == fp.V1
    fresh = Problem(seed=1)
    report = fresh.checkpointer(tmp_path / "v1").restore()
    assert report.restored and report.verified
    assert_same_training_state(fresh, saved)
    assert audit(tmp_path / "v1" / "step_00000003").ok

    _trained(tmp_path / "v2")  # the same state, fingerprinted with v2
    a, b = (tmp_path / name / "step_00000003" for name in ("v1", "v2"))
    assert _doc(tmp_path / "v1")["tensors"] != _doc(tmp_path / "v2")["tensors"]
    assert diff(a, b, ignore=frozenset({"rng"})).identical  # bytes compared, not prints


def test_a_manifest_naming_the_wrong_format_fails_verification(tmp_path):
    """A v2 checkpoint relabelled v1: recomputed v1 prints differ from the recorded ones,
    so the restore refuses (verification must use the recorded format, not assume one)."""
    _trained(tmp_path / "c")
    _rewrite(tmp_path / "c", lambda d: d.update(fingerprint_algorithm=fp.V1))
    fresh = Problem(seed=1)
    before = _live(fresh)
    with pytest.raises(ub.CorruptCheckpointError, match="fingerprint"):
        fresh.checkpointer(tmp_path / "c").restore()
    for key, value in _live(fresh).items():
        assert torch.equal(value, before[key]), key
    assert not audit(tmp_path / "c" / "step_00000003").ok


def test_an_unknown_format_is_refused_asking_for_an_upgrade(tmp_path):
    _trained(tmp_path / "c")
    _rewrite(tmp_path / "c", lambda d: d.update(fingerprint_algorithm="wsum64-v9"))
    fresh = Problem(seed=1)
    before = _live(fresh)
    with pytest.raises(ub.CheckpointError, match=r"wsum64-v9.*upgrade unbroken"):
        fresh.checkpointer(tmp_path / "c").restore()
    for key, value in _live(fresh).items():
        assert torch.equal(value, before[key]), key
    report = audit(tmp_path / "c" / "step_00000003")
    assert report.ok and any("wsum64-v9" in w for w in report.warnings)  # checksums only
