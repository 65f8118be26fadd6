"""Train a tiny GPT on a synthetic word corpus, checkpointed and resumed with unbroken.

One process:
    python examples/gpt/train.py --ckpt-dir runs/a --steps 60 --save-every 20 --out runs/a.jsonl
Two ranks, sharded with FSDP2:
    torchrun --nproc_per_node 2 examples/gpt/train.py --fsdp --ckpt-dir runs/b ...

Run it again with the same arguments and it continues from the newest checkpoint,
exactly as if it had never stopped. ``UNBROKEN_STOP_AT=K`` makes it save at step K and
exit (as SIGTERM would). Rank 0 appends one JSON line of metrics per step to ``--out``.

``EXAMPLE_RESET_OPTIMIZER=1`` is deliberately wrong, for tests and demos only: after a
restore it builds a fresh AdamW (its moments lost), the classic silent resume bug.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

import unbroken as ub

sys.path.insert(0, str(Path(__file__).resolve().parent))
import data
from model import GPT, GPTConfig, loss_fn

RESET_OPTIMIZER_ENV = "EXAMPLE_RESET_OPTIMIZER"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt-dir", required=True, help="checkpoints of this run")
    p.add_argument("--steps", type=int, required=True, help="total optimizer steps")
    p.add_argument("--save-every", type=int, required=True, help="save every K steps")
    p.add_argument("--out", required=True, help="metrics file, JSON lines (appended)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--final-state", help="at the end, write full model+optimizer state here")
    p.add_argument("--fsdp", action="store_true", help="shard with FSDP2 (under torchrun)")
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--keep-last", type=int, default=3, help="checkpoints kept (0: all)")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--warmup", type=int, default=5, help="linear warm-up steps")
    p.add_argument("--windows", type=int, help="use only the first N windows (short epochs)")
    p.add_argument(
        "--data-dir", default=str(Path(__file__).resolve().parent / "data"), help="corpus cache"
    )
    return p.parse_args(argv)


class EpochSampler(StatefulDistributedSampler):
    """Shards and shuffles per epoch; its state (inside the loader's) includes the epoch,
    so a resume in a later epoch reshuffles with the right seed."""

    def state_dict(self) -> dict:
        return {**super().state_dict(), "epoch": self.epoch}

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self.epoch = state_dict["epoch"]


def batches(loader: StatefulDataLoader, sampler: EpochSampler):
    """Batches forever, epoch after epoch.

    One loader iterator is live at a time, so ``loader.state_dict()`` is always the
    position of the next batch. Start iterating only after ``restore()``: the first
    ``iter(loader)`` then continues from the restored position.
    """
    while True:
        yield from loader
        sampler.set_epoch(sampler.epoch + 1)


def build_optimizer(model: torch.nn.Module, args: argparse.Namespace, start: int = 0):
    """AdamW (weight decay on matrices only) and warm-up + cosine LR, from step ``start``."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))

    def lr_factor(i: int) -> float:  # of --lr: linear up to 1, cosine down to 0.1
        step = start + i
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)


def make_probe(dataset: data.TokenWindows, n: int = 8):
    """Loss on a fixed batch, without dropout: recorded at save, checked after restore."""
    x, y = (torch.stack(t) for t in zip(*(dataset[i] for i in range(n)), strict=True))

    def probe(model: torch.nn.Module) -> torch.Tensor:
        model.eval()
        try:
            with torch.no_grad():
                return loss_fn(model(x), y)
        finally:
            model.train()

    return probe


def train_step(model, opt, sched, batch, world: int) -> tuple[float, float, float]:
    """One optimizer step; returns (loss averaged over ranks, grad norm, LR used)."""
    x, y = batch
    lr = opt.param_groups[0]["lr"]
    loss = loss_fn(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    if isinstance(grad_norm, DTensor):
        grad_norm = grad_norm.full_tensor()
    loss = loss.detach()
    if world > 1:
        dist.all_reduce(loss)  # gloo sums in a fixed order: reproducible bit for bit
        loss = loss / world
    return loss.item(), grad_norm.item(), lr


def train(args: argparse.Namespace, rank: int, world: int) -> None:
    """Build everything, restore the newest checkpoint if any, and train to --steps."""
    distributed = world > 1
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)

    # data: every rank reads its own shard of the shuffled windows
    dataset = data.TokenWindows(data.prepare(args.data_dir), limit=args.windows)
    sampler = EpochSampler(dataset, num_replicas=world, rank=rank, seed=args.seed)
    # A private generator: each new loader iterator draws a seed from it, and drawing from
    # the global RNG instead would shift dropout masks after a resume by one draw.
    loader = StatefulDataLoader(
        dataset,
        batch_size=args.batch_size,
        sampler=sampler,
        drop_last=True,
        num_workers=0,
        generator=torch.Generator().manual_seed(args.seed),
    )

    # model: same initial weights on every rank (same seed), then sharded or replicated
    model = GPT(GPTConfig(vocab_size=data.VOCAB_SIZE, block_size=data.BLOCK_SIZE))
    if args.fsdp:
        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif distributed:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt, sched = build_optimizer(model, args)

    ckpt = ub.Checkpointer(
        args.ckpt_dir,
        model=model,
        optimizer=opt,
        scheduler=sched,
        dataloader=loader,
        keep_last=args.keep_last or None,
        probe=make_probe(dataset),
    )
    report = ckpt.restore()
    if rank == 0:
        print(report, file=sys.stderr)
    if report.restored and os.environ.get(RESET_OPTIMIZER_ENV) == "1":
        # The bug on purpose: fresh moments, LR schedule continued; the Checkpointer
        # still holds (and would save) the old optimizer.
        print(f"{RESET_OPTIMIZER_ENV}=1: optimizer state thrown away", file=sys.stderr)
        opt, sched = build_optimizer(model, args, start=report.step)

    stream = batches(loader, sampler)
    log = open(args.out, "a", encoding="utf-8") if rank == 0 else None  # noqa: SIM115
    for step in range(report.step, args.steps):
        loss, grad_norm, lr = train_step(model, opt, sched, next(stream), world)
        ckpt.track(step + 1, loss=loss, grad_norm=grad_norm)
        if log is not None:
            record = {"step": step + 1, "loss": loss, "grad_norm": grad_norm, "lr": lr}
            log.write(json.dumps(record) + "\n")
            log.flush()
        if (step + 1) % args.save_every == 0 or ckpt.should_stop(step + 1):
            ckpt.save(step + 1)
        if ckpt.should_stop(step + 1):
            if rank == 0:
                print(f"stopped after saving step {step + 1}", file=sys.stderr)
            break
    ckpt.close()
    if log is not None:
        log.close()

    if args.final_state:
        # Collective: every rank takes part in gathering the full (unsharded) state.
        model_sd, opt_sd = get_state_dict(
            model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if rank == 0:
            torch.save({"model": model_sd, "optimizer": opt_sd}, args.final_state)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    distributed = "WORLD_SIZE" in os.environ
    if args.fsdp and not distributed:
        sys.exit("--fsdp needs several processes: run it under torchrun")
    if not distributed:
        train(args, rank=0, world=1)
        return
    dist.init_process_group("gloo")
    try:
        train(args, rank=dist.get_rank(), world=dist.get_world_size())
        # Free DDP's reducer while the process group is still registered: if the reducer
        # held the last reference, the group's destructor would join gloo's threads
        # while holding the GIL, and can deadlock at exit (pytorch/pytorch#56297).
        gc.collect()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
