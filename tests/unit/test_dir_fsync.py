"""Power loss on a file system without ordered journalling: every folder entry a save
creates is fsynced in its parent before the commit relies on it.
"""

from __future__ import annotations

import os

import torch

import unbroken as ub
from unbroken.storage import local_medium


def test_a_save_into_a_new_run_folder_fsyncs_every_new_entry(tmp_path, monkeypatch):
    """Guards: the partial folder (its files' entries) and a new run folder's entry in
    its parent were never fsynced, so a power loss could lose a committed checkpoint or
    the whole run folder on such a file system."""
    synced: list[str] = []
    real = local_medium.fsync_dir

    def spy(path):
        synced.append(os.fspath(path))
        real(path)

    monkeypatch.setattr(local_medium, "fsync_dir", spy)
    run = tmp_path / "new" / "run"
    ckpt = ub.Checkpointer(run, model=torch.nn.Linear(4, 4))
    ckpt.save(3)
    ckpt.close()
    assert str(tmp_path) in synced  # the entry of new/
    assert str(tmp_path / "new") in synced  # the entry of run/
    partial = [i for i, p in enumerate(synced) if os.path.basename(p).startswith(".partial-")]
    assert partial, synced  # the partial folder: its files' entries
    assert str(run) in synced[partial[0] + 1 :]  # then the commit's rename
    assert ckpt.steps() == [3]
