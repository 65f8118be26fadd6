"""Lightning: one training script, resumed by Lightning's own checkpoints or by unbroken's.

    python benchmarks/compared/lightning_run.py DIR --resume own|unbroken [--steps 40]

The same training both ways (``shared.py``), from a torchdata ``StatefulDataLoader``
(Lightning saves its position in its checkpoints); a step is ``trainer.global_step``.

- ``own``: ``ModelCheckpoint(every_n_train_steps=...)`` writes ``DIR/ckpt/*.ckpt``; at
  start the newest one is given to ``trainer.fit(..., ckpt_path=...)``.
- ``unbroken``: ``UnbrokenCallback(DIR/ckpt, every_n_steps=...)``; ``fit()`` with no
  ``ckpt_path`` (the callback restores its newest checkpoint).
"""

from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path

import lightning as L
import shared
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader


class Regressor(L.LightningModule):
    def __init__(self, rows: int) -> None:
        super().__init__()
        self.rows = rows
        self.net = shared.mlp()

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> dict:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)
        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": shared.warmup(opt), "interval": "step"},
        }

    def train_dataloader(self) -> StatefulDataLoader:
        data = TensorDataset(*shared.rows(self.rows))
        return StatefulDataLoader(data, batch_size=shared.BATCH_SIZE, shuffle=True)


class LogLoss(L.Callback):
    """Logs each optimizer step's inputs and loss (the mean of its micro-batches')."""

    def __init__(self, run_dir: Path) -> None:
        self.steps = shared.StepLog(run_dir)
        self.pending: list[torch.Tensor] = []
        self.step = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.pending:  # a step's first micro-batch (after any restore)
            self.step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.saw(batch[0])
        self.pending.append(outputs["loss"].detach())
        if trainer.global_step != self.step:  # this batch ended an optimizer step
            self.steps.step(trainer.global_step, torch.stack(self.pending).mean().item())
            self.pending.clear()


class StopAt(L.Callback):
    """The own recipe's stop: at step K, ``ModelCheckpoint`` (which Lightning runs after
    every other callback) saves, or, off its schedule, this does; then ``fit()`` ends."""

    def __init__(self, step: int, folder: Path, every: int) -> None:
        self.stop, self.folder, self.every = step, folder, every

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.stop:
            if self.stop % self.every:
                trainer.save_checkpoint(self.folder / f"stop-step={self.stop}.ckpt")
            trainer.should_stop = True


def newest(folder: Path) -> str | None:
    """The Lightning checkpoint of the highest step in ``folder`` (None: none yet)."""
    found = [(int(m[1]), p) for p in folder.glob("*.ckpt")
             if (m := re.search(r"step=(\d+)", p.name))]  # fmt: skip
    return str(max(found)[1]) if found else None


def main() -> None:
    args = shared.options(__doc__).parse_args()
    torch.set_num_threads(1)  # one reduction order, whatever the machine's load
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    own = args.resume == "own"
    folder = args.dir / "ckpt"
    L.seed_everything(0, verbose=False)
    if own:
        stop = shared.stop_step()
        every = ModelCheckpoint(dirpath=folder, every_n_train_steps=args.every, save_top_k=-1)
        resume = [every, *([StopAt(stop, folder, args.every)] if stop else [])]
    else:  # imported here: the own recipe's runs never load unbroken
        from unbroken.integrations.lightning import UnbrokenCallback

        resume = [UnbrokenCallback(folder, every_n_steps=args.every)]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.steps,
        accumulate_grad_batches=args.accumulate,
        gradient_clip_val=1.0,
        callbacks=[LogLoss(args.dir), *resume],
        enable_checkpointing=own,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = Regressor(args.rows)
    trainer.fit(module, ckpt_path=newest(folder) if own else None)
    if trainer.global_step == args.steps:
        shared.write_final(args.dir, module, trainer.optimizers[0])


if __name__ == "__main__":
    main()
