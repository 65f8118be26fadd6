"""Accelerate: one training script, resumed by Accelerate's own recipe or by unbroken's.

    python benchmarks/compared/accelerate_run.py DIR --resume own|unbroken [--steps 40]

The same training both ways (``shared.py``; ``accelerator.accumulate`` over the
micro-batches of a step, an optimizer step).

- ``own``: the recipe of accelerate's ``examples/by_feature/checkpointing.py``:
  ``accelerator.save_state(DIR/ckpt/step_N)`` every ``--every`` steps; at start the
  newest ``step_N`` folder is given to ``accelerator.load_state``, the epoch and the
  batches already done in it are derived from its name (steps times the accumulation:
  the example counts batches), and that epoch's first batches are skipped with
  ``accelerator.skip_first_batches``. ``--loader`` picks the Accelerator's loader
  settings: ``default`` (the example's), ``seedable`` (``use_seedable_sampler=True``), or
  ``stateful`` (``use_stateful_dataloader=True``: the loader's position comes back with
  ``load_state``, so, as in the example, nothing is skipped).
- ``unbroken``: ``checkpointer_for(accelerator, DIR/ckpt)`` with the two loader settings
  its docs ask for (a stateful loader, a seedable shuffle).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import shared
import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch import nn

LOADERS = {
    "default": DataLoaderConfiguration,
    "seedable": lambda: DataLoaderConfiguration(use_seedable_sampler=True),
    "stateful": lambda: DataLoaderConfiguration(use_stateful_dataloader=True),
    "unbroken": lambda: DataLoaderConfiguration(
        use_stateful_dataloader=True, use_seedable_sampler=True
    ),
}


class OwnResume:
    """Accelerate's documented resume: ``save_state`` / ``load_state``, then
    ``skip_first_batches`` (unless the loader is stateful), the position read from the
    checkpoint folder's name."""

    def __init__(self, accelerator: Accelerator, folder: Path, *, accumulate: int,
                 skip: bool) -> None:  # fmt: skip
        self.accelerator, self.folder, self.accumulate = accelerator, folder, accumulate
        self.skip_batches = skip
        self.skip = 0
        self.stop = shared.stop_step()

    def restore(self, batches_per_epoch: int) -> int:
        done = sorted(int(m[1]) for p in self.folder.glob("step_*")
                      if (m := re.fullmatch(r"step_(\d+)", p.name)))  # fmt: skip
        if not done:
            return 0
        self.accelerator.load_state(str(self.folder / f"step_{done[-1]}"))
        batches = done[-1] * self.accumulate
        epoch = batches // batches_per_epoch
        self.skip = batches - epoch * batches_per_epoch if self.skip_batches else 0
        return done[-1]

    def epoch(self, loader: Iterable) -> Iterable:
        if self.skip:  # the rest of the interrupted epoch, once
            skipped, self.skip = self.accelerator.skip_first_batches(loader, self.skip), 0
            return skipped
        return loader

    def save_due(self, step: int, every: int) -> bool:
        return step % every == 0 or step == self.stop

    def save(self, step: int) -> None:
        self.accelerator.save_state(str(self.folder / f"step_{step}"))

    def should_stop(self, step: int) -> bool:
        return step == self.stop

    def close(self) -> None:
        pass


class UnbrokenResume:
    """unbroken's integration: one Checkpointer over everything ``prepare`` saw."""

    def __init__(self, accelerator: Accelerator, folder: Path) -> None:
        # Imported here: the own recipe's runs never load unbroken.
        from unbroken.integrations.accelerate import checkpointer_for

        self.ckpt = checkpointer_for(accelerator, folder)

    def restore(self, batches_per_epoch: int) -> int:
        return self.ckpt.restore().step

    def epoch(self, loader: Iterable) -> Iterable:
        return loader  # the loader resumes mid-epoch by itself

    def save_due(self, step: int, every: int) -> bool:
        return step % every == 0 or self.ckpt.should_stop(step)

    def save(self, step: int) -> None:
        self.ckpt.save(step)

    def should_stop(self, step: int) -> bool:
        return self.ckpt.should_stop(step)

    def close(self) -> None:
        self.ckpt.close()


def main() -> None:
    parser = shared.options(__doc__)
    parser.add_argument("--loader", choices=("default", "seedable", "stateful"),
                        default="default", help="the own recipe's loader settings")  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(1)  # one reduction order, whatever the machine's load
    own = args.resume == "own"
    accelerator = Accelerator(
        cpu=True,
        gradient_accumulation_steps=args.accumulate,
        dataloader_config=LOADERS[args.loader if own else "unbroken"](),
    )
    set_seed(0)
    model = shared.mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = shared.warmup(opt)
    data = torch.utils.data.TensorDataset(*shared.rows(args.rows))
    loader = torch.utils.data.DataLoader(data, batch_size=shared.BATCH_SIZE, shuffle=True)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    folder = args.dir / "ckpt"
    if own:
        skip = args.loader != "stateful"  # a stateful loader's position comes back by itself
        resume = OwnResume(accelerator, folder, accumulate=args.accumulate, skip=skip)
    else:
        resume = UnbrokenResume(accelerator, folder)

    step = resume.restore(len(loader))
    log = shared.StepLog(args.dir)
    model.train()
    losses: list[torch.Tensor] = []
    while step < args.steps and not resume.should_stop(step):
        for x, y in resume.epoch(loader):
            log.saw(x)
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad()
            losses.append(loss.detach())
            if not accelerator.sync_gradients:
                continue
            step += 1
            log.step(step, torch.stack(losses).mean().item())
            losses.clear()
            if resume.save_due(step, args.every):
                resume.save(step)
            if step == args.steps or resume.should_stop(step):
                break
    if step == args.steps:
        shared.write_final(args.dir, accelerator.unwrap_model(model), opt)
    resume.close()


if __name__ == "__main__":
    main()
