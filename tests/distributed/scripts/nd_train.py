"""FSDP2 + tensor parallel, or FSDP2 + expert parallel, under torchrun on gloo: a script
for ``unbroken resume-test`` (issue 28).

    torchrun --nproc-per-node 4 nd_train.py DIR --layout tp|ep [--steps N]

The mesh is ("dp", "tp") or ("dp", "ep") of (world // 2, 2). Each data-parallel rank
draws its own batches of a learnable task (y = sum of sin(x)); the loss tracked is the
mean over ranks, so every rank tracks the same value.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import unbroken as ub
from distributed import moe_models, tp_models


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("--layout", choices=("tp", "ep"), required=True)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dp = world // 2
    if args.layout == "tp":
        model, opt = tp_models.build(0, dp=dp, tp=2)
    else:
        model, opt = moe_models.build(0, dp=dp, ep=2)
    ckpt = ub.Checkpointer(args.dir, model=model, optimizer=opt)
    start = ckpt.restore().step
    for step in range(start, args.steps):
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
        if ckpt.should_stop(step + 1) or step + 1 == args.steps:
            ckpt.save(step + 1)
        if ckpt.should_stop(step + 1):
            break
    ckpt.close()


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
    # Everything is committed: skip finalization, where gloo's worker threads can abort
    # the process (docs/pitfalls.md).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
