"""A plain Accelerate script with a training and an evaluation loader, resumed by unbroken.

Shaped like Accelerate's own ``examples/by_feature/checkpointing.py``: the evaluation loader
is prepared beside the training one and runs (with ``accelerator.gather``) at the end of
every epoch, and the script ends without tearing down the process group itself.

    python accelerate_eval_loader.py DIR [--loaders all|train] [--steps N] [--save-in-loop]

``--save-in-loop`` saves and stops inside the training loop as Accelerate's example does, on
an epoch's last step too: before that epoch's evaluation, which a resumed run must then
still run (the restored loader's next pass ends the epoch).
``--loaders train`` saves only the training loader's position (``dataloaders=[train]``); the
evaluation loader then starts each pass over, and must still leave every later random draw
(the dropout masks) where an uninterrupted run has it.
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch import nn

from unbroken.integrations.accelerate import checkpointer_for


def rows(n: int, seed: int) -> torch.utils.data.TensorDataset:
    """y = sum(sin(x)) + x0*x1/2: a function the model learns (the loss falls)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = torch.sin(x).sum(dim=1, keepdim=True) + 0.5 * x[:, :1] * x[:, 1:2]
    return torch.utils.data.TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("--loaders", choices=["all", "train"], default="all")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-in-loop", action="store_true")
    args = parser.parse_args()

    torch.set_num_threads(1)
    accelerator = Accelerator(
        cpu=True,
        gradient_accumulation_steps=2,
        dataloader_config=DataLoaderConfiguration(
            use_stateful_dataloader=True, use_seedable_sampler=True
        ),
    )
    set_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.2), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # 256 rows in batches of 16, two per step: 8 steps per epoch (on one process).
    train = torch.utils.data.DataLoader(rows(256, 1), batch_size=16, shuffle=True)
    evaluation = torch.utils.data.DataLoader(rows(64, 2), batch_size=32)
    model, opt, train, evaluation = accelerator.prepare(model, opt, train, evaluation)
    chosen = [train] if args.loaders == "train" else None
    ckpt = checkpointer_for(accelerator, args.dir, dataloaders=chosen)
    step = ckpt.restore().step

    while step < args.steps:  # one epoch a turn: the restored loader's next pass goes on
        model.train()
        for x, y in train:
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                opt.step()
                opt.zero_grad()
            if not accelerator.sync_gradients:
                continue
            step += 1
            ckpt.track(step, loss=loss)
            if accelerator.gradient_state.end_of_dataloader and not args.save_in_loop:
                continue  # the epoch ends here: evaluate first, then save or stop
            if step % 5 == 0 or ckpt.should_stop(step):
                ckpt.save(step)
            if step == args.steps or ckpt.should_stop(step):
                break
        else:  # the epoch ran to its end
            model.eval()
            total = torch.zeros(())
            with torch.no_grad():
                for x, y in evaluation:
                    total += accelerator.gather(nn.functional.mse_loss(model(x), y)).sum()
            ckpt.track(step, eval_loss=total)
            if step % 5 == 0 or ckpt.should_stop(step):
                ckpt.save(step)
        if step == args.steps or ckpt.should_stop(step):
            break
    ckpt.close()


if __name__ == "__main__":
    main()
