"""Checkpoints on an object store, through fsspec's in-process ``memory://`` file system.

Fast unit tests of the remote back-end's commit protocol (storage/store_medium.py): the
manifest is written last and only a step with a manifest is listed; a save that fails
before its manifest leaves nothing listed and removes its own objects; two saves of
one step cannot both commit; retention unlists (manifest first) before deleting; damage
is detected on read. The same protocol against a real S3 API: test_object_store_s3.py.
"""

from __future__ import annotations

import subprocess
import sys
import uuid

import fsspec
import pytest
import torch

import unbroken as ub
from conftest import Problem, assert_same_training_state
from unbroken.storage import store_io, store_medium
from unbroken.storage.locate import checkpoint_dir


@pytest.fixture
def url() -> str:
    return f"memory://unbroken-tests/{uuid.uuid4().hex[:8]}/run"


def _objects(url: str) -> list[str]:
    fs, root = fsspec.core.url_to_fs(url)
    return sorted(p[len(root) + 1 :] for p in fs.find(root))


def _trained(seed: int = 0, steps: int = 2) -> Problem:
    p = Problem(seed=seed)
    for _ in range(steps):
        p.step()
    return p


def test_save_restore_is_bit_exact(url):
    """Guarantee: a restore from a store is bit-for-bit the saved state, verified."""
    a = _trained()
    a.checkpointer(url).save(2)
    rng = torch.get_rng_state()
    b = Problem(seed=5)
    report = b.checkpointer(url).restore()
    assert report.restored and report.step == 2 and report.verified
    assert report.path.endswith("step_00000002")
    assert_same_training_state(a, b)
    assert torch.equal(torch.get_rng_state(), rng)  # the data order goes on identically


def test_layout_manifest_and_save_named_shard(url):
    """Guarantee: a committed step holds its manifest and shard objects named for the
    save that wrote them (two saves of one step never write the same object)."""
    _trained().checkpointer(url).save(2)
    names = _objects(url)
    assert names[0] == "step_00000002/manifest.json"
    assert len(names) == 2 and store_medium.shard_save_id(names[1].split("/")[1]) is not None


def test_failed_commit_lists_nothing_and_removes_its_objects(url, monkeypatch):
    """Guarantee: a save that fails after every shard is uploaded but before its manifest
    is written commits nothing, leaves the earlier checkpoint, and deletes its uploads."""
    p = _trained()
    ckpt = p.checkpointer(url)
    ckpt.save(1)
    before = _objects(url)

    def refuse(self, final, step, data):
        raise ub.CheckpointError("injected: the manifest write failed")

    monkeypatch.setattr(store_medium.StoreMedium, "_put_manifest", refuse)
    with pytest.raises(ub.CheckpointError, match="injected"):
        ckpt.save(2)
    assert ckpt.steps() == [1]
    assert _objects(url) == before


def test_upload_without_manifest_is_never_listed_and_cleaned_when_stale(url, monkeypatch):
    """Guarantee: objects of a save that died before its manifest (here written by hand)
    are never listed; a later save removes them once older than the stale limit, and
    keeps them while they may still belong to a save in progress."""
    _trained().checkpointer(url).save(1)
    fs, root = fsspec.core.url_to_fs(url)
    fs.pipe_file(f"{root}/step_00000002/rank_00000-0123456789ab.bin", b"x" * 100)
    fs.pipe_file(f"{root}/step_00000001/rank_00000-ba9876543210.bin", b"y")  # a loser's
    ckdir = checkpoint_dir(url)
    assert ckdir.steps() == [1] and ckdir.steps_without_manifest() == []
    assert ckdir.clean_leftovers() == []  # young: maybe a save still uploading
    monkeypatch.setenv(store_medium.STALE_ENV, "0")
    removed = ckdir.clean_leftovers()
    assert sorted(removed) == [
        "step_00000001/rank_00000-ba9876543210.bin",
        "step_00000002/rank_00000-0123456789ab.bin",
    ]
    assert ckdir.steps() == [1]
    b = Problem(seed=3)
    assert b.checkpointer(url).restore().step == 1  # the committed step is untouched


def test_two_saves_of_one_step_cannot_both_commit(url, monkeypatch):
    """Guarantee: of two jobs saving the same step into one prefix, exactly one commits
    (conditional manifest write); the other fails naming the step, removes its own
    objects, and the committed checkpoint is the winner's, intact."""
    winner, loser = _trained(seed=0), _trained(seed=1)
    ckpt_w = winner.checkpointer(url)
    ckpt_w.save(1)
    ckpt_l = loser.checkpointer(url)
    ckpt_l.restore(reset={"model", "optimizer", "scheduler", "rng"})  # takes the prefix over
    real = store_medium.StoreMedium._put_manifest

    def race(self, final, step, data):  # the winner commits step 2 first
        monkeypatch.setattr(store_medium.StoreMedium, "_put_manifest", real)
        winner.step()
        ckpt_w.save(2)
        return real(self, final, step, data)

    monkeypatch.setattr(store_medium.StoreMedium, "_put_manifest", race)
    with pytest.raises(ub.CheckpointError, match="another save committed step 2"):
        ckpt_l.save(2)
    step2 = [n for n in _objects(url) if n.startswith("step_00000002/")]
    assert len(step2) == 2  # the winner's manifest and shard only
    check = Problem(seed=9)
    assert check.checkpointer(url).restore(step=2).verified
    assert_same_training_state(winner, check)


def test_retention_unlists_before_deleting(url, monkeypatch):
    """Guarantee: retention deletes an old checkpoint's manifest (unlisting it) before
    any of its other objects, and deletes all of them."""
    deleted: list[str] = []
    from unbroken.storage import store as remote

    real = remote.Store.delete

    def spy(self, keys):
        deleted.extend(keys)
        return real(self, keys)

    monkeypatch.setattr(remote.Store, "delete", spy)
    p = _trained()
    ckpt = p.checkpointer(url, keep_last=1)
    ckpt.save(1)
    ckpt.save(2)
    ckpt.close()
    old = [k for k in deleted if "step_00000001" in k]
    assert old and old[0].endswith("step_00000001/manifest.json")
    assert all(not n.startswith("step_00000001") for n in _objects(url))
    assert ckpt.steps() == [2]


def test_resave_replaces_and_branch_retires(url):
    """Guarantee: re-saving a committed step replaces it (the new state restores), and
    a resume from an older step retires the abandoned newer one (kept, unlisted)."""
    p = _trained()
    ckpt = p.checkpointer(url, keep_last=None)
    ckpt.save(1)
    p.step()
    ckpt.save(2)
    p.step()
    ckpt.save(2)  # re-save: replaces
    q = Problem(seed=4)
    assert q.checkpointer(url).restore(step=2).verified
    assert_same_training_state(p, q)
    r = Problem(seed=4)
    ckpt_r = r.checkpointer(url, keep_last=None)
    ckpt_r.restore(step=1)
    r.step()
    ckpt_r.save(3)  # the first save after resuming from 1 retires step 2
    ckdir = checkpoint_dir(url)
    assert ckdir.steps() == [1, 3]
    assert [s for s, _ in ckdir.retired()] == [2]


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_shard_object_is_named(url, damage):
    """Guarantee: checksums and sizes are verified on read: a truncated or altered shard
    object is refused, its URL named, and an older sound checkpoint restored instead."""
    p = _trained()
    ckpt = p.checkpointer(url, keep_last=None)
    ckpt.save(1)
    ckpt.save(2)
    fs, root = fsspec.core.url_to_fs(url)
    shard = next(k for k in fs.find(f"{root}/step_00000002") if k.endswith(".bin"))
    data = bytearray(fs.cat_file(shard))
    if damage == "truncate":
        data = data[:-8]
    else:
        data[len(data) // 2] ^= 0x40
    fs.pipe_file(shard, bytes(data))
    with pytest.raises(ub.CorruptCheckpointError, match=shard.rsplit("/", 1)[-1]):
        Problem(seed=4).checkpointer(url).restore(step=2)
    report = Problem(seed=4).checkpointer(url).restore()
    assert report.step == 1 and any("step 2" in w for w in report.warnings)


@pytest.mark.parametrize(
    ("bad", "says"),
    [("s3://only-a-bucket", "not a bucket"), ("nosuchproto://x/y", "no file system for")],
)
def test_bad_urls_are_named(bad, says):
    """Guarantee: a URL that cannot be used fails at construction, naming it and the fix."""
    with pytest.raises(ub.CheckpointError, match=says) as info:
        Problem().checkpointer(bad)
    assert bad.split("://")[1].split("/")[0] in str(info.value)


def test_parts_are_views_unless_they_span_segments():
    """Guarantee: an upload sends a part from the tensor's own memory when it lies inside
    one tensor (no second copy), joins only parts that span tensors, loses no byte."""
    a = torch.arange(40, dtype=torch.uint8)
    b = torch.arange(100, 110, dtype=torch.uint8)
    segs = [memoryview(a.numpy()), memoryview(b.numpy())]
    parts = list(store_io._parts(segs, 16))
    assert [len(x) for x in parts] == [16, 16, 16, 2]
    assert parts[0].obj is segs[0].obj  # a view of the tensor's memory, not a copy
    assert b"".join(bytes(x) for x in parts) == bytes(segs[0]) + bytes(segs[1])


def test_import_unbroken_needs_no_fsspec(tmp_path):
    """Guarantee: fsspec is optional: ``import unbroken`` and local saves work without it,
    and a URL then fails naming the extra to install."""
    code = (
        "import sys; sys.modules['fsspec'] = None\n"
        "import torch, unbroken as ub\n"
        "assert 'fsspec' not in sys.modules or sys.modules['fsspec'] is None\n"
        "m = torch.nn.Linear(2, 2)\n"
        f"ub.Checkpointer({str(tmp_path)!r}, model=m).save(1)\n"
        "try:\n"
        "    ub.Checkpointer('s3://b/run', model=m)\n"
        "except ub.CheckpointError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "unbroken[s3]" in out.stdout
    assert (tmp_path / "step_00000001" / "manifest.json").is_file()


def test_async_save_commits_in_the_background(url):
    """Guarantee: an asynchronous save to a store commits (manifest last) once the
    background upload finishes, and restores exactly."""
    a = _trained()
    ckpt = a.checkpointer(url, async_save=True)
    ckpt.save(2)
    ckpt.close()  # waits for the upload and the commit
    assert checkpoint_dir(url).steps() == [2]
    b = Problem(seed=7)
    assert b.checkpointer(url).restore().verified
    assert_same_training_state(a, b)
