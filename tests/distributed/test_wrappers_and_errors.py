"""DDP and FSDP2 checkpoints restore into differently wrapped models; errors reach every
rank (no rank hangs in a collective while another raises)."""

from __future__ import annotations

import pytest
import torch

from . import launcher, models

pytestmark = pytest.mark.distributed


def _save_ddp(rank: int, world: int, path: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import unbroken as ub

    model, _ = models.build()
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    models.train_steps(ddp, opt, 3, rank=rank)
    ub.Checkpointer(path, model=ddp, optimizer=opt).save(3)
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": {n: dict(opt.state[p]) for n, p in model.named_parameters()},
    }


def _restore_fsdp(rank: int, world: int, path: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import unbroken as ub

    model, opt = models.build(seed=5, fsdp_mesh=init_device_mesh("cpu", (world,)))
    report = ub.Checkpointer(path, model=model, optimizer=opt).restore()
    full = models.full_state(model, opt)
    return {"report": report, "full": full if rank == 0 else None}


def test_ddp_checkpoint_restores_into_fsdp2_and_into_a_plain_model(tmp_path):
    """F3: the DDP prefix ``module.`` must not orphan state when the wrapping changes."""
    path = str(tmp_path / "ckpt")
    want = launcher.run(_save_ddp, 2, path)[0]
    got = launcher.run(_restore_fsdp, 2, path)
    # Whole tensors saved, halves restored: another layout on the same world size.
    assert all(r["report"].verified and r["report"].resharded for r in got)
    full = got[0]["full"]
    for k, t in want["model"].items():
        assert torch.equal(full["model"][k], t), k
    for fqn, entries in want["optimizer"].items():
        for name, t in entries.items():
            assert torch.equal(full["optimizer"][fqn][name], t), (fqn, name)

    import unbroken as ub

    model, opt = models.build(seed=9)
    ub.Checkpointer(path, model=model, optimizer=opt).restore(reset={"rng"})
    for k, t in want["model"].items():
        assert torch.equal(model.state_dict()[k], t), k


def _save_fsdp_then_corrupt_then_restore(rank: int, world: int, path: str) -> str:
    from pathlib import Path

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import unbroken as ub

    mesh = init_device_mesh("cpu", (world,))
    model, opt = models.build(fsdp_mesh=mesh)
    models.train_steps(model, opt, 2, rank=rank)
    ub.Checkpointer(path, model=model, optimizer=opt).save(2)
    dist.barrier()
    if rank == 0:
        shard = Path(path, "step_00000002", "rank_00001.bin")
        data = bytearray(shard.read_bytes())
        data[10] ^= 0xFF
        shard.write_bytes(bytes(data))
    dist.barrier()
    fresh, fresh_opt = models.build(seed=1, fsdp_mesh=mesh)
    try:
        ub.Checkpointer(path, model=fresh, optimizer=fresh_opt).restore()
    except ub.CorruptCheckpointError as exc:
        return str(exc)
    return "no error"


def test_corrupt_shard_raises_on_every_rank(tmp_path):
    messages = launcher.run(_save_fsdp_then_corrupt_then_restore, 2, str(tmp_path / "c"))
    for message in messages:
        assert "rank_00001.bin" in message and "checksum" in message, message


def _probe_keeps_fsdp_sharded(rank: int, world: int, path: str) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh

    import unbroken as ub

    mesh = init_device_mesh("cpu", (world,))
    model, opt = models.build(fsdp_mesh=mesh)
    models.train_steps(model, opt, 1, rank=rank)
    x = torch.ones(2, 13)
    ckpt = ub.Checkpointer(path, model=model, optimizer=opt, probe=lambda m: m(x).sum())
    ckpt.save(1)
    fresh, fresh_opt = models.build(seed=2, fsdp_mesh=mesh)
    ub.Checkpointer(path, model=fresh, optimizer=fresh_opt, probe=lambda m: m(x).sum()).restore()
    return [type(p).__name__ for p in [*model.parameters(), *fresh.parameters()]]


def test_probe_leaves_fsdp2_parameters_sharded(tmp_path):
    """A probe is a forward without backward: FSDP2 would leave the root unsharded, and an
    optimizer built from model.parameters() after restore would hold temporaries."""
    for kinds in launcher.run(_probe_keeps_fsdp_sharded, 2, str(tmp_path / "ckpt")):
        assert set(kinds) == {"DTensor"}, kinds
