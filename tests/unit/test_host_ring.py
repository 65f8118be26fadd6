"""The GPU data path through a ring of reused host buffers (format/host_ring.py), run on
the CPU: the ring is what a CUDA tensor's bytes pass through on a sync save and a
restore, and CI has no GPU. Here ``through_ring`` is made true for CPU tensors and the
pieces are made a few dozen bytes, so that every tensor crosses many pieces, cut inside
its elements.

Guards: a save whose pieces are reordered, dropped or reused before they are written
(silent loss, DESIGN.md F1/F2: the checksum would be computed from the wrong bytes and
the restore would load them); a restore through the ring that accepts damaged bytes, or
changes the live model before the checksum of every piece is checked.
"""

from __future__ import annotations

import threading

import pytest
import torch

import unbroken as ub
from conftest import Problem, assert_same_training_state
from unbroken.format import host_ring
from unbroken.format.shards import checksum, tensor_bytes

PIECE = 24  # bytes: cuts 8-byte words and float32s alike


@pytest.fixture
def small_ring(monkeypatch):
    """Rings of ``PIECE``-byte pieces, made afresh for the test, used for CPU tensors."""
    monkeypatch.setattr(
        host_ring, "pinned_bound", lambda: PIECE * host_ring.RINGS * host_ring.SLOTS
    )
    monkeypatch.setattr(host_ring, "_POOL", host_ring._Pool())
    used: list[torch.Size] = []

    def through(t: torch.Tensor) -> bool:
        used.append(t.shape)
        return True

    monkeypatch.setattr(host_ring, "through_ring", through)
    return used


@pytest.mark.parametrize("numel", [0, 1, 5, 6, 7, 60, 61])
def test_download_gives_every_byte_in_order(numel):
    """The pieces, concatenated, are the tensor's row-major bytes, for sizes below, at and
    past a piece, non-contiguous tensors included."""
    ring = host_ring.HostRing(torch.device("cpu"), PIECE)
    t = torch.randn(numel * 3).view(numel, 3).t()  # transposed: not contiguous
    pieces = [bytes(p) for p in ring.download(t)]
    assert all(len(p) == PIECE for p in pieces[:-1])
    assert b"".join(pieces) == bytes(tensor_bytes(t))


def test_download_pieces_stay_valid_until_the_next_is_asked_for():
    """A piece handed to the caller is not overwritten by the copy of a later piece while
    the caller still holds it (two slots: one in use, one being filled)."""
    ring = host_ring.HostRing(torch.device("cpu"), PIECE)
    t = torch.arange(100, dtype=torch.int32)
    expected = bytes(tensor_bytes(t))
    seen = b""
    for piece in ring.download(t):
        held = bytes(piece)
        seen += held
        assert bytes(piece) == held
    assert seen == expected


@pytest.mark.parametrize("numel", [0, 1, 7, 12, 13, 100])
def test_upload_fills_the_target_piece_by_piece(numel):
    ring = host_ring.HostRing(torch.device("cpu"), PIECE)
    source = torch.randn(numel, dtype=torch.float64)
    data = bytes(tensor_bytes(source))
    target = torch.full((numel,), float("nan"), dtype=torch.float64)
    at = 0

    def fill(view: memoryview) -> None:
        nonlocal at
        view[:] = data[at : at + view.nbytes]
        at += view.nbytes

    ring.upload(target, fill)
    assert at == len(data)
    assert torch.equal(target, source)


def test_save_and_restore_through_the_ring_are_exact_and_write_the_same_bytes(tmp_path, small_ring):
    """A save through the ring writes byte for byte the files of a direct save (same
    chunks, same checksums), and a restore through it is exact."""
    a = Problem()
    for _ in range(3):
        a.step()
    a.checkpointer(tmp_path / "ring").save(3)
    assert small_ring, "the ring was not used"
    with pytest.MonkeyPatch.context() as m:
        m.setattr(host_ring, "through_ring", lambda t: False)
        a.checkpointer(tmp_path / "direct").save(3)
    ring_file = tmp_path / "ring" / "step_00000003" / "rank_00000.bin"
    direct_file = tmp_path / "direct" / "step_00000003" / "rank_00000.bin"
    assert ring_file.read_bytes() == direct_file.read_bytes()
    b = Problem(seed=5)
    small_ring.clear()
    report = b.checkpointer(tmp_path / "ring").restore()
    assert small_ring and report.verified
    assert_same_training_state(a, b)


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda d: d[:-5], "truncated"),
        (lambda d: d[:30] + bytes([d[30] ^ 0x10]) + d[31:], "fail their checksum"),
    ],
    ids=["truncated", "bit-flip"],
)
def test_a_damaged_piece_is_refused_and_nothing_live_changes(tmp_path, small_ring, damage, match):
    """Damage in any piece read through the ring is caught by the chunk's checksum before
    the live model changes; the older checkpoint is still restored."""
    a = Problem()
    ckpt = a.checkpointer(tmp_path)
    for step in (1, 2):
        a.step()
        ckpt.save(step)
    shard = tmp_path / "step_00000002" / "rank_00000.bin"
    shard.write_bytes(damage(shard.read_bytes()))
    fresh = Problem(seed=1)
    before = {k: v.clone() for k, v in fresh.model.state_dict().items()}
    with pytest.raises(ub.CorruptCheckpointError, match=match):
        fresh.checkpointer(tmp_path).restore(step=2)
    for k, v in fresh.model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} was modified by a failed restore"
    assert fresh.checkpointer(tmp_path).restore(step=1).step == 1


def test_streamed_checksum_is_the_one_shot_checksum():
    """A chunk's checksum computed piece by piece equals the checksum of its bytes at
    once: checkpoints saved from a GPU and from a CPU are checked alike."""
    from unbroken.format.shard_writer import _write_pieces

    class Sink:
        def __init__(self) -> None:
            self.data = b""

        def write(self, piece: memoryview) -> None:
            self.data += bytes(piece)

    t = torch.randn(97)
    sink = Sink()
    size, digest = _write_pieces(sink, host_ring.HostRing(torch.device("cpu"), PIECE).download(t))
    assert (size, digest) == (len(sink.data), checksum(tensor_bytes(t)))
    assert sink.data == bytes(tensor_bytes(t))


def test_the_pool_never_holds_more_than_its_bound(monkeypatch):
    """At most ``RINGS`` rings exist per device, so pinned memory stays within
    ``UNBROKEN_PINNED_MB``; a thread asking for one more waits until one is returned,
    and rings are reused rather than made again."""
    monkeypatch.setattr(
        host_ring, "pinned_bound", lambda: PIECE * host_ring.RINGS * host_ring.SLOTS
    )
    pool = host_ring._Pool()
    cpu = torch.device("cpu")
    held = [pool.borrow(cpu) for _ in range(host_ring.RINGS)]
    rings = [h.__enter__() for h in held]
    assert all(r.piece == PIECE for r in rings)
    got: list[host_ring.HostRing] = []
    waiter = threading.Thread(target=lambda: got.append(pool.borrow(cpu).__enter__()))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not got  # the ninth waits
    held[3].__exit__(None, None, None)
    waiter.join(5)
    assert got == [rings[3]]  # the returned ring, not a new one


def test_the_bound_is_a_setting_with_a_clear_error(monkeypatch):
    monkeypatch.setenv(host_ring.PINNED_ENV, "64")
    assert host_ring.pinned_bound() == 64 << 20
    monkeypatch.setenv(host_ring.PINNED_ENV, "none")
    with pytest.raises(ValueError, match="UNBROKEN_PINNED_MB"):
        host_ring.pinned_bound()
