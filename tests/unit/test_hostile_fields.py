"""Hostile manifest fields that passed the schema (issue 29, item 9).

A manifest re-sealed with a valid checksum after an edit (``tests/tamper.py``) is
untrusted input. Before this, a tensor's ``device`` of ``meta`` (or ``cuda`` on a machine
without one) reached tensor allocation and raised a raw ``RuntimeError`` ("Cannot access
accelerator device"), skipping the fallback to an older step; ``meta`` on a tensor with a
live counterpart, ``format_version: -1``, a chunk ``length`` of ``128.0`` and lineage
fields of the wrong type were accepted as sound. Each is now damage named by its field:
``restore()`` falls back to the older step with a warning naming it, ``restore(step=2)``
raises ``CorruptCheckpointError`` naming it, ``unbroken verify`` fails naming it.
"""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

import tamper
import unbroken as ub
from conftest import Problem, assert_same_training_state, save_steps

RNG = "rng/rank_00000/torch"
EXP_AVG = "optimizer/state/inp.weight/exp_avg"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Steps 1 and 2, and the training state at each."""
    root = tmp_path_factory.mktemp("hostile-fields") / "run"
    return root, save_steps(root)


def _chunk(key: str, **change):
    return lambda d: d["tensors"][key]["chunks"][0].update(change)


HOSTILE = [
    (
        "meta-without-live-counterpart",
        lambda d: d["tensors"][RNG].update(device="meta"),
        f"{RNG}/device",
    ),
    (
        "meta-with-live-counterpart",
        lambda d: d["tensors"][EXP_AVG].update(device="meta"),
        f"{EXP_AVG}/device",
    ),
    (
        "meta-model",
        lambda d: d["tensors"]["model/inp.bias"].update(device="meta"),
        "model/inp.bias/device",
    ),
    ("device-index", lambda d: d["tensors"][RNG].update(device="cuda:99"), f"{RNG}/device"),
    ("unknown-device", lambda d: d["tensors"][RNG].update(device="warp9"), f"{RNG}/device"),
    ("format-version-negative", lambda d: d.update(format_version=-1), "format_version"),
    ("format-version-zero", lambda d: d.update(format_version=0), "format_version"),
    ("length-float", _chunk(EXP_AVG, length=128.0), f"{EXP_AVG}/chunks/0/length"),
    ("length-bool", _chunk("model/out.bias", length=True), "model/out.bias/chunks/0"),
    ("lineage-run", lambda d: d["lineage"][0].update(run=5), "lineage/0/run"),
    ("lineage-skipped", lambda d: d["lineage"][0].update(skipped="model"), "lineage/0/skipped"),
]


def _hostile(saved, tmp_path, edit) -> ub.Checkpointer:
    root, _ = saved
    return tamper.edited_copy(root, tmp_path / "run", edit)


@pytest.mark.parametrize(("edit", "field"), [c[1:] for c in HOSTILE], ids=[c[0] for c in HOSTILE])
def test_hostile_field_is_damage_named_and_restore_falls_back(saved, tmp_path, edit, field):
    """Each hostile field sealed into the newest checkpoint: restore() resumes step 1
    exactly with a warning naming the field; restore(step=2) raises CorruptCheckpointError
    naming it, every live object untouched; `unbroken verify` fails naming it. (Before:
    a raw RuntimeError from tensor allocation, or step 2 restored as if sound.)"""
    work = _hostile(saved, tmp_path, edit)
    live = Problem(seed=3)
    report = live.checkpointer(work).restore()
    assert report.step == 1 and report.verified
    assert any("step 2" in w and field in w for w in report.warnings), report.warnings
    assert_same_training_state(live, saved[1][1])
    other = Problem(seed=3)
    before = {k: v.clone() for k, v in other.model.state_dict().items()}
    with pytest.raises(ub.CorruptCheckpointError, match=field):
        other.checkpointer(work).restore(step=2)
    for k, v in other.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    from unbroken.cli import app

    result = CliRunner().invoke(app, ["verify", str(work)], catch_exceptions=False)
    assert result.exit_code == 1, result.stdout + result.stderr
    assert field in result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.skipif(torch.accelerator.is_available(), reason="a machine without an accelerator")
def test_a_device_tensor_without_live_counterpart_goes_to_the_host_here(saved, tmp_path):
    """A saved ``cuda`` tensor with no live counterpart (the RNG state, edited) on a machine
    with no accelerator is loaded into host memory, not on a device the file names (before:
    RuntimeError "Cannot access accelerator device when none is available")."""
    work = _hostile(saved, tmp_path, lambda d: d["tensors"][RNG].update(device="cuda"))
    live = Problem(seed=3)
    report = live.checkpointer(work).restore()
    assert report.step == 2 and report.verified and not report.warnings
    assert_same_training_state(live, saved[1][2])
