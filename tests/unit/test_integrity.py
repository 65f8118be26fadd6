"""Commit protocol, retention and damaged files: nothing damaged is ever loaded."""

from __future__ import annotations

import hashlib
import json
import pickle

import pytest
import torch
import xxhash

import tamper
import unbroken as ub
from conftest import Problem, assert_same_training_state, restore_skipping, save_steps


def _two_saves(ckpt_dir, **kwargs) -> Problem:
    p = Problem()
    ckpt = p.checkpointer(ckpt_dir, **kwargs)
    for step in (1, 2):
        p.step()
        ckpt.save(step)
    return p


def _shard(ckpt_dir, step=2):
    return ckpt_dir / f"step_{step:08d}" / "rank_00000.bin"


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda f: f.write_bytes(f.read_bytes()[:-7]), "rank_00000.bin"),
        (lambda f: f.unlink(), "rank_00000.bin is missing"),
        (lambda f: f.write_bytes(_flip(f.read_bytes(), 40)), "fail their checksum"),
        (lambda f: (f.parent / "rank_00001.bin").write_bytes(b"x"), "rank_00001.bin"),
        (lambda f: tamper.alter(f.parent, '"step": 2', '"step": 3'), "manifest was altered"),
        (lambda f: (f.parent / "manifest.json").write_text("{not json" * 10), "not valid JSON"),
        (lambda f: (f.parent / "manifest.json").write_text("{not json"), "too short"),
    ],
    ids=[
        "truncated",
        "missing",
        "bit-flip",
        "extra-file",
        "manifest-altered",
        "manifest-garbage",
        "manifest-stub",
    ],
)
def test_damaged_checkpoint_is_refused_naming_the_file(ckpt_dir, damage, match):
    _two_saves(ckpt_dir)
    damage(_shard(ckpt_dir))
    fresh = Problem(seed=1)
    before = {k: v.clone() for k, v in fresh.model.state_dict().items()}
    with pytest.raises(ub.CorruptCheckpointError, match=match):
        fresh.checkpointer(ckpt_dir).restore(step=2)
    for k, v in fresh.model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} was modified by a failed restore"
    assert fresh.checkpointer(ckpt_dir).restore(step=1).step == 1  # the older one is sound


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :]


def test_partial_saves_are_never_listed_and_are_cleaned(ckpt_dir):
    _two_saves(ckpt_dir)
    partial = ckpt_dir / ".partial-step_00000003-deadbeef"
    partial.mkdir()
    (partial / "rank_00000.bin").write_bytes(b"half")
    uncommitted = ckpt_dir / "step_00000004"  # a folder without a manifest is not committed
    uncommitted.mkdir()
    ckpt = Problem().checkpointer(ckpt_dir)
    assert ckpt.steps() == [1, 2] and ckpt.latest_step() == 2
    assert ckpt.restore().step == 2
    assert not partial.exists()


def test_failed_save_leaves_previous_checkpoint_untouched(ckpt_dir):
    class Exploding:
        def state_dict(self):
            raise RuntimeError("disk on fire")

        def load_state_dict(self, state):
            pass

    p = _two_saves(ckpt_dir)
    digest = _tree_digest(ckpt_dir)
    ckpt = p.checkpointer(ckpt_dir, extra={"boom": Exploding()})
    ckpt.restore(reset={"boom"})  # the same run continues, with an extra added
    with pytest.raises(RuntimeError, match="disk on fire"):
        ckpt.save(3)
    assert _tree_digest(ckpt_dir) == digest
    assert ckpt.steps() == [1, 2]


def test_unpicklable_state_is_refused_before_writing(ckpt_dir):
    class Weird:
        def state_dict(self):
            return {"fn": object()}

        def load_state_dict(self, state):
            pass

    p = Problem()
    with pytest.raises(TypeError, match="weird/fn"):
        p.checkpointer(ckpt_dir, extra={"weird": Weird()}).save(1)
    assert not ckpt_dir.exists()  # refused before anything was written


def test_keep_last_retention(ckpt_dir):
    p = Problem()
    ckpt = p.checkpointer(ckpt_dir, keep_last=2)
    for step in range(1, 6):
        p.step()
        ckpt.save(step)
    assert ckpt.steps() == [4, 5]
    ckpt.close()  # old files are deleted in the background; close() waits for that
    folders = sorted(x.name for x in ckpt_dir.iterdir() if x.is_dir())
    assert folders == ["step_00000004", "step_00000005"]


def test_keep_last_is_validated():
    with pytest.raises(ValueError, match="keep_last must be >= 1 or None, got 0"):
        Problem().checkpointer("x", keep_last=0)


def test_restore_never_modifies_a_committed_checkpoint(ckpt_dir):
    _two_saves(ckpt_dir)
    digest = _tree_digest(ckpt_dir)
    Problem(seed=2).checkpointer(ckpt_dir).restore()
    Problem(seed=2).checkpointer(ckpt_dir).restore(step=1)
    assert _tree_digest(ckpt_dir) == digest


def test_manifest_records_what_was_saved(ckpt_dir):
    _two_saves(ckpt_dir)
    doc = json.loads((ckpt_dir / "step_00000002" / "manifest.json").read_text())
    assert doc["format_version"] == 1 and doc["step"] == 2 and doc["world_size"] == 1
    entry = doc["tensors"]["optimizer/state/inp.weight/exp_avg"]
    assert entry["dtype"] == "float32" and entry["shape"] == [8, 4]
    assert len(entry["fingerprint"]) == 16
    assert set(doc["files"]) == {"rank_00000.bin"}
    assert doc["versions"]["torch"] == torch.__version__


class _Ordered:
    """An ``extra`` whose state's keys are out of sorted order."""

    def __init__(self) -> None:
        self.state = {"zeta": 1, "alpha": 2}

    def state_dict(self):
        return dict(self.state)

    def load_state_dict(self, state):
        self.state = state


def test_manifest_keeps_state_key_order(ckpt_dir):
    """A state's key order survives in the manifest (its JSON objects keep the state's
    order, where earlier versions sorted them) and the restore gives it back."""
    Problem().checkpointer(ckpt_dir, extra={"ordered": _Ordered()}).save(1)
    path = ckpt_dir / "step_00000001" / "manifest.json"
    doc = json.loads(path.read_text())
    assert list(doc["components"]["ordered"]["state"]) == ["zeta", "alpha"]
    restored = _Ordered()
    Problem(seed=1).checkpointer(ckpt_dir, extra={"ordered": restored}).restore()
    assert list(restored.state) == ["zeta", "alpha"]
    assert list(doc) == sorted(doc)  # everything else is laid out as before
    assert list(doc["tensors"]) == sorted(doc["tensors"])


def test_manifest_written_with_sorted_keys_still_reads_and_restores(ckpt_dir):
    """Back-compat guard: a manifest as earlier versions wrote it (every key sorted, the
    checksum over the sorted JSON) passes its checksum, restores and verifies."""
    saved = _two_saves(ckpt_dir)
    path = ckpt_dir / "step_00000002" / "manifest.json"
    doc = json.loads(path.read_text())
    doc.pop("manifest_checksum")
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False)
    doc["manifest_checksum"] = xxhash.xxh3_128_hexdigest(canonical.encode())
    path.write_text(json.dumps(doc, indent=1, sort_keys=True, allow_nan=False))
    fresh = Problem(seed=1)
    assert fresh.checkpointer(ckpt_dir).restore().verified
    assert_same_training_state(saved, fresh)


def _tree_digest(root) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


# Security --------------------------------------------------------------------------------


def test_restore_never_unpickles(ckpt_dir, monkeypatch):
    """DCP's .metadata is a pickle: loading an untrusted checkpoint could run code. Our
    restore must succeed with every pickle entry point disabled."""
    saved = _two_saves(ckpt_dir)

    def refuse(*args, **kwargs):
        raise AssertionError("restore tried to unpickle")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    fresh = Problem(seed=1)
    assert fresh.checkpointer(ckpt_dir).restore().verified
    assert torch.equal(fresh.model.inp.weight, saved.model.inp.weight)


def test_planted_pickle_is_never_read(ckpt_dir):
    """A crafted .metadata pickle next to our files is refused, not executed."""
    _two_saves(ckpt_dir)
    payload = b"cos\nsystem\n(S'touch /tmp/unbroken-pwned'\ntR."
    (ckpt_dir / "step_00000002" / ".metadata").write_bytes(payload)
    with pytest.raises(ub.CorruptCheckpointError, match=r"\.metadata"):
        Problem().checkpointer(ckpt_dir).restore(step=2)


def test_restore_latest_falls_back_past_a_damaged_checkpoint(ckpt_dir):
    """Designed behaviour: with no step given, a damaged newest checkpoint (detected before
    any live object is touched) is skipped with a warning and the newest sound one is
    restored; a step asked for explicitly never falls back."""
    at_step_1 = save_steps(ckpt_dir, (1, 2, 3))[1].model.state_dict()
    for step in (2, 3):
        shard = _shard(ckpt_dir, step)
        shard.write_bytes(_flip(shard.read_bytes(), 100))
    fresh, _ = restore_skipping(ckpt_dir, [3, 2], to=1)
    for k, v in fresh.model.state_dict().items():
        assert torch.equal(v, at_step_1[k]), k
    with pytest.raises(ub.CorruptCheckpointError, match="step_00000003"):
        Problem().checkpointer(ckpt_dir).restore(step=3)


def test_every_checkpoint_damaged_is_one_error_naming_each(ckpt_dir):
    _two_saves(ckpt_dir)
    for step in (1, 2):
        _shard(ckpt_dir, step).unlink()
    with pytest.raises(ub.CorruptCheckpointError, match="no committed checkpoint") as info:
        Problem().checkpointer(ckpt_dir).restore()
    assert "step_00000002/rank_00000.bin" in str(info.value)
    assert "step_00000001/rank_00000.bin" in str(info.value)


def test_symlinked_shard_is_refused(ckpt_dir, tmp_path):
    """A hostile checkpoint must not make restore read files outside its folder."""
    _two_saves(ckpt_dir)
    shard = _shard(ckpt_dir)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(shard.read_bytes())
    shard.unlink()
    shard.symlink_to(outside)
    with pytest.raises(ub.CorruptCheckpointError, match="symbolic link"):
        Problem().checkpointer(ckpt_dir).restore(step=2)


def test_a_manifest_listing_an_unreferenced_tensor_is_never_sealed(ckpt_dir):
    """Issue 36, item 14's rule: no checkpoint is committed that our own read-back would
    call damaged. A document whose components do not reference a tensor it lists (as the
    pipeline-stage merge once dropped an optimizer only the last stage had, after its
    tensors were written) is refused when the manifest is encoded, before the commit,
    naming the tensor."""
    from unbroken.format import manifest

    p = Problem()
    p.step()  # AdamW moments: tensors the optimizer's state references
    p.checkpointer(ckpt_dir).save(1)
    body = tamper.read(ckpt_dir / "step_00000001")
    for key in ("format", "format_version", "manifest_checksum"):
        body.pop(key, None)
    manifest.encode(ckpt_dir / "step_00000001", body)  # as saved: sealed
    body["components"]["optimizer"]["state"]["state"] = {}
    with pytest.raises(ub.CheckpointError, match=r"no component's state references \(optimizer/"):
        manifest.encode(ckpt_dir / "step_00000001", body)
