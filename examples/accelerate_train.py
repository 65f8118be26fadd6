"""Hugging Face Accelerate + unbroken: a small regression that resumes exactly.

    python examples/accelerate_train.py ckpts/run1
    accelerate launch --cpu --num_processes 2 examples/accelerate_train.py ckpts/run1

    unbroken resume-test --stop-at 20 -- python examples/accelerate_train.py {dir}

Everything a lost piece of state would show in is here: dropout (RNG), a shuffled loader
resumed mid-epoch (data position and epoch), AdamW (moments), a warm-up scheduler, and
gradient accumulation (``accelerator.step``). One step is one optimizer step; a save
happens only there, where no gradient is half accumulated. CPU, a few seconds.
"""

from __future__ import annotations

import argparse
import gc

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch import nn

from unbroken.integrations.accelerate import checkpointer_for


def dataset() -> torch.utils.data.TensorDataset:
    """512 rows of y = sum(sin(x)) + x0*x1/2: a function the model learns (the loss falls)."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(512, 8, generator=g)
    y = torch.sin(x).sum(dim=1, keepdim=True) + 0.5 * x[:, :1] * x[:, 1:2]
    return torch.utils.data.TensorDataset(x, y)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", help="checkpoint folder")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--gpu", action="store_true", help="train on the launcher's GPUs")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)  # one reduction order, whatever the machine's load
    accelerator = Accelerator(
        cpu=not args.gpu,
        gradient_accumulation_steps=args.accumulate,
        # A stateful loader (its position can be saved) with a shuffle seeded by epoch.
        dataloader_config=DataLoaderConfiguration(
            use_stateful_dataloader=True, use_seedable_sampler=True
        ),
    )
    set_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Dropout(0.1), nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    loader = torch.utils.data.DataLoader(dataset(), batch_size=16, shuffle=True)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)

    ckpt = checkpointer_for(accelerator, args.dir)
    step = ckpt.restore().step
    model.train()
    losses: list[torch.Tensor] = []
    mean_loss = torch.tensor(float("nan"))
    while step < args.steps and not ckpt.should_stop(step):
        for x, y in loader:  # after a restore: the rest of the interrupted epoch
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad()
            losses.append(loss.detach())
            if not accelerator.sync_gradients:
                continue
            step += 1
            mean_loss = accelerator.reduce(torch.stack(losses).mean(), "mean")
            losses.clear()
            ckpt.track(step, loss=mean_loss, grad_norm=grad_norm)
            if step % 10 == 0 or ckpt.should_stop(step):
                ckpt.save(step)
            if step == args.steps or ckpt.should_stop(step):
                break
    if accelerator.is_main_process:
        print(f"step {step}: loss {mean_loss.item():.4f}")
    ckpt.close()


if __name__ == "__main__":
    main()
    # DDP's reducer must be gone before the process group: destroying it first can hang
    # in gloo (pytorch/pytorch#56297), so main() has returned and we collect first.
    gc.collect()
    PartialState().destroy_process_group()
