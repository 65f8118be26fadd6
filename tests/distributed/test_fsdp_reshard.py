"""FSDP2 checkpoints restore bit-exactly into other world sizes (DESIGN.md F2)."""

from __future__ import annotations

import pytest

from . import launcher, models

pytestmark = pytest.mark.distributed


def _restore_on_fsdp(rank: int, world: int, path: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import unbroken as ub

    mesh = init_device_mesh("cpu", (world,))
    model, opt = models.build(seed=123, fsdp_mesh=mesh)  # different init on purpose
    ckpt = ub.Checkpointer(path, model=model, optimizer=opt)
    with pytest.raises(ub.IncompleteCheckpointError, match="rng"):
        ckpt.restore()
    report = ckpt.restore(reset={"rng"})
    full = models.full_state(model, opt)
    return {"report": report, "full": full if rank == 0 else None}


@pytest.fixture(scope="module")
def saved_on_two(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fsdp2") / "ckpt")
    want = launcher.run(models.save_trained_fsdp, 2, path)[0]
    return path, want


def restored_on_three(path: str, want: dict) -> None:
    """The 2-rank checkpoint at ``path`` restored on 3 FSDP2 ranks (refused without
    resetting the per-rank RNG state, then with it): resharded, verified, and the gathered
    state bit for bit ``want``."""
    results = launcher.run(_restore_on_fsdp, 3, path)
    for r in results:
        assert r["report"].resharded and r["report"].verified
        assert r["report"].saved_world_size == 2 and r["report"].world_size == 3
        assert r["report"].components["rng"] == "reset"
    models.assert_same_full_state(results[0]["full"], want)


def test_two_ranks_to_three(saved_on_two):
    restored_on_three(*saved_on_two)


def restored_in_one_process(path: str, want: dict) -> None:
    """The 2-rank checkpoint at ``path`` restored into one unsharded process (the
    per-rank RNG state reset): resharded, verified, and the state bit for bit ``want``."""
    import unbroken as ub

    model, opt = models.build(seed=123)
    report = ub.Checkpointer(path, model=model, optimizer=opt).restore(reset={"rng"})
    assert report.resharded and report.verified
    assert report.saved_world_size == 2 and report.world_size == 1
    got = {
        "model": model.state_dict(),
        "optimizer": {fqn: opt.state[p] for fqn, p in model.named_parameters()},
    }
    models.assert_same_full_state(got, want)


def test_two_ranks_to_one_unsharded_process(saved_on_two):
    restored_in_one_process(*saved_on_two)


def test_two_ranks_to_one_through_the_pinned_ring(saved_on_two, monkeypatch):
    """A resharded restore onto a GPU reads each saved chunk onto the device through the
    ring of pinned buffers and cuts it there (issue 27). Run on the CPU with CPU tensors
    sent through the ring, pieces of 40 bytes: every chunk, read in pieces, checksummed
    whole, cut into its parts of the targets, is bit-exact (DESIGN.md F2)."""
    import unbroken as ub
    from unbroken.format import host_ring

    through: list[tuple[int, ...]] = []
    monkeypatch.setattr(host_ring, "pinned_bound", lambda: 40 * host_ring.RINGS * host_ring.SLOTS)
    monkeypatch.setattr(host_ring, "_POOL", host_ring._Pool())
    monkeypatch.setattr(host_ring, "through_ring", lambda t: through.append(tuple(t.shape)) or True)
    path, want = saved_on_two
    model, opt = models.build(seed=123)
    report = ub.Checkpointer(path, model=model, optimizer=opt).restore(reset={"rng"})
    assert report.resharded and report.verified
    assert through, "the ring was not used"
    got = {
        "model": model.state_dict(),
        "optimizer": {fqn: opt.state[p] for fqn, p in model.named_parameters()},
    }
    models.assert_same_full_state(got, want)
