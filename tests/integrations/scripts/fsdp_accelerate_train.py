"""Accelerate's FSDP plugin (FSDP1 or FSDP2) on CPU/gloo, resumed through
``unbroken.integrations.accelerate.checkpointer_for``.

    torchrun --nproc_per_node N fsdp_accelerate_train.py DIR --fsdp 0|1|2 [--steps 10]
        [--orig-params] [--reset] [--dump FOLDER]

``fsdp_common.Net`` (an MLP with dropout, widths that divide over no world size) learns
from a shuffled, stateful loader (sharded per rank by Accelerate), AdamW with a warm-up,
2 micro-batches per step, each ``Block`` its own FSDP unit. ``--fsdp 0``: no plugin (one
plain process, or DDP under torchrun).

``--reset`` restores with ``reset={"rng", "dataloader"}`` (another world size);
``--dump`` has rank 0 write the gathered model and optimizer state (torch's own
``get_state_dict``) after the restore (``restored-step<K>.pt``, with the report) and at
the end (``end-step<N>.pt``), for the tests to compare.

TEST-ONLY SHIM (:func:`fsdp_on_cpu`): accelerate 1.15 turns an FSDP plugin into
``DistributedType.FSDP`` only for GPU-like devices (``AcceleratorState.__init__``,
accelerate/state.py, the branch over ``MULTI_GPU``, ``MULTI_XPU``...); with
``Accelerator(cpu=True)`` under torchrun it stays ``MULTI_CPU`` and ``prepare`` wraps the
model in DDP. The shim does what that branch does, for ``MULTI_CPU``: it sets
``accelerator.state.distributed_type = DistributedType.FSDP`` and
``accelerator.state.fsdp_plugin = plugin``, before anything is prepared. Nothing else is
patched: ``prepare`` then runs Accelerate's own FSDP code (FSDP1:
``FullyShardedDataParallel(model, device_id=cpu, ...)``; FSDP2: ``fsdp2_prepare_model``,
i.e. ``fully_shard``), and ``clip_grad_norm_``/``accumulate`` their FSDP branches.
``PartialState`` keeps ``MULTI_CPU`` (gloo), so collectives go the CPU way.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import fsdp_common
import torch
from accelerate import Accelerator, FullyShardedDataParallelPlugin
from accelerate.utils import DataLoaderConfiguration, DistributedType, set_seed
from torch import nn

from unbroken.integrations.accelerate import checkpointer_for

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the scripts' helpers
import training_scripts

with contextlib.suppress(ImportError):  # before any process group exists: see below
    import deepspeed  # noqa: F401
# Accelerate imports DeepSpeed, where it is installed, while it prepares an FSDP2 model;
# imported after init_process_group, DeepSpeed's package import keeps the default group
# alive, and its gloo threads outlive destroy_process_group (training_scripts.end_process
# refuses that). Imported first, it holds nothing.


def fsdp_on_cpu(accelerator: Accelerator, plugin: FullyShardedDataParallelPlugin) -> None:
    """TEST-ONLY: make Accelerate take its FSDP code path on CPU (see the module docstring)."""
    state = accelerator.state
    if state.distributed_type != DistributedType.MULTI_CPU:
        raise RuntimeError(f"expected MULTI_CPU under torchrun, got {state.distributed_type}")
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    state.device = torch.device("cpu")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("--fsdp", type=int, choices=(0, 1, 2), required=True, help="0: none")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--orig-params", action="store_true", help="FSDP1 use_orig_params")
    parser.add_argument("--reset", action="store_true", help='reset={"rng", "dataloader"}')
    parser.add_argument("--dump")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    plugin = None
    if args.fsdp:
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=args.fsdp,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["Block"],
            **({"use_orig_params": args.orig_params} if args.fsdp == 1 else {}),
        )
    accelerator = Accelerator(
        cpu=True,
        fsdp_plugin=plugin,
        gradient_accumulation_steps=2,
        dataloader_config=DataLoaderConfiguration(
            use_stateful_dataloader=True, use_seedable_sampler=True
        ),
    )
    if plugin is not None:
        fsdp_on_cpu(accelerator, plugin)
    set_seed(0)
    model = fsdp_common.Net()
    loader = torch.utils.data.DataLoader(fsdp_common.dataset(), batch_size=16, shuffle=True)
    if args.fsdp == 1:  # FSDP1: the optimizer over the wrapped model's (flat) parameters
        model = accelerator.prepare(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
        opt, loader, sched = accelerator.prepare(opt, loader, sched)
    else:  # FSDP2: model and optimizer together (Accelerate swaps in the DTensors); no FSDP
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
        model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)

    with checkpointer_for(accelerator, args.dir) as ckpt:
        report = ckpt.restore(reset={"rng", "dataloader"} if args.reset else None)
        if report.restored:
            restored = {
                "report": fsdp_common.report_fields(report),
                "lr": sched.get_last_lr(),
                "accelerator_step": accelerator.step,
                "wrapped": type(model).__name__,
                "parameters": fsdp_common.parameter_kinds(opt.optimizer),
                **fsdp_common.full_state(model, opt.optimizer),
            }
            fsdp_common.write(args.dump, f"restored-step{report.step}", restored)
        step = train(accelerator, ckpt, model, opt, loader, sched, report.step, args.steps)
    end = {"lr": sched.get_last_lr(), **fsdp_common.full_state(model, opt.optimizer)}
    fsdp_common.write(args.dump, f"end-step{step}", end)


def train(accelerator, ckpt, model, opt, loader, sched, step: int, steps: int) -> int:
    """Optimizer steps from ``step`` to ``steps`` (or a stop), saving at the last; the
    step reached."""
    model.train()
    losses: list[torch.Tensor] = []
    while step < steps and not ckpt.should_stop(step):
        for x, y in loader:
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
            if step == steps or ckpt.should_stop(step):
                ckpt.save(step)
                break
    return step


if __name__ == "__main__":
    main()
    training_scripts.end_process()
