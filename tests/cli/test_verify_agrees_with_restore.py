"""`unbroken verify` and `restore()` judge a folder alike (issue 12, item 8).

Restore refused symbolic links (a shard, the manifest, the step folder) while verify
followed them and passed; and restore read tensor bytes whatever byte order the
manifest said they were in. Both now apply the same rules.
"""

from __future__ import annotations

import shutil

import pytest

import tamper
import unbroken as ub
from conftest import Problem

from .conftest import run_cli, run_json


def _link_shard(step, outside):
    shard = step / "rank_00000.bin"
    shutil.copy(shard, outside / shard.name)
    shard.unlink()
    shard.symlink_to(outside / shard.name)
    return shard.name


def _link_manifest(step, outside):
    shutil.copy(step / "manifest.json", outside / "manifest.json")
    (step / "manifest.json").unlink()
    (step / "manifest.json").symlink_to(outside / "manifest.json")
    return "manifest.json"


def _link_folder(step, outside):
    shutil.copytree(step, outside / step.name)
    shutil.rmtree(step)
    step.symlink_to(outside / step.name)
    return step.name


@pytest.mark.parametrize(
    "link", [_link_shard, _link_manifest, _link_folder], ids=["shard", "manifest", "step-folder"]
)
def test_symbolic_links_fail_verify_as_they_fail_restore(run, tmp_path, link):
    """A shard, the manifest or the step folder replaced by a symbolic link to an
    identical copy outside: restore refuses it and verify fails naming it."""
    outside = tmp_path / "outside"
    outside.mkdir()
    name = link(run / "step_00000004", outside)
    with pytest.raises(ub.CorruptCheckpointError, match="symbolic link"):
        Problem().checkpointer(run).restore(step=4)
    result = run_cli("verify", run, "--step", 4)
    assert result.exit_code == 1, result.stdout
    assert "symbolic link" in result.stdout and name in result.stdout
    assert run_cli("verify", run, "--step", 2).exit_code == 0


def test_restore_refuses_a_foreign_byte_order(run):
    """A manifest saying its tensors are big-endian (written on a big-endian machine):
    restore refuses with a clear error naming both byte orders; verify fails too."""
    folder = run / "step_00000004"
    tamper.edit(folder, lambda doc: doc.update(byteorder="big"))
    with pytest.raises(ub.CheckpointError, match=r"big-endian.*little-endian"):
        Problem().checkpointer(run).restore(step=4)
    info = run_json("verify", run, "--step", 4, code=1)
    assert any("big-endian" in f["message"] for f in info["checkpoints"][0]["failures"])
