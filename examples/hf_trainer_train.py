"""A Hugging Face Trainer run checkpointed by unbroken: stop it anywhere, resume it exactly.

    python examples/hf_trainer_train.py DIR [--steps 40] [--save-steps 10]
    unbroken resume-test --stop-at 20 -- python examples/hf_trainer_train.py {dir}

A tiny regression network with dropout learns y = sum(sin(x)) + x0*x1 from 512 rows,
shuffled by the Trainer's own sampler (32 batches an epoch, so step 20 is mid-epoch), with
AdamW and a linear schedule with warm-up, on CPU. Compared with a plain Trainer script,
two things change: ``UnbrokenTrainer`` in place of ``Trainer``, and the callback.
Under torchrun it trains with DDP (gloo), each rank on its share of every batch.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here downloads anything

import torch
from torch import nn
from transformers import TrainingArguments

from unbroken.integrations.transformers import UnbrokenCallback, UnbrokenTrainer


class Regressor(nn.Module):
    """Returns {"loss": ...} as the Trainer expects of a model given ``labels``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": (self.net(x) - labels).pow(2).mean()}


class Rows(torch.utils.data.Dataset):
    def __init__(self, n: int = 512) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.sin(self.x).sum(dim=1, keepdim=True) + 0.5 * self.x[:, :1] * self.x[:, 1:2]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


def build_trainer(ckpt_dir: str, steps: int, save_steps: int, **overrides) -> UnbrokenTrainer:
    settings = dict(
        output_dir=os.path.join(ckpt_dir, "hf-output"),  # the Trainer writes nothing here
        max_steps=steps,
        per_device_train_batch_size=16,
        learning_rate=2e-2,
        weight_decay=0.01,
        lr_scheduler_type="linear",
        warmup_steps=5,
        max_grad_norm=1.0,
        logging_steps=1,  # the loss and grad norm of every step reach the callback
        save_strategy="steps",
        save_steps=save_steps,
        seed=0,
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
        ddp_find_unused_parameters=False,  # under torchrun: every parameter has a gradient
    )
    args = TrainingArguments(**{**settings, **overrides})
    torch.manual_seed(0)  # the initial weights
    model = Regressor()
    return UnbrokenTrainer(
        model=model, args=args, train_dataset=Rows(), callbacks=[UnbrokenCallback(ckpt_dir)]
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-steps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)  # a fixed reduction order whatever the machine's load
    build_trainer(args.dir, args.steps, args.save_steps).train()


if __name__ == "__main__":
    main()
