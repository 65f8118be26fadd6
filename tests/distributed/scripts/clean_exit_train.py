"""A plain FSDP2 job under torchrun on gloo that saves, restores and simply returns from
main: no ``os._exit`` (issue 29, item 12). Its exit status must be 0 every time.

    torchrun --nproc-per-node 2 clean_exit_train.py DIR [--steps N] [--async-save]

Trains a tiny model ``--steps`` steps, saving every step, closes the Checkpointer, then
builds a second model and optimizer, restores the newest checkpoint into them and closes
that Checkpointer too; destroys the process group and returns.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import unbroken as ub


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--async-save", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, opt = build()
    ckpt = ub.Checkpointer(args.dir, model=model, optimizer=opt, async_save=args.async_save)
    start = ckpt.restore().step
    for step in range(start, args.steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(4, 8, generator=g)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ckpt.track(step + 1, loss=loss.detach())
        ckpt.save(step + 1)
    ckpt.close()
    model, opt = build()
    ckpt = ub.Checkpointer(args.dir, model=model, optimizer=opt)
    restored = ckpt.restore().step
    assert restored == max(args.steps, start), restored
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
