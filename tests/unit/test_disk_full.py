"""A full disk at any write of a save: a save either commits and returns, or raises a
``CheckpointError`` naming the path and the free space and commits nothing.

ENOSPC is injected by patching the calls that write (``open`` for writing, ``os.open``
creating, ``os.mkdir``, ``os.rename``, ``os.fsync``, the atomic exchange) under the run
folder.
"""

from __future__ import annotations

import builtins
import errno
import logging
import os
import re
from pathlib import Path

import pytest

import unbroken as ub
from conftest import Problem, assert_same_training_state
from unbroken.format.series import FILE as METRICS
from unbroken.format.series import read_series
from unbroken.storage import local_medium

FULL = OSError(errno.ENOSPC, "No space left on device")


def _under(root: Path, path) -> bool:
    try:
        return Path(os.fspath(path)).resolve().is_relative_to(root.resolve())
    except (TypeError, ValueError, OSError):
        return False


def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


class DiskFull:
    """Raise ENOSPC at the ``at``-th write under ``root`` (1-based), or where ``match``
    (a regex on the path) says; counts the writes either way."""

    def __init__(self, monkeypatch, root: Path, *, at: int = 0, match: str = "") -> None:
        self.root, self.at, self.match, self.count, self.hit = root, at, match, 0, ""
        real_open, real_os_open, real_fsync = builtins.open, os.open, os.fsync
        real_mkdir, real_rename = os.mkdir, os.rename
        exchanges = local_medium.posix  # the atomic exchange of a re-save

        def fail(path) -> None:
            if not _under(root, path):
                return
            self.count += 1
            if (self.at and self.count == self.at) or (
                self.match and re.search(self.match, str(path))
            ):
                self.hit = str(path)
                raise FULL

        def opener(file, mode="r", *args, **kwargs):
            if isinstance(file, str | os.PathLike) and any(c in mode for c in "wax+"):
                fail(file)
            return real_open(file, mode, *args, **kwargs)

        def os_opener(path, flags, *args, **kwargs):
            if flags & os.O_CREAT:
                fail(path)
            return real_os_open(path, flags, *args, **kwargs)

        def fsync(fd):
            fail(_fd_path(fd if isinstance(fd, int) else fd.fileno()))
            return real_fsync(fd)

        def mkdir(path, *args, **kwargs):
            fail(path)
            return real_mkdir(path, *args, **kwargs)

        def rename(src, dst, *args, **kwargs):
            fail(src)
            return real_rename(src, dst, *args, **kwargs)

        def exchange(a, b, real=exchanges.exchange if exchanges else None):
            fail(a)
            return real(a, b)

        monkeypatch.setattr(builtins, "open", opener)
        monkeypatch.setattr(os, "open", os_opener)
        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "mkdir", mkdir)
        monkeypatch.setattr(os, "rename", rename)
        if exchanges is not None:
            monkeypatch.setattr(exchanges, "exchange", exchange)


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_enospc_writing_the_manifest_is_an_error_naming_it_and_commits_nothing(
    ckpt_dir, monkeypatch
):
    """Case: the disk fills up while manifest.json is written: CheckpointError naming
    manifest.json and the free space (not a bare OSError); nothing committed, no partial
    folder left; the next save works."""
    p = Problem()
    ckpt = p.checkpointer(ckpt_dir, keep_last=None)
    ckpt.save(1)
    p.step()
    full = DiskFull(monkeypatch, ckpt_dir, match=r"manifest\.json")
    with pytest.raises(ub.CheckpointError, match="disk is full") as caught:
        ckpt.save(2)
    assert "manifest.json" in full.hit and full.hit in str(caught.value)
    assert re.search(r"\(\d+(\.\d)? [KMGT]?i?B free there\)", str(caught.value)), caught.value
    monkeypatch.undo()
    assert ckpt.steps() == [1]
    assert not [x for x in ckpt_dir.iterdir() if x.name.startswith(".partial-")]
    ckpt.save(2)
    assert ckpt.steps() == [1, 2]
    ckpt.close()


def test_enospc_syncing_metrics_after_the_commit_warns_and_save_returns(
    ckpt_dir, monkeypatch, caplog
):
    """Case: the disk fills up when metrics.jsonl is synced at save(), after the commit:
    save() returns (the step is committed, as a save that raised must not be) and a
    warning names metrics.jsonl and the free space; the tracked steps are written once
    there is room; close() while the disk is still full raises a CheckpointError naming
    metrics.jsonl."""
    p = Problem()
    ckpt = p.checkpointer(ckpt_dir, keep_last=None)
    ckpt.track(1, loss=1.0)
    ckpt.save(1)
    ckpt.track(2, loss=2.0)
    DiskFull(monkeypatch, ckpt_dir, match=METRICS)
    with caplog.at_level(logging.WARNING, logger="unbroken"):
        assert ckpt.save(2).endswith("step_00000002")
    assert ckpt.steps() == [1, 2]
    warned = [r.getMessage() for r in caplog.records if METRICS in r.getMessage()]
    assert warned and "disk is full" in warned[0] and "free there" in warned[0], warned
    ckpt.track(3, loss=3.0)
    with pytest.raises(ub.CheckpointError, match=rf"{METRICS}.*disk is full"):
        ckpt.close()
    monkeypatch.undo()

    q = Problem()
    again = q.checkpointer(ckpt_dir, keep_last=None)
    assert again.restore().step == 2
    again.track(3, loss=3.0)
    again.close()
    assert read_series(ckpt_dir).steps("loss") == [1, 2, 3]


@pytest.mark.parametrize("resave", [False, True], ids=["new-step", "re-save"])
def test_a_save_commits_and_returns_or_raises_and_commits_nothing_whatever_write_fails(
    tmp_path, monkeypatch, resave
):
    """Case: ENOSPC at each write of a save in turn (the save lock, the partial folder,
    the shard file, the manifest, the commit's renames and fsyncs, retention, the
    metrics), for a new step and for a re-save of an existing one: every save either
    returns with its step committed and loadable exactly, or raises a CheckpointError
    naming a path and the free space with the folder's checkpoints byte-identical."""
    at = 0
    while True:
        at += 1
        root = tmp_path / f"at{at}" / "ckpts"
        p = Problem()
        ckpt = p.checkpointer(root, keep_last=1 if not resave else None)
        ckpt.track(1, loss=1.0)
        ckpt.save(1)
        p.step()
        ckpt.track(2, loss=2.0)
        step = 1 if resave else 2
        before = _tree(root)
        full = DiskFull(monkeypatch, root, at=at)
        try:
            ckpt.save(step)
        except ub.CheckpointError as exc:
            monkeypatch.undo()
            assert full.hit, f"write {at}: {exc}"
            assert str(root) in str(exc) and "free there" in str(exc), f"write {at}: {exc}"
            after = _tree(root)
            assert {k: v for k, v in after.items() if k != "metrics.jsonl"} == {
                k: v for k, v in before.items() if k != "metrics.jsonl"
            }, f"write {at} ({full.hit}): the folder changed"
            ckpt.close()
            continue
        finally:
            monkeypatch.undo()
        ckpt.close()
        q = Problem(seed=3)
        assert q.checkpointer(root).restore().step == step, f"write {at}"
        assert_same_training_state(q, p)
        if not full.hit:  # the save made fewer writes than ``at``: every one was tried
            break
    assert at > 8  # lock, partial, shard, its fsync, manifest, its fsync, commit, fsync...
