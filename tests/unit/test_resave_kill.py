"""A job killed while it re-saves a committed step (between setting the old copy aside
and committing the new one) loses nothing: until a restore puts the old copy back, every
reader lists the step and reads that copy; the next ``restore()`` puts it back, restores
it verified, and leaves the folder healed. On S3 (moto on 127.0.0.1) and
on a local disk whose file system cannot exchange two folders atomically.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch

import unbroken as ub
from unbroken.storage.locate import checkpoint_dir

SRC = str(Path(ub.__file__).resolve().parents[1])

# Saves step 5, changes the weights, re-saves step 5 and dies (os._exit, no clean-up)
# once the old copy is aside and before the new one is committed.
SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch
    import unbroken as ub
    from unbroken.storage import local_medium, posix, store_medium

    url, where = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    ckpt = ub.Checkpointer(url, model=model)
    ckpt.restore()
    ckpt.save(5)
    with torch.no_grad():
        model.weight.add_(1)
    if where == "store":
        store_medium.StoreMedium._put_manifest = lambda *a: os._exit(9)
    else:
        posix.exchange = lambda a, b: False  # the old copy waits aside (.replaced-*)
        rename = os.rename

        def dying(src, dst):
            if ".partial-" in str(src) and str(dst).endswith("step_00000005"):
                os._exit(9)
            rename(src, dst)

        local_medium.os.rename = dying
    ckpt.save(5)
    sys.exit(3)  # not killed: the test's hook missed
    """
)


@pytest.fixture(scope="module")
def server(s3_server):
    return s3_server


def _killed_resave(url: str, where: str) -> None:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", SCRIPT, url, where], env=env, timeout=120,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 9, done.stderr[-3000:]


def _restores_the_old_copy(url: str) -> None:
    torch.manual_seed(0)
    saved = torch.nn.Linear(8, 8)  # the weights of the first save of step 5
    torch.manual_seed(1)
    model = torch.nn.Linear(8, 8)
    report = ub.Checkpointer(url, model=model).restore()
    assert report.step == 5 and report.restored and report.verified, report
    assert torch.equal(model.weight, saved.weight) and torch.equal(model.bias, saved.bias)
    ckdir = checkpoint_dir(url)
    assert ckdir.steps() == [5]
    assert not [n for n in ckdir.listdir() if n.startswith(".replaced-")], ckdir.listdir()


def _listed_before_any_restore(url: str) -> None:
    """Issue 36, item 16 (a): before any restore puts the old copy back, every reader
    lists step 5 and reads that copy, and none of them changes the folder."""
    torch.manual_seed(0)
    saved = torch.nn.Linear(8, 8)
    ckdir = checkpoint_dir(url)
    before = ckdir.listdir()
    assert ckdir.steps() == [5]
    ckpt = ub.Checkpointer(url, model=torch.nn.Linear(8, 8))
    assert ckpt.steps() == [5] and ckpt.latest_step() == 5
    run = ub.inspect_checkpoint(url)
    assert [(c.step, c.error) for c in run.checkpoints] == [(5, None)], run
    detail = ub.inspect_checkpoint(url, step=5)
    assert detail.step == 5
    checked = ub.verify_checkpoint(url)
    assert checked.ok and [c.step for c in checked.checkpoints] == [5], checked
    weight = next(t for t in detail.tensors if t.key == "model/weight")
    assert weight.shape == list(saved.weight.shape)
    assert ckdir.listdir() == before  # read-only: nothing was put back by a reader


def test_kill_during_a_re_save_on_s3_keeps_the_step(server):
    """Guards: a kill between moving the old copy of a step aside and committing the new
    one on a store left the step unlisted; the relaunch's restore() started fresh."""
    with server.environment():
        url = f"s3://ckpts/{uuid.uuid4().hex[:8]}/run"
        _killed_resave(url, "store")
        _listed_before_any_restore(url)
        _restores_the_old_copy(url)


def test_kill_during_a_re_save_on_disk_keeps_the_step(tmp_path):
    """Guards the same kill on a local disk without RENAME_EXCHANGE: the restore puts
    the .replaced-* copy back."""
    url = str(tmp_path / "run")
    _killed_resave(url, "disk")
    assert [n for n in os.listdir(url) if n.startswith(".replaced-")]
    _listed_before_any_restore(url)
    _restores_the_old_copy(url)


def test_a_restore_putting_back_during_a_live_re_save_does_not_fail_it(monkeypatch):
    """Guards the put-back against breaking a re-save still running: a restore that finds
    the step unlisted mid-commit puts the old copy back (create-only); the re-save sets it
    aside again and commits its new copy."""
    from unbroken.storage import store_medium

    url = f"memory://ub-resave/{uuid.uuid4().hex[:8]}/run"
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    ckpt = ub.Checkpointer(url, model=model)
    ckpt.restore()
    ckpt.save(5)
    with torch.no_grad():
        model.weight.add_(1)
    real, reader = store_medium.StoreMedium._put_manifest, []

    def racing(self, final, step, data):
        if not reader:  # a reader's restore() runs between the move aside and the commit
            reader.append(checkpoint_dir(url).clean_leftovers_if_idle())
            assert checkpoint_dir(url).steps() == [5]  # the old copy is back
        return real(self, final, step, data)

    monkeypatch.setattr(store_medium.StoreMedium, "_put_manifest", racing)
    ckpt.save(5)
    monkeypatch.setattr(store_medium.StoreMedium, "_put_manifest", real)
    torch.manual_seed(1)
    fresh = torch.nn.Linear(8, 8)
    assert ub.Checkpointer(url, model=fresh).restore().step == 5
    assert torch.equal(fresh.weight, model.weight)  # the new copy
    assert not [n for n in checkpoint_dir(url).listdir() if n.startswith(".")]
