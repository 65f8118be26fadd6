"""Save step 1, then start an async save of step 2 whose write is slowed down; print
``returned`` once save(2) has returned, and wait to be killed."""

from __future__ import annotations

import sys
import time

import torch
from torch import nn

import unbroken as ub
from unbroken.format import shard_writer

original = shard_writer.ShardWriter.write_data


def slow_write(self, plan, planner):
    time.sleep(0.5)
    return original(self, plan, planner)


def main() -> None:
    model = nn.Linear(64, 64)
    ckpt = ub.Checkpointer(sys.argv[1], model=model, async_save=True)
    with torch.no_grad():
        model.weight.fill_(1)
    ckpt.save(1)
    ckpt.wait()
    shard_writer.ShardWriter.write_data = slow_write
    with torch.no_grad():
        model.weight.fill_(2)
    ckpt.save(2)
    print("returned", flush=True)
    time.sleep(60)


if __name__ == "__main__":
    main()
