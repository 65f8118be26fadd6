"""A DeepSpeed engine trained on a learnable function, checkpointed by unbroken.

    python deepspeed_train.py DIR --stage 2 --opt torch --bf16 --steps 8
    torchrun --standalone --nproc_per_node 2 deepspeed_train.py DIR --stage 3 ...

``--opt``: ``torch`` (a torch AdamW given to deepspeed.initialize), ``adamw``
(DeepSpeed's "AdamW" with ``torch_adam``), ``muon`` (DeepSpeed's "Muon", 2-D weights
marked ``use_muon``). Widths of 13 split unevenly over 2 ranks, so ZeRO's partitions
cut parameters in the middle. The data is a StatefulDataLoader over a
DistributedSampler (its position saved per rank); ``--own DIR`` also saves DeepSpeed's
own checkpoint at each save (for the comparison with DeepSpeed's round trip), and
``--own-load`` resumes from it instead of unbroken; ``--universal DIR`` resumes instead
from DIR, a universal checkpoint written by DeepSpeed's ``ds_to_universal`` (loaded with
``"checkpoint": {"load_universal": true}``, DeepSpeed's path onto another world size and
stage). ``--dump PREFIX``: rank 0 writes the whole state as DeepSpeed's own API gathers it
at each save (``PREFIX.STEP``) and after a restore (``PREFIX.restored``), for the tests to
compare across layouts, and beside each the dtypes the engine keeps its optimizer state in
(``PREFIX.STEP.dtypes``) and its step counts (``PREFIX.STEP.steps``).
"""

from __future__ import annotations

import argparse
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import numpy as np
import torch
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

import training_scripts

WIDTH = 13


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, WIDTH)
        self.hidden = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.out = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = h + torch.tanh(self.hidden(self.norm(h)))
        return self.out(h)


def dataset(n: int = 256) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, 8, generator=g)
    y = torch.sin(x).sum(1, keepdim=True) + x[:, :1] * x[:, 1:2] / 2
    return torch.utils.data.TensorDataset(x, y)


def config(args: argparse.Namespace) -> dict:
    zero: dict = {"stage": args.stage}
    cfg: dict = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
        "bf16": {"enabled": args.bf16},
        "steps_per_print": 10**9,
    }
    if args.universal:
        cfg["checkpoint"] = {"load_universal": True}
    if args.opt == "adamw":
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}}
    elif args.opt == "muon":
        # torch_adam: the auxiliary Adam is torch's AdamW (FusedAdam on the CPU is refused)
        cfg["optimizer"] = {"type": "Muon", "params": {"lr": 2e-2, "torch_adam": True}}
        if args.stage == 3:
            zero["reduce_scatter"] = False
    return cfg


def main(args: argparse.Namespace) -> None:
    import deepspeed

    from unbroken.integrations.deepspeed import checkpointer_for

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = Net()
    if args.opt == "muon":
        for p in model.parameters():
            p.use_muon = p.ndim == 2
    kwargs: dict = {"model": model, "config": config(args)}
    if args.opt == "torch":
        kwargs["optimizer"] = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    else:
        kwargs["model_parameters"] = model.parameters()
    engine, _, _, _ = deepspeed.initialize(**kwargs)
    world, rank = engine.dp_world_size, torch.distributed.get_rank()
    sampler = torch.utils.data.DistributedSampler(
        dataset(), num_replicas=world, rank=rank, shuffle=True, seed=7
    )
    loader = StatefulDataLoader(dataset(), batch_size=4, sampler=sampler)
    ckpt = checkpointer_for(engine, args.dir, dataloader=loader, keep_last=None)
    if args.own_load:
        _, client = engine.load_checkpoint(args.own)
        start = client["step"]
        loader.load_state_dict(client["loader"])
        torch.set_rng_state(client["rng"])
    elif args.universal:
        # a universal folder is for another world size: RNG and data position start fresh
        _, client = engine.load_checkpoint(args.universal)
        start = client["step"]
        if args.dump:
            dump(engine, f"{args.dump}.restored", rank)
    else:
        # onto another world size the per-rank state (RNG, data position) cannot map
        start = ckpt.restore(reset={"rng", "dataloader"} if args.new_world else None).step
        if args.dump and start:
            dump(engine, f"{args.dump}.restored", rank)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    step = start
    batches = iter(loader)
    while step < args.steps:
        try:
            x, y = next(batches)
        except StopIteration:
            sampler.set_epoch(sampler.epoch + 1)
            batches = iter(loader)
            continue
        loss = (engine(x.to(dtype)).float() - y).pow(2).mean()
        engine.backward(loss)
        engine.step()
        step += 1
        norm = engine.get_global_grad_norm()  # None where the engine keeps none (stage 0)
        ckpt.track(step, loss=loss.detach(), **({} if norm is None else {"grad_norm": norm}))
        stop = ckpt.should_stop(step)
        if stop or step % args.every == 0 or step == args.steps:
            ckpt.save(step)
            if args.dump:
                dump(engine, f"{args.dump}.{step}", rank)
            if args.own:
                client = {"step": step, "loader": loader.state_dict(), "rng": torch.get_rng_state()}
                engine.save_checkpoint(args.own, tag=f"global_step{step}", client_state=client)
        if stop:
            break
    ckpt.close()


def dump(engine, path: str, rank: int) -> None:
    """The whole state as DeepSpeed's own API gathers it (not through unbroken): compute
    weights, fp32 masters, Adam's moments (and Muon's momentum at stage 3, where DeepSpeed
    exposes it); rank 0 writes it to ``path``. Every rank asks the same keys, in the same
    order (each call is a collective)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    # Stages 1-2 link each parameter's view of the optimizer state only at the first step
    # (DeepSpeed's own lazy init, run here as that step would): right after a restore the
    # per-parameter API has nothing to read yet.
    link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if callable(link):
        link()
    params = list(engine.module.named_parameters())
    muon = any(hasattr(p, "use_muon") for _, p in params)
    with deepspeed.zero.GatheredParameters(
        [p for _, p in params], enabled=engine.zero_optimization_stage() == 3
    ):
        for name, p in params:
            out[f"model/{name}"] = p.detach().clone()
    for name, p in params:
        out[f"fp32_master/{name}"] = safe_get_full_fp32_param(p)
        stage3 = engine.zero_optimization_stage() == 3
        if muon:  # stages 1-2 expose neither Muon's momentum nor its Adam's moments
            keys = (
                ()
                if not stage3
                else ("momentum_buffer",)
                if p.use_muon
                else ("exp_avg", "exp_avg_sq")
            )
        else:
            keys = ("exp_avg", "exp_avg_sq")
        for key in keys:
            out[f"{key}/{name}"] = safe_get_full_optimizer_state(p, key)
    inner = getattr(engine.optimizer, "optimizer", None)
    dtypes = {}  # the dtypes DeepSpeed keeps its optimizer state in, beside: PATH.dtypes
    # the step counts, beside: PATH.steps: the engine's, and each optimizer state's (None
    # where it has none), read from the state (ZeRO-3 empties its groups between steps)
    steps: dict = {"global_steps": engine.global_steps, "optimizer": []}
    for state in getattr(inner, "state", {}).values():
        step = state.get("step")
        steps["optimizer"].append(None if step is None else float(step))
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim():
                dtypes[key] = str(value.dtype).removeprefix("torch.")
    if rank == 0:
        torch.save(out, path)
        torch.save(dtypes, f"{path}.dtypes")
        torch.save(steps, f"{path}.steps")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("--stage", type=int, default=1)
    parser.add_argument("--opt", choices=["torch", "adamw", "muon"], default="torch")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--own", default=None)
    parser.add_argument("--own-load", action="store_true")
    parser.add_argument("--universal", default=None, help="a ds_to_universal folder to resume")
    parser.add_argument(
        "--new-world",
        action="store_true",
        help="restore onto another world size (RNG, data position start fresh)",
    )
    parser.add_argument("--dump", default=None, help="DeepSpeed's own view at saves/restore")
    training_scripts.single_process_env()
    main(parser.parse_args())
    # DeepSpeed keeps its process groups in module-level objects (deepspeed.comm's
    # backend, deepspeed.utils.groups), so they outlive destroy_process_group() and a
    # gloo worker could abort the interpreter's finalization: everything is committed by
    # now, so the process leaves without finalizing.
    training_scripts.end_deepspeed_process()
