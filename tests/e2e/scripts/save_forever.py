"""Save checkpoints in a loop until killed; the state of step N is all ``N``s.

    python save_forever.py DIR            (one process, or one rank under RANK/WORLD_SIZE)

Prints ``saved N`` after each committed save, for the parent to time its kill.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import unbroken as ub


def main() -> None:
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(256, 256) for _ in range(16)))  # ~4 MB of weights
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    ckpt = ub.Checkpointer(sys.argv[1], model=model, optimizer=opt, keep_last=2)
    step = ckpt.restore(reset={"rng"}).step
    while True:
        step += 1
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(step)
                opt.state[p]["exp_avg"].fill_(step)
        ckpt.save(step)
        print(f"saved {step}", flush=True)


if __name__ == "__main__":
    main()
