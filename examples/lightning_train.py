"""A small Lightning run that resumes exactly through ``UnbrokenCallback``.

    python examples/lightning_train.py DIR [--steps 40] [--devices 2] [--every 10]

An MLP with dropout learns a smooth function of 8 inputs (the loss falls); the data is
shuffled every epoch, AdamW's learning rate warms up per step. ``--devices 2`` trains with
``strategy="ddp"`` on two CPU processes (gloo). Stop it with SIGTERM or
``UNBROKEN_STOP_AT=K`` and run it again: it resumes mid-epoch from DIR.

    unbroken resume-test --stop-at 20 -- python examples/lightning_train.py {dir}
"""

from __future__ import annotations

import argparse
import gc
import logging
import random
import warnings

import lightning as L
import numpy as np
import torch
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from unbroken.integrations.lightning import UnbrokenCallback


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 1))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return (self.net(x) - y).pow(2).mean()

    def configure_optimizers(self) -> dict:
        opt = torch.optim.AdamW(self.parameters(), lr=2e-2, weight_decay=0.01)
        warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}

    def train_dataloader(self) -> StatefulDataLoader:
        g = torch.Generator().manual_seed(1234)
        x = torch.randn(512, 8, generator=g)
        y = torch.sin(x).sum(dim=1, keepdim=True) + 0.5 * x[:, :1] * x[:, 1:2]
        data = TensorDataset(x, y)
        # A fresh permutation every epoch (Lightning calls set_epoch), each data-parallel
        # rank its share: Lightning's data-parallel rank and size (under tensor parallelism
        # not the global ones: a tensor-parallel group must see the same batches).
        shard = self.trainer.distributed_sampler_kwargs or {"num_replicas": 1, "rank": 0}
        sampler = DistributedSampler(data, **shard, shuffle=True, seed=7)
        return StatefulDataLoader(data, batch_size=16, sampler=sampler)


def seed() -> None:
    torch.set_num_threads(1)  # a fixed reduction order whatever the machine's load
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)


def make_trainer(
    ckpt_dir: str, *, steps: int = 40, devices: int = 1, every: int = 10, callbacks: list = ()
) -> L.Trainer:
    """The Trainer, quiet and CPU-only, with the callback: the lines a user adds."""
    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        max_steps=steps,
        callbacks=[UnbrokenCallback(ckpt_dir, every_n_steps=every), *callbacks],
        use_distributed_sampler=False,  # the module shards and shuffles itself
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--every", type=int, default=10)
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*set_vital")
    seed()
    trainer = make_trainer(args.dir, steps=args.steps, devices=args.devices, every=args.every)
    trainer.fit(Regressor())
    if torch.distributed.is_initialized():
        # Lightning destroys the gloo group only at interpreter exit: destroy it now, with
        # DDP's reducer gone first (destroying the group under it can hang in gloo,
        # pytorch/pytorch#56297).
        del trainer
        gc.collect()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
