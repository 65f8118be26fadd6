"""HF Trainer: one training script, resumed by the Trainer's own checkpoints or by unbroken's.

    python benchmarks/compared/trainer_run.py DIR --resume own|unbroken [--steps 40]

The same training both ways (``shared.py``; the Trainer's own sampler and a linear
schedule with warm-up). The logged loss is the Trainer's own (what reaches ``on_log``),
every step's by default (``--logging-steps 1``).

- ``own``: ``save_steps`` writes ``DIR/ckpt/checkpoint-N``; at start the newest one
  (``get_last_checkpoint``) is given to ``trainer.train(resume_from_checkpoint=...)``.
- ``unbroken``: ``UnbrokenTrainer`` with ``UnbrokenCallback(DIR/ckpt)``; ``train()``
  resumes from the callback's newest checkpoint by itself.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here downloads anything

import shared
import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint


class Regressor(nn.Module):
    """Returns ``{"loss": ...}`` as the Trainer expects of a model given ``labels``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = shared.mlp()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": nn.functional.mse_loss(self.net(x), labels)}


class Rows(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.x, self.y = shared.rows(n)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class LogLoss(TrainerCallback):
    """Writes each step's inputs (seen by a forward pre-hook) and each loss the Trainer
    logs, at its step."""

    def __init__(self, run_dir, model: nn.Module) -> None:
        self.steps = shared.StepLog(run_dir)
        model.register_forward_pre_hook(self._saw, with_kwargs=True)

    def _saw(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.steps.saw(kwargs["x"])

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self.steps.step(state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        if logs and "loss" in logs:
            self.steps.loss(state.global_step, logs["loss"])


class StopAt(TrainerCallback):
    """The own recipe's stop: at step K the Trainer saves, then ``train()`` ends."""

    def __init__(self, step: int | None) -> None:
        self.stop = step

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if state.global_step == self.stop:
            control.should_save = True
            control.should_training_stop = True


def main() -> None:
    parser = shared.options(__doc__)
    parser.add_argument("--logging-steps", type=int, default=1, help="log every this many steps")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one reduction order, whatever the machine's load
    own = args.resume == "own"
    folder = args.dir / "ckpt"
    settings = TrainingArguments(
        output_dir=str(folder if own else args.dir / "hf-output"),
        max_steps=args.steps,
        per_device_train_batch_size=shared.BATCH_SIZE,
        gradient_accumulation_steps=args.accumulate,
        learning_rate=1e-2,
        weight_decay=0.01,
        lr_scheduler_type="linear",
        warmup_steps=5,
        max_grad_norm=1.0,
        logging_steps=args.logging_steps,
        save_strategy="steps",
        save_steps=args.every,
        seed=0,
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
    )
    torch.manual_seed(0)  # the initial weights
    model = Regressor()
    callbacks: list[TrainerCallback] = [LogLoss(args.dir, model)]
    if own:
        trainer = Trainer(model=model, args=settings, train_dataset=Rows(args.rows),
                          callbacks=[*callbacks, StopAt(shared.stop_step())])  # fmt: skip
        last = get_last_checkpoint(str(folder)) if folder.is_dir() else None
        trainer.train(resume_from_checkpoint=last)
    else:  # imported here: the own recipe's runs never load unbroken
        from unbroken.integrations.transformers import UnbrokenCallback, UnbrokenTrainer

        trainer = UnbrokenTrainer(model=model, args=settings, train_dataset=Rows(args.rows),
                                  callbacks=[*callbacks, UnbrokenCallback(folder)])  # fmt: skip
        trainer.train()
    if trainer.state.global_step == args.steps:
        shared.write_final(args.dir, trainer.model, trainer.optimizer)


if __name__ == "__main__":
    main()
