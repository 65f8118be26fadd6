"""A small, learnable FSDP2 run for the many-nodes test: one process per torchrun agent.

    python many_nodes_train.py --out OUT DIR [DIR ...] --steps N
        trains N steps, saves step N into each DIR (one Checkpointer per folder)
    python many_nodes_train.py --out OUT DIR --resume
        restores DIR's latest checkpoint into a model initialised differently

Either way rank 0 writes OUT/full.pt, the gathered (unsharded) model and optimizer state
after the save or the restore, and every rank writes OUT/rank_R.json: its losses (a
save) or its restore report (a resume). A DIR is a local folder or an object store's URL.
The mesh is every rank of the job (``init_device_mesh("cpu", (world,))``), whichever
agent (node) started it; the per-rank RNG state cannot be mapped onto another world
size, so a resume starts it fresh on purpose (``reset={"rng"}``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

import unbroken as ub

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the scripts' helpers
from training_scripts import end_process, sharded_regression, sharded_step

WIDTH = 13  # 13 rows shard unevenly over 2 and 3 ranks (7+6, 5+5+3)


def build(world: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    model, opt = sharded_regression(world, seed, WIDTH)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    return model, opt, sched


def train(model, opt, sched, steps: int, rank: int) -> list[float]:
    """y = sum(sin(x)): each rank draws its own batch of each step."""
    losses = []
    for step in range(steps):
        losses.append(sharded_step(model, opt, step, rank))
        sched.step()
    return losses


def write_full_state(model, opt, out: Path, rank: int) -> None:
    """The unsharded state gathered onto rank 0 (collective), saved there."""
    msd, osd = get_state_dict(
        model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank == 0:
        torch.save({"model": msd, "optimizer": osd}, out / "full.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dirs", nargs="+")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.resume:
        (folder,) = args.dirs
        model, opt, sched = build(world, seed=123)  # another init: the restore must win
        with ub.Checkpointer(folder, model=model, optimizer=opt, scheduler=sched) as ckpt:
            report = ckpt.restore(reset={"rng"}, require=True)
        record = {**dataclasses.asdict(report), "last_epoch": sched.last_epoch}
    else:
        model, opt, sched = build(world, seed=0)
        losses = train(model, opt, sched, args.steps, rank)
        for folder in args.dirs:
            with ub.Checkpointer(folder, model=model, optimizer=opt, scheduler=sched) as ckpt:
                ckpt.save(args.steps)
        record = {"losses": losses, "last_epoch": sched.last_epoch}
    write_full_state(model, opt, args.out, rank)
    record.update(rank=rank, world=world, node=int(os.environ["GROUP_RANK"]))
    (args.out / f"rank_{rank}.json").write_text(json.dumps(record))
    dist.barrier()


if __name__ == "__main__":
    main()
    end_process()
