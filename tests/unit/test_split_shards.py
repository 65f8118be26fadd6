"""A large local shard is written as two files side by side (format/shard_writer.py).

Two files written in parallel finish sooner than one on the disks measured (the save
target of issue 15); these tests hold the split to the same guarantees as one file: the
restore is bit for bit the saved state, both files are listed, checksummed and fsynced,
damage to either is named, and a failure while writing one commits nothing.
"""

from __future__ import annotations

import itertools
import json
import threading

import pytest
import torch

from conftest import Problem, assert_same_training_state
from unbroken.errors import CheckpointError, CorruptCheckpointError
from unbroken.format import shard_reader, shard_writer


@pytest.fixture
def split(monkeypatch):
    """Split even the tiny test state (a file holds at least 64 MiB otherwise)."""
    monkeypatch.setattr(shard_writer, "SPLIT_MIN_BYTES", 1024)


def _ours(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]


def _files(step_dir):
    return sorted(p.name for p in step_dir.glob("rank_*"))


def test_split_save_restores_bit_exactly(split, ckpt_dir):
    """Guarantee (DESIGN.md's silent-drift class): a shard split over two files comes back
    bit for bit, every chunk read from the file the manifest names."""
    a = Problem()
    a.step()
    a.checkpointer(ckpt_dir).save(1)
    step = ckpt_dir / "step_00000001"
    assert _files(step) == ["rank_00000.1.bin", "rank_00000.bin"]
    doc = json.loads((step / "manifest.json").read_text())
    assert set(doc["files"]) == {"rank_00000.bin", "rank_00000.1.bin"}
    used = {c["file"] for t in doc["tensors"].values() for c in t["chunks"]}
    assert used == set(doc["files"])
    b = Problem(seed=3)
    report = b.checkpointer(ckpt_dir).restore()
    assert report.verified
    assert_same_training_state(a, b)


@pytest.fixture
def parallel_reads(monkeypatch):
    """Three files, each cut into runs of a chunk or two, read by four threads."""
    monkeypatch.setenv("UNBROKEN_WRITE_FILES", "8")
    monkeypatch.setattr(shard_writer, "SPLIT_MIN_BYTES", 64)
    monkeypatch.setattr(shard_reader, "READ_RUN_MIN_BYTES", 64)
    monkeypatch.setenv("UNBROKEN_READ_THREADS", "4")


@pytest.mark.parametrize("readers", ["default", "parallel"])
def test_damage_in_the_second_file_is_named(split, ckpt_dir, request, readers):
    """Guarantee: a flipped byte in the second file is caught and named before anything
    is installed, and every reader and the fingerprint worker end (none waits forever),
    also when the damaged chunk is one of several read side by side."""
    if readers == "parallel":
        request.getfixturevalue("parallel_reads")
    a = Problem()
    a.checkpointer(ckpt_dir).save(1)
    second = ckpt_dir / "step_00000001" / "rank_00000.1.bin"
    data = bytearray(second.read_bytes())
    data[len(data) // 2] ^= 0xFF
    second.write_bytes(bytes(data))
    b = Problem(seed=3)
    before = {k: v.clone() for k, v in b.model.state_dict().items()}
    with pytest.raises(CorruptCheckpointError, match=r"rank_00000\.1\.bin"):
        b.checkpointer(ckpt_dir).restore(step=1)
    assert all(torch.equal(before[k], v) for k, v in b.model.state_dict().items())
    workers = _ours("unbroken-read") + _ours("unbroken-fp")
    for t in workers:
        t.join(timeout=30)
    assert not [t.name for t in workers if t.is_alive()]


def test_a_failure_in_one_writer_commits_nothing(split, ckpt_dir, monkeypatch):
    """Guarantee: when one of the two parallel writes fails, the save raises and the last
    committed checkpoint stays the newest."""
    p = Problem()
    ckpt = p.checkpointer(ckpt_dir)
    ckpt.save(1)
    real = shard_writer.ShardWriter._write_file

    def failing(self, name, items, planner):
        if name.endswith(".1.bin"):
            raise OSError(28, "No space left on device", name)
        return real(self, name, items, planner)

    monkeypatch.setattr(shard_writer.ShardWriter, "_write_file", failing)
    p.step()
    with pytest.raises((CheckpointError, OSError)):
        ckpt.save(2)
    assert sorted(x.name for x in ckpt_dir.iterdir() if x.name.startswith("step_")) == [
        "step_00000001"
    ]


def test_small_shards_stay_one_file(ckpt_dir):
    """Below the threshold (64 MiB per file) a shard is one file, as before."""
    Problem().checkpointer(ckpt_dir).save(1)
    assert _files(ckpt_dir / "step_00000001") == ["rank_00000.bin"]


def test_split_keeps_plan_order_and_balances_bytes():
    """The runs are contiguous in plan order and of about equal size."""

    class Item:
        def __init__(self, n):
            self.n = n

        def tensor_storage_size(self):
            return self.n

    items = [Item(n) for n in (5, 1, 1, 1, 1, 1)]
    old = shard_writer.SPLIT_MIN_BYTES
    try:
        shard_writer.SPLIT_MIN_BYTES = 1
        groups = shard_writer._split(items, 2)
    finally:
        shard_writer.SPLIT_MIN_BYTES = old
    assert [[i.n for i in g] for g in groups] == [[5], [1, 1, 1, 1, 1]]
    assert shard_writer._split(items, 1) == [items]


@pytest.mark.parametrize(("threads", "run_bytes"), [(1, None), (2, None), (2, 64)])
def test_any_number_of_readers_restores_bit_exactly(
    split, ckpt_dir, monkeypatch, threads, run_bytes
):
    """Guarantee (silent-drift class): however a shard's files are read (file after file
    by the restoring thread; a thread per file; files cut into runs of a few chunks read
    side by side), every chunk comes back bit for bit, and with one reader each file is
    read start to end, one after another."""
    monkeypatch.setenv("UNBROKEN_WRITE_FILES", "8")  # three files come out of this state
    monkeypatch.setattr(shard_writer, "SPLIT_MIN_BYTES", 64)
    if run_bytes is not None:
        monkeypatch.setattr(shard_reader, "READ_RUN_MIN_BYTES", run_bytes)
    a = Problem()
    a.step()
    a.checkpointer(ckpt_dir).save(1)
    step = ckpt_dir / "step_00000001"
    assert len(_files(step)) == 3
    reads: dict[int, list[tuple[str, int]]] = {}
    original = shard_reader.ShardReader._read_chunk

    def traced(self, index, *args, **kwargs):
        where = self._location(index)
        reads.setdefault(threading.get_ident(), []).append((where.file, where.offset))
        return original(self, index, *args, **kwargs)

    monkeypatch.setenv("UNBROKEN_READ_THREADS", str(threads))
    monkeypatch.setattr(shard_reader.ShardReader, "_read_chunk", traced)
    b = Problem(seed=3)
    report = b.checkpointer(ckpt_dir).restore()
    assert report.verified
    assert_same_training_state(a, b)
    assert {f for seen in reads.values() for f, _ in seen} == set(_files(step))
    if threads == 1:  # the restoring thread reads them all, file after file
        (seen,) = reads.values()
        assert list(reads) == [threading.get_ident()]
        files = [f for i, (f, _) in enumerate(seen) if i == 0 or seen[i - 1][0] != f]
        assert len(files) == len(set(files)), seen
        assert all(o1 < o2 for (f1, o1), (f2, o2) in itertools.pairwise(seen) if f1 == f2)
    else:
        assert threading.get_ident() not in reads  # the pool read every whole chunk


def test_runs_are_consecutive_balanced_and_capped(monkeypatch):
    """Each file is cut into runs of consecutive chunks, none below the minimum run size,
    at most ``MAX_READERS`` in all, shared among files by their size."""
    monkeypatch.setattr(shard_reader, "READ_RUN_MIN_BYTES", 100)
    small = [(0, 50), (1, 40)]  # 90 bytes: below one run
    big = [(i, 100) for i in range(2, 42)]  # 4,000 bytes
    runs = shard_reader._runs([small, big], shard_reader.MAX_READERS)
    assert runs[0] == [0, 1]
    assert [i for run in runs[1:] for i in run] == list(range(2, 42))  # order kept
    assert len(runs) <= shard_reader.MAX_READERS + 1  # at least one per file
    assert len(runs) - 1 == shard_reader.MAX_READERS * 4000 // 4090
    sizes = [100 * len(run) for run in runs[1:]]
    assert max(sizes) - min(sizes) <= 100  # balanced within a chunk
    assert shard_reader._runs([[(0, 10)]], 8) == [[0]]
    assert shard_reader._runs([big], 2) == [list(range(2, 22)), list(range(22, 42))]


def test_read_threads_share_the_cpus_among_local_ranks(monkeypatch):
    """Two ranks torchrun started on a two-core machine read their files one after
    another; one process, or a rank pinned to two CPUs of its own, has several reads in
    flight; the variable wins."""
    monkeypatch.delenv("UNBROKEN_READ_THREADS", raising=False)
    monkeypatch.setattr(shard_reader.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(shard_reader.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert shard_reader.read_threads() == shard_reader.MAX_READERS
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert shard_reader.read_threads() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert shard_reader.read_threads() == 1
    monkeypatch.setattr(shard_reader.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(shard_reader.os, "sched_getaffinity", lambda pid: {4, 5}, raising=False)
    assert shard_reader.read_threads() == shard_reader.MAX_READERS  # pinned: two CPUs of its own
    monkeypatch.setenv("UNBROKEN_READ_THREADS", "3")
    assert shard_reader.read_threads() == 3
    monkeypatch.setenv("UNBROKEN_READ_THREADS", "0")
    with pytest.raises(ValueError, match="UNBROKEN_READ_THREADS"):
        shard_reader.read_threads()


def test_every_reader_starts_before_the_first_read(split, ckpt_dir, monkeypatch, parallel_reads):
    """The readers and the fingerprint worker all exist before any chunk is read: a thread
    started while the others read into new memory took 5-40 ms to start (measured), and
    the restoring thread waited for it."""
    a = Problem()
    a.checkpointer(ckpt_dir).save(1)
    at_first_read: list[tuple[int, int]] = []
    original = shard_reader.ShardReader._read_chunk

    def traced(self, *args, **kwargs):
        if not at_first_read:
            at_first_read.append((len(_ours("unbroken-read")), len(_ours("unbroken-fp"))))
        return original(self, *args, **kwargs)

    groups: list[int] = []
    runs = shard_reader._runs

    def counted(*args, **kwargs):
        out = runs(*args, **kwargs)
        groups.append(len(out))
        return out

    monkeypatch.setattr(shard_reader.ShardReader, "_read_chunk", traced)
    monkeypatch.setattr(shard_reader, "_runs", counted)
    b = Problem(seed=3)
    assert b.checkpointer(ckpt_dir).restore().verified
    assert_same_training_state(a, b)
    (count,) = groups
    assert count > 1
    assert at_first_read == [(count, 1)]
