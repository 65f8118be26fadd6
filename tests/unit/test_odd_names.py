"""A folder (or store prefix) whose name only looks like a step's is ignored, and named
once: other scripts' digits (``step_`` + Arabic-Indic ``٠٠٠٠٠٠٠٥``), a trailing newline
(``"step_00000005\\n"``) or extra leading zeros (``step_000000005``) once listed a step
whose folder ``step_00000005`` is not there, and every restore of a sound run failed
with "pruned or replaced 100 times while being read"."""

from __future__ import annotations

import logging
import os
import shutil
import uuid

import fsspec
import pytest

from conftest import Problem, assert_same_training_state
from unbroken.storage import names
from unbroken.storage.names import REPLACED, RETIRED, aside_step, aside_target, step_of

ODD = [
    "step_" + "\u0660" * 7 + "\u0665",  # Arabic-Indic digits: \d matched them
    "step_00000005\n",  # $ matched before a final newline
    "step_000000005",  # another spelling of step 5: its folder is step_00000005
    "step_\uff10\uff10\uff10\uff10\uff10\uff10\uff10\uff15",  # fullwidth digits
]


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(names, "_warned", set(), raising=False)


def _warned_about(caplog, name: str) -> int:
    return sum(ascii(name) in r.getMessage() for r in caplog.records)


def _saved(path) -> Problem:
    p = Problem()
    p.step()
    p.checkpointer(path).save(1)
    return p


def _restores_step_1_and_warns_once(run, a: Problem, caplog, odd: str) -> None:
    """``run`` lists step 1 only, before and after a restore of it, which is verified and
    exact (``a``'s state); the odd name is warned about once."""
    caplog.set_level(logging.WARNING, logger="unbroken")
    b = Problem(seed=3)
    ck = b.checkpointer(run)
    assert ck.steps() == [1]
    report = ck.restore()
    assert report.restored and report.step == 1 and report.verified
    assert_same_training_state(a, b)
    assert ck.steps() == [1]
    assert _warned_about(caplog, odd) == 1


@pytest.mark.parametrize("odd", ODD, ids=["arabic-indic", "newline", "zeros", "fullwidth"])
def test_odd_step_names_are_not_steps(odd):
    """Failure guarded: ``^step_(\\d{8,})$`` read these names as step 5 (or 1)."""
    assert step_of(odd) is None
    assert aside_step(f"{RETIRED}{odd}-0123456789ab", RETIRED) is None
    assert aside_target(f"{REPLACED}{odd}-0123456789ab", REPLACED) is None
    assert step_of("step_00000005") == 5 and step_of("step_123456789") == 123456789
    assert aside_target(f"{REPLACED}step_00000005-0123456789ab", REPLACED) == "step_00000005"


def test_odd_aside_names_are_not_ours():
    """Failure guarded: a set-aside name with anything after its id (a newline) was read
    as the old copy of a step, and renamed back into the run."""
    assert aside_target(f"{REPLACED}step_00000005-0123456789ab\n", REPLACED) is None
    assert aside_step(f"{RETIRED}step_00000005-\u0660\n", RETIRED) is None


@pytest.mark.parametrize("odd", ODD[:3], ids=["arabic-indic", "newline", "zeros"])
def test_local_restore_ignores_an_odd_step_folder(tmp_path, caplog, odd):
    """Failure guarded: a copy of a committed step under an odd name made restore() fail
    ("pruned or replaced 100 times while being read"); it is ignored, warned about once
    per process however often the folder is listed."""
    run = tmp_path / "run"
    a = _saved(run)
    shutil.copytree(run / "step_00000001", run / odd)
    _restores_step_1_and_warns_once(run, a, caplog, odd)
    assert odd in os.listdir(run)  # ignored, never touched


def test_local_odd_replaced_copy_is_not_put_back(tmp_path, caplog):
    """Failure guarded: a ``.replaced-`` folder of an odd step name was put back (renamed)
    as that odd name by the next save's clean-up, listing a step that is not there."""
    run = tmp_path / "run"
    _saved(run)
    aside = f"{REPLACED}step_00000005\n-0123456789ab"
    shutil.copytree(run / "step_00000001", run / aside)
    p = Problem(seed=1)
    ck = p.checkpointer(run)
    assert ck.restore().step == 1
    p.step()
    ck.save(2)
    assert "step_00000005\n" not in os.listdir(run)
    assert ck.steps() == [1, 2]
    assert Problem(seed=3).checkpointer(run).restore().step == 2


@pytest.mark.parametrize("odd", ODD[:3], ids=["arabic-indic", "newline", "zeros"])
def test_store_restore_ignores_an_odd_step_prefix(caplog, odd):
    """Failure guarded: on an object store too, objects under an odd step prefix listed
    a step whose prefix is not there, and restore() failed."""
    url = f"memory://unbroken-tests/{uuid.uuid4().hex[:8]}/run"
    a = _saved(url)
    fs, root = fsspec.core.url_to_fs(url)
    for key in fs.find(f"{root}/step_00000001"):
        fs.pipe(key.replace("step_00000001", odd, 1), fs.cat(key))
    _restores_step_1_and_warns_once(url, a, caplog, odd)
