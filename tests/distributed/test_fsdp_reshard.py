"""FSDP2 checkpoints restore bit-exactly into other world sizes (DESIGN.md F2)."""

from __future__ import annotations

import pytest
import torch

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


def _assert_identical(got: dict, want: dict) -> None:
    assert got["model"].keys() == want["model"].keys()
    for fqn, t in want["model"].items():
        assert got["model"][fqn].dtype == t.dtype, fqn
        assert torch.equal(got["model"][fqn], t), fqn
    assert got["optimizer"].keys() == want["optimizer"].keys()
    for fqn, entries in want["optimizer"].items():
        assert got["optimizer"][fqn].keys() == entries.keys(), fqn
        for name, t in entries.items():
            assert got["optimizer"][fqn][name].dtype == t.dtype, (fqn, name)
            assert torch.equal(got["optimizer"][fqn][name], t), (fqn, name)


@pytest.fixture(scope="module")
def saved_on_two(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fsdp2") / "ckpt")
    want = launcher.run(models.save_trained_fsdp, 2, path)[0]
    return path, want


def test_two_ranks_to_three(saved_on_two):
    path, want = saved_on_two
    results = launcher.run(_restore_on_fsdp, 3, path)
    for r in results:
        assert r["report"].resharded and r["report"].verified
        assert r["report"].saved_world_size == 2 and r["report"].world_size == 3
        assert r["report"].components["rng"] == "reset"
    _assert_identical(results[0]["full"], want)


def test_two_ranks_to_one_unsharded_process(saved_on_two):
    import unbroken as ub

    path, want = saved_on_two
    model, opt = models.build(seed=123)
    report = ub.Checkpointer(path, model=model, optimizer=opt).restore(reset={"rng"})
    assert report.resharded and report.saved_world_size == 2 and report.world_size == 1
    got = {
        "model": model.state_dict(),
        "optimizer": {fqn: opt.state[p] for fqn, p in model.named_parameters()},
    }
    _assert_identical(got, want)
