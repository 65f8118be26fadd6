"""Lightning's FSDP strategies on CPU/gloo, resumed through ``UnbrokenCallback``.

    torchrun --nproc_per_node N fsdp_lightning_train.py DIR --fsdp 0|1|2 --devices N
        [--steps 12] [--reset] [--dump FOLDER]

``--fsdp 1``: ``FSDPStrategy`` (FSDP1, Lightning's default ``use_orig_params=True``), each
``Block`` its own unit. ``--fsdp 2``: ``ModelParallelStrategy`` with ``fully_shard`` on
each ``Block`` and the model in ``configure_model``, over the ``data_parallel`` mesh.
``--fsdp 0``: no FSDP (one device, or ``ddp``). Without torchrun, Lightning starts the
other processes itself.

``fsdp_common.Net`` (an MLP with dropout, widths that divide over no world size) learns
from a loader shuffled by a seeded ``DistributedSampler``; AdamW with a warm-up.
``--reset`` resumes with ``UnbrokenCallback(reset={"rng", "dataloader"})`` (another
world size). ``--dump`` has rank 0 write the gathered model and optimizer state (torch's
own ``get_state_dict``) after the restore (``restored-step<K>.pt``, with the report) and
when ``fit()`` ends (``end-step<N>.pt``, with each step's epoch and batch index), for the
tests to compare.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import warnings
from pathlib import Path

import fsdp_common
import lightning as L
import numpy as np
import torch
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from unbroken.integrations.lightning import UnbrokenCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the scripts' helpers
import training_scripts


class CPUFSDPStrategy(FSDPStrategy):
    """TEST-ONLY: ``FSDPStrategy`` on CPU, two things changed.

    1. Lightning 2.6 refuses ``type(strategy) is FSDPStrategy`` with ``accelerator="cpu"``
       (``_AcceleratorConnector._check_strategy_and_fallback``); a subclass is not checked.
    2. ``FSDPStrategy._setup_model`` passes ``device_id=root_device.index``, None on the
       CPU, and torch's FSDP1 then looks for an accelerator and raises ("FSDP needs a
       non-CPU accelerator device", ``_init_device_handle``). Here the same wrapper is
       made with the strategy's own settings and ``device_id=cpu``; Lightning's
       ``_setup_model`` then sees the wrapped model and does the rest (it drops its
       ``auto_wrap_policy``, already applied).
    """

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(
            model,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),
            **self.kwargs,
        )
        return super()._setup_model(model)


class Regressor(L.LightningModule):
    def __init__(self, fsdp: int) -> None:
        super().__init__()
        self.fsdp = fsdp
        self.net = fsdp_common.Net()

    def configure_model(self) -> None:
        if self.fsdp != 2:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.net.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return (self.net(x) - y).pow(2).mean()

    def configure_optimizers(self) -> dict:
        opt = torch.optim.AdamW(self.parameters(), lr=2e-2, weight_decay=0.01)
        warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}

    def train_dataloader(self) -> StatefulDataLoader:
        data = fsdp_common.dataset()
        sampler = DistributedSampler(
            data,
            num_replicas=self.trainer.world_size,
            rank=self.trainer.global_rank,
            shuffle=True,
            seed=7,
        )
        return StatefulDataLoader(data, batch_size=16, sampler=sampler)


class Dump(L.Callback):
    """Rank 0 writes the gathered state after the restore and when ``fit()`` ends (after
    ``UnbrokenCallback``, listed before it, has restored or saved)."""

    def __init__(self, folder: str | None, unbroken: UnbrokenCallback) -> None:
        self.folder = folder
        self.unbroken = unbroken
        self.positions: dict[int, tuple[int, int]] = {}  # step -> (epoch, batch_idx)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.positions[trainer.global_step + 1] = (trainer.current_epoch, batch_idx)

    def _state(self, trainer: L.Trainer) -> dict:
        return {
            "lr": [g["lr"] for g in trainer.optimizers[0].param_groups],
            "global_step": trainer.global_step,
            "wrapped": type(trainer.model).__name__,
            "parameters": fsdp_common.parameter_kinds(trainer.optimizers[0]),
            **fsdp_common.full_state(trainer.model, trainer.optimizers),
        }

    def on_train_start(self, trainer, pl_module) -> None:
        report = self.unbroken.report
        if self.folder is not None and report.restored:
            payload = {"report": fsdp_common.report_fields(report), **self._state(trainer)}
            fsdp_common.write(self.folder, f"restored-step{report.step}", payload)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.folder is not None:
            payload = {"positions": self.positions, **self._state(trainer)}
            fsdp_common.write(self.folder, f"end-step{trainer.global_step}", payload)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("--fsdp", type=int, choices=(0, 1, 2), required=True, help="0: none")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--reset", action="store_true", help='reset={"rng", "dataloader"}')
    parser.add_argument("--dump")
    args = parser.parse_args(argv)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)

    unbroken = UnbrokenCallback(args.dir, reset={"rng", "dataloader"} if args.reset else ())
    if args.fsdp == 1:
        strategy = CPUFSDPStrategy(auto_wrap_policy={fsdp_common.Block})
    elif args.fsdp == 2:
        strategy = ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1)
    else:
        strategy = "ddp" if args.devices > 1 else "auto"
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.steps,
        callbacks=[unbroken, Dump(args.dump, unbroken)],
        use_distributed_sampler=False,  # the module shards and shuffles itself
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regressor(args.fsdp))


if __name__ == "__main__":
    main()
    training_scripts.end_process()
