"""A chunk read wrong once is read again, not taken for damage (issue 29, item 6).

A disk or store may answer wrong bytes once (a flipped byte in transit). Before, the
chunk failing its checksum made the newest, sound checkpoint "damaged": ``restore()``
skipped it and resumed an older step, with no re-read. Now a chunk that fails its
checksum is read again (twice at most) into the same memory; sound on a re-read, the
restore goes on and says so in its report; wrong every time, it is damage as before.
"""

from __future__ import annotations

import pytest
import torch

import tamper
import unbroken as ub
from conftest import Problem, assert_same_training_state, save_steps
from unbroken.format import manifest
from unbroken.format.tensor_reader import TensorReader
from unbroken.storage import local_files

KEY = "model/inp.weight"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("reread") / "run"
    return root, save_steps(root)


@pytest.fixture
def flip(monkeypatch, saved):
    """``flip(times)``: the next ``times`` reads of step 2's chunk of ``KEY`` come back with
    one byte flipped (None: every read); returns the list of reads of that chunk seen."""
    root, _ = saved
    chunk = tamper.read(root / "step_00000002")["tensors"][KEY]["chunks"][0]
    real = local_files._FileChunks.read_into
    reads: list[int] = []

    def arm(times: int | None):
        def read_into(self, offset, buf):
            got = real(self, offset, buf)
            mine = self._f.name.endswith(f"step_00000002/{chunk['file']}")
            if mine and offset == chunk["offset"]:
                reads.append(offset)
                if times is None or len(reads) <= times:
                    buf[3] ^= 0x10
            return got

        monkeypatch.setattr(local_files._FileChunks, "read_into", read_into)
        return reads

    return arm


def test_a_chunk_read_wrong_once_is_read_again_and_the_newest_step_restores(saved, flip):
    """One flipped byte on the first read of one chunk: restore() reads it again and
    resumes the newest step (2), verified and exact, and its report says which chunk was
    read wrong once. (Before: step 2 skipped as damaged, step 1 resumed.)"""
    root, states = saved
    reads = flip(1)
    live = Problem(seed=3)
    report = live.checkpointer(root).restore()
    assert report.step == 2 and report.verified, report.warnings
    assert_same_training_state(live, states[2])
    assert len(reads) == 2
    [note] = report.warnings
    assert f"a chunk of {KEY!r} read wrong once from" in note and "read again and sound" in note


def test_a_chunk_wrong_on_every_read_is_damage_and_restore_falls_back(saved, flip):
    """The same byte flipped on every read: after two re-reads the chunk is damage, the
    restore falls back to step 1 naming the failed checksum; restore(step=2) raises."""
    root, states = saved
    reads = flip(None)
    live = Problem(seed=3)
    report = live.checkpointer(root).restore()
    assert report.step == 1 and len(reads) == 3
    assert any("step 2" in w and "fail their checksum" in w for w in report.warnings)
    assert_same_training_state(live, states[1])
    with pytest.raises(ub.CorruptCheckpointError, match="fail their checksum, read 3 times"):
        Problem(seed=3).checkpointer(root).restore(step=2)


def test_the_offline_reader_reads_again_too(saved, flip):
    """``unbroken verify``'s reader: a chunk read wrong once is read again and sound, noted
    in the reader's warnings, and verify passes; wrong every time, verify fails."""
    root, states = saved
    folder = root / "step_00000002"
    reads = flip(1)
    with TensorReader(folder, manifest.read(folder)) as reader:
        assert torch.equal(reader.read(KEY), states[2].model.inp.weight)
        [note] = reader.warnings
    assert "read wrong once" in note and len(reads) == 2
    reads.clear()
    assert ub.verify_checkpoint(folder).ok
    flip(None)
    assert not ub.verify_checkpoint(folder).ok


@pytest.fixture
def flip_manifest(monkeypatch):
    """``flip_manifest(times)``: the next ``times`` reads of step 2's manifest come back
    with one byte flipped (None: every read); returns the list of its reads seen."""
    real = local_files.LocalPath.read_capped
    reads: list[int] = []

    def arm(times: int | None):
        def read_capped(self, limit):
            got = real(self, limit)
            if str(self).endswith("step_00000002/manifest.json"):
                reads.append(len(got))
                if times is None or len(reads) <= times:
                    i = got.index(b'"step"')  # a byte of the document, inside a key
                    got = got[:i] + b'"stdp"' + got[i + 6 :]
            return got

        monkeypatch.setattr(local_files.LocalPath, "read_capped", read_capped)
        return reads

    return arm


def test_a_manifest_read_wrong_once_is_read_again_and_the_newest_step_restores(
    saved, flip_manifest
):
    """Issue 36, item 7: one byte of step 2's manifest read wrong once. restore() reads it
    again and resumes step 2, verified and exact, its report noting the read; before, the
    manifest "was altered", step 2 was skipped as damaged and step 1 resumed."""
    root, states = saved
    reads = flip_manifest(1)
    live = Problem(seed=3)
    report = live.checkpointer(root).restore()
    assert report.step == 2 and report.verified, report.warnings
    assert_same_training_state(live, states[2])
    assert len(reads) >= 2
    [note] = [w for w in report.warnings if "manifest" in w]
    assert "read wrong once (fails its checksum), read again and sound" in note, note


def test_a_manifest_wrong_on_every_read_is_damage(saved, flip_manifest):
    """The same byte wrong on every read of step 2's manifest: after two re-reads it is
    damage, the restore falls back to step 1 saying so; the offline tools refuse it."""
    root, states = saved
    reads = flip_manifest(None)
    live = Problem(seed=3)
    report = live.checkpointer(root).restore()
    assert report.step == 1 and len(reads) == 3
    [skip] = [w for w in report.warnings if "step 2" in w]
    assert "fails its checksum, read 3 times: the manifest was altered or damaged" in skip
    assert_same_training_state(live, states[1])
    with pytest.raises(ub.CorruptCheckpointError, match="read 3 times"):
        manifest.read(root / "step_00000002")
