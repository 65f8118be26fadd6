"""Layouts beyond one dimension under torchrun on gloo: a script for ``unbroken
resume-test`` (issue 28).

    torchrun --nproc-per-node 4 nd_train.py DIR --layout tp|ep|hsdp|pp[,...] [--steps N]

tp: FSDP2 + tensor parallel on ("dp", "tp") = (world // 2, 2); ep: FSDP2 + expert
parallel on ("dp", "ep"); hsdp: FSDP2 on ("replicate", "shard") = (2, world // 2); pp:
one pipeline stage per rank (GPipe). A learnable task (y = sum of sin(x)); the loss
tracked is the same on every rank (the mean over ranks; pp: the last stage's). Several
layouts (``--layout tp,hsdp,pp``) train one after another in one job, each from seed 0
with its own model, mesh and Checkpointer in DIR/<layout> (one launch instead of three:
CI time); each stops at ``UNBROKEN_STOP_AT`` and the next layout starts.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import unbroken as ub
from distributed import moe_models, pp_models, tp_models
from training_scripts import end_process, end_step


def _hsdp(world: int):
    """The TP test's stack under FSDP2 HSDP: sharded within 2-rank groups, replicated
    across them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, _ = tp_models.build(0)
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train(layout: str, folder: str, steps: int, rank: int, world: int) -> None:
    """One layout from its checkpoint in ``folder`` (if any) to step ``steps``, or to the
    stop that ``UNBROKEN_STOP_AT`` asks for."""
    dp = world // 2
    sched = None
    if layout == "tp":
        model, opt = tp_models.build(0, dp=dp, tp=2)
    elif layout == "ep":
        model, opt = moe_models.build(0, dp=dp, ep=2)
    elif layout == "hsdp":
        model, opt = _hsdp(world)
    else:
        model, opt = pp_models.build(0, rank, world)
        sched = pp_models.schedule(model, rank, world)
    ckpt = ub.Checkpointer(folder, model=model, optimizer=opt)
    start = ckpt.restore().step
    for step in range(start, steps):
        if sched is not None:
            losses = pp_models.train(model, opt, sched, 1, start=step, stage=rank, stages=world)
            loss = torch.tensor(losses[0] if losses else 0.0)
            dist.broadcast(loss, src=world - 1)
            ckpt.track(step + 1, loss=loss)
        else:
            g = torch.Generator().manual_seed(1000 * step + rank // 2)
            x = torch.randn(4, tp_models.WIDTH, generator=g)
            y = torch.sin(x).sum(1, keepdim=True)
            loss = (model(x) - y).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            ckpt.track(step + 1, loss=mean / world)
        if end_step(ckpt, step + 1, last=steps):
            break
    ckpt.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument(
        "--layout", required=True, help="one of tp, ep, hsdp, pp, or several: tp,pp"
    )
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    layouts = args.layout.split(",")
    if not set(layouts) <= {"tp", "ep", "hsdp", "pp"} or len(set(layouts)) != len(layouts):
        parser.error(f"--layout: tp, ep, hsdp or pp, each at most once; got {args.layout}")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for layout in layouts:
        folder = args.dir if len(layouts) == 1 else os.path.join(args.dir, layout)
        train(layout, folder, args.steps, rank, world)
        dist.barrier()


if __name__ == "__main__":
    main()
    end_process()
