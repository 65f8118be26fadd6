"""A small, learnable training script with the resumes that the proof tools must see
through (each flag is one case; without flags it resumes exactly).

    python resume_cases.py DIR [--steps N] [--save-every N] [CASE]

--overwrite            Checkpointer(overwrite=True): every launch starts fresh and never
                       resumes, though its metrics match a straight run's
--lost-counter         an extra's load_state_dict restores its running mean but not its
                       sample counter: the metrics stay identical, only the saved
                       (non-tensor) state shows it
--reseed-on-resume-from K
                       re-seeds torch when it resumes from step K only: with stops at an
                       earlier step and at K, a bug of the second resume alone
--unseeded             does not seed torch (torch >= 2.13 starts its generator from OS
                       entropy in every process): any two runs differ from the first step

Every checkpoint is kept (keep_last=None), so each stop step has a straight-run
checkpoint to compare with.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

import unbroken as ub

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the scripts' helpers
from training_scripts import end_step, regression_step


class Batches:
    """The data position: epoch and offset; each epoch's order from its own seed."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, size: int) -> None:
        self.x, self.y, self.size = x, y, size
        self.epoch, self.offset = 0, 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.offset + self.size > len(self.x):
            self.epoch, self.offset = self.epoch + 1, 0
        order = torch.randperm(len(self.x), generator=torch.Generator().manual_seed(self.epoch))
        rows = order[self.offset : self.offset + self.size]
        self.offset += self.size
        return self.x[rows], self.y[rows]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.offset = state["epoch"], state["offset"]


class Progress:
    """Samples seen and a running mean of the loss (an ``extra``)."""

    def __init__(self, lost_counter: bool) -> None:
        self.samples, self.mean_loss = 0, 0.0
        self.lost_counter = lost_counter

    def state_dict(self) -> dict:
        return {"samples": self.samples, "mean_loss": self.mean_loss}

    def load_state_dict(self, state: dict) -> None:
        self.mean_loss = state["mean_loss"]
        if not self.lost_counter:  # the bug: the counter starts again from zero
            self.samples = state["samples"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--lost-counter", action="store_true")
    parser.add_argument("--reseed-on-resume-from", type=int, default=None)
    parser.add_argument("--unseeded", action="store_true")
    args = parser.parse_args()

    torch.set_num_threads(1)  # a fixed reduction order whatever the machine's load
    if not args.unseeded:
        torch.manual_seed(0)
    g = torch.Generator().manual_seed(1234)  # the data: the same in every run
    x = torch.randn(256, 8, generator=g)
    y = torch.sin(x).sum(dim=1, keepdim=True)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    batches, progress = Batches(x, y, 16), Progress(args.lost_counter)
    ckpt = ub.Checkpointer(
        args.dir,
        model=model,
        optimizer=opt,
        scheduler=sched,
        dataloader=batches,
        extra={"progress": progress},
        keep_last=None,
        overwrite=args.overwrite,
    )
    start = ckpt.restore().step
    if start and start == args.reseed_on_resume_from:
        torch.manual_seed(0)  # the bug: the restored RNG state is lost
    for step in range(start, args.steps):
        xb, yb = batches.next()
        loss, grad_norm = regression_step(model, opt, sched, xb, yb)
        progress.samples += len(xb)
        progress.mean_loss += (loss.item() - progress.mean_loss) / (step + 1)
        ckpt.track(step + 1, loss=loss, grad_norm=grad_norm)
        if end_step(ckpt, step + 1, every=args.save_every):
            break
    ckpt.close()


if __name__ == "__main__":
    main()
