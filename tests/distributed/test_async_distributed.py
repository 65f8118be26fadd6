"""Asynchronous saves under FSDP2: training collectives run while the save is written."""

from __future__ import annotations

import pytest
import torch

from . import launcher, models

pytestmark = pytest.mark.distributed


def _async_then_restore(rank: int, world: int, path: str, mode: bool | str) -> dict | None:
    from torch.distributed.device_mesh import init_device_mesh

    import unbroken as ub

    mesh = init_device_mesh("cpu", (world,))
    model, opt = models.build(fsdp_mesh=mesh)
    models.train_steps(model, opt, 2, rank=rank)
    want = models.full_state(model, opt)
    ckpt = ub.Checkpointer(path, model=model, optimizer=opt, async_save=mode)
    ckpt.save(2)
    if mode == "overlap":  # the shards (parameters, moments) are copied late, not in save()
        late = ckpt._saver._copy.live  # each parameter and its exp_avg, exp_avg_sq, step
        assert len(late) == 4 * len(list(model.parameters())), sorted(late)
    models.train_steps(model, opt, 3, rank=rank, start=2)  # FSDP collectives meanwhile
    ckpt.close()
    fresh, fresh_opt = models.build(seed=3, fsdp_mesh=mesh)
    report = ub.Checkpointer(path, model=fresh, optimizer=fresh_opt).restore()
    assert report.step == 2 and report.verified
    got = models.full_state(fresh, fresh_opt)
    return {"want": want, "got": got} if rank == 0 else None


@pytest.mark.parametrize("mode", [True, "overlap"])
def test_async_save_with_fsdp2_restores_the_staged_state(tmp_path, mode):
    """With "overlap" the copy of the shards runs while the next steps' FSDP collectives
    do, and each rank's optimizer waits for its own copy before changing its shards."""
    result = launcher.run(_async_then_restore, 2, str(tmp_path / "ckpt"), mode)[0]
    want, got = result["want"], result["got"]
    for k, t in want["model"].items():
        assert torch.equal(got["model"][k], t), k
    for fqn, entries in want["optimizer"].items():
        for name, t in entries.items():
            assert torch.equal(got["optimizer"][fqn][name], t), (fqn, name)


def _edit_on_one_rank(rank: int, world: int, path: str) -> list[int]:
    from torch.distributed.device_mesh import init_device_mesh

    import unbroken as ub

    mesh = init_device_mesh("cpu", (world,))
    model, opt = models.build(fsdp_mesh=mesh)
    models.train_steps(model, opt, 1, rank=rank)
    ckpt = ub.Checkpointer(path, model=model, optimizer=opt, async_save="overlap")
    ckpt.save(1)
    if rank == 1:  # weight surgery on one rank's shard, outside an optimizer step
        with torch.no_grad():
            next(iter(model.parameters())).to_local().mul_(2)
    models.train_steps(model, opt, 1, rank=rank, start=1)
    with pytest.raises(ub.CheckpointError, match=r"step 1 was not saved"):
        ckpt.wait()  # on both ranks: the refusal is agreed before anything is written
    ckpt.close()
    return ckpt.steps()


def test_a_refused_overlapped_copy_on_one_rank_stops_the_save_on_every_rank(tmp_path):
    assert launcher.run(_edit_on_one_rank, 2, str(tmp_path / "ckpt")) == [[], []]
