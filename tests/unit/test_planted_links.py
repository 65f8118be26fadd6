"""A symbolic link planted where a run folder keeps a file of its own (``DIR/.lock``,
``DIR/.run-lock``, ``DIR/metrics.jsonl``) is never opened through: the file it points at
stays byte for byte as it was, and a ``CheckpointError`` names the link and says to
remove it."""

from __future__ import annotations

import os
import re

import pytest

from conftest import Problem
from unbroken import CheckpointError
from unbroken.storage import posix

OUTSIDE = b"precious bytes that are not the run's\n"


def _plant(tmp_path, name):
    """``tmp_path/run/<name>`` -> a file outside the run folder; returns (run, outside)."""
    run = tmp_path / "run"
    run.mkdir()
    outside = tmp_path / "outside.txt"
    outside.write_bytes(OUTSIDE)
    os.symlink(outside, run / name)
    return run, outside


def _trained() -> Problem:
    p = Problem()
    p.step()
    return p


def test_save_lock_link_is_refused(tmp_path):
    """Failure guarded: save() opened ``DIR/.lock`` through a planted link and truncated
    and overwrote the file it points at with "pid N on host"."""
    run, outside = _plant(tmp_path, ".lock")
    p = _trained()
    ck = p.checkpointer(run)
    with pytest.raises(CheckpointError, match=r"\.lock.*symbolic link.*remove the link"):
        ck.save(1)
    ck.close()
    assert outside.read_bytes() == OUTSIDE
    assert os.path.islink(run / ".lock")
    assert not any(n.startswith("step_") for n in os.listdir(run))  # nothing committed


def _track_save_close(run, name, caplog):
    """track() and close() refuse the link; save() commits its checkpoint and warns
    (a save that raised must have committed nothing)."""
    p = _trained()
    ck = p.checkpointer(run)
    refused = rf"{re.escape(name)}.*symbolic link.*remove the link"
    with pytest.raises(CheckpointError, match=refused):
        ck.track(1, loss=1.0)
    ck.save(1)
    assert ck.steps() == [1]
    assert any(name in r.getMessage() and "symbolic link" in r.getMessage() for r in caplog.records)
    with pytest.raises(CheckpointError, match=refused):
        ck.close()  # the tracked step still waits: close() writes it, and refuses
    ck.close()


def test_run_lock_link_is_refused(tmp_path, caplog):
    """Failure guarded: the run lock (``DIR/.run-lock``) was opened through a planted
    link, its target truncated and overwritten by the run's holder line."""
    run, outside = _plant(tmp_path, ".run-lock")
    _track_save_close(run, ".run-lock", caplog)
    assert outside.read_bytes() == OUTSIDE
    assert os.path.islink(run / ".run-lock")


def test_run_lock_holder_is_not_read_through_a_link(tmp_path):
    """Failure guarded: messages naming who holds the run lock read the file a planted
    ``.run-lock`` link points at (and printed its bytes)."""
    run, outside = _plant(tmp_path, ".run-lock")
    lock = posix.RunLock(run, run / ".run-lock")
    assert lock.holder() == "unknown"
    with pytest.raises(CheckpointError, match=r"\.run-lock"):
        lock.hold()
    assert posix.saving_now(run / ".run-lock")  # a link is never opened: cannot be told
    assert outside.read_bytes() == OUTSIDE


def test_metrics_link_is_refused(tmp_path, caplog):
    """Failure guarded: tracked metrics were appended through a link planted at
    ``DIR/metrics.jsonl`` to the file it points at."""
    run, outside = _plant(tmp_path, "metrics.jsonl")
    _track_save_close(run, "metrics.jsonl", caplog)
    assert outside.read_bytes() == OUTSIDE
    assert os.path.islink(run / "metrics.jsonl")


def test_manifest_write_refuses_a_link(tmp_path):
    """Failure guarded: the commit record's write (``write_synced``) followed a link at
    its path, overwriting the file it points at."""
    run, outside = _plant(tmp_path, "manifest.json")
    with pytest.raises(CheckpointError, match=r"manifest\.json.*symbolic link"):
        posix.write_synced(run / "manifest.json", b"{}", "fix")
    assert outside.read_bytes() == OUTSIDE
