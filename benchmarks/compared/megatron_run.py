"""Megatron-Core: one training script, resumed by Megatron's own checkpoints or by unbroken's.

    python benchmarks/compared/megatron_run.py DIR --resume own|unbroken [--steps 40]

It starts itself again under ``torchrun --standalone --nproc_per_node 2``: two
data-parallel ranks (gloo). Megatron-Core needs CUDA; here it runs on the CPU through the
test-only shim ``tests/megatron_cpu.py`` (CUDA device requests mapped to the CPU,
Megatron's no-op RNG tracker, so dropout draws from torch's CPU generator).

The same training both ways (``shared.py``): the shared MLP inside a ``MegatronModule``, in
bf16 under ``Float16Module``, Megatron's ``DistributedDataParallel``, the mixed-precision
optimizer ``get_megatron_optimizer`` builds (fp32 main weights, torch's AdamW), Megatron's
``OptimizerParamScheduler`` warming up over 5 steps, two micro-batches per optimizer step
(gradients accumulated in Megatron's buffers), the data shuffled per epoch by a
``DistributedSampler`` over the two ranks.

- ``own``: what Megatron-LM's ``save_checkpoint`` writes, through megatron-core's
  ``dist_checkpointing``: ``model.sharded_state_dict()``, the optimizer's
  ``sharded_state_dict(...)``, the scheduler's ``state_dict()``, the iteration and the RNG
  states (Python, NumPy, torch) as one ``ShardedObject`` replicated over data-parallel
  ranks; at start ``dist_checkpointing.load`` of the newest ``iter_N`` folder into the
  templates (``is_loading=True``), then ``load_state_dict`` of each, and the batches done
  in the epoch derived from the step and skipped (the sampler's order is seeded by the
  epoch, so the same batches follow). ``--no-save-rng``: without the RNG states, as
  Megatron-LM's option of that name saves.
- ``unbroken``: ``checkpointer_for(model, optimizer, DIR/ckpt, scheduler=...,
  dataloader=loader)`` over a ``StatefulDataLoader`` (docs/integrations/megatron.md).
"""

from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RANKS = 2


def relaunch() -> None:
    """Run this script again on ``RANKS`` processes under torchrun; exit with its code."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={RANKS}", __file__, *sys.argv[1:]]  # fmt: skip
    sys.exit(subprocess.run(command, check=False).returncode)


if __name__ == "__main__" and "LOCAL_RANK" not in os.environ:
    relaunch()

sys.path.insert(0, str(ROOT / "tests"))  # the test-only CPU shim
import megatron_cpu  # noqa: E402, F401  (before Megatron places anything)

# isort: split
import numpy as np  # noqa: E402
import shared  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import dist_checkpointing, parallel_state  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedObject  # noqa: E402
from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel,
    DistributedDataParallelConfig,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.module import Float16Module, MegatronModule  # noqa: E402
from torch import nn  # noqa: E402


class MLP(MegatronModule):
    """The shared MLP as a Megatron model chunk."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__(config)
        self.net = shared.mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def build(steps: int):
    config = TransformerConfig(
        num_layers=1, hidden_size=32, num_attention_heads=1, bf16=True,
        params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
    )  # fmt: skip
    chunk = MLP(config)
    model = DistributedDataParallel(
        config, DistributedDataParallelConfig(), Float16Module(config, chunk.bfloat16())
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.01, bf16=True, clip_grad=1.0),
        [model],
    )
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=1e-2, min_lr=1e-2, lr_warmup_steps=5,
        lr_decay_steps=steps, lr_decay_style="constant", start_wd=0.01, end_wd=0.01,
        wd_incr_steps=steps, wd_incr_style="constant",
    )  # fmt: skip
    return chunk, model, optimizer, scheduler


def main() -> None:
    parser = shared.options(__doc__)
    parser.add_argument("--no-save-rng", action="store_true",
                        help="own: no RNG states in the checkpoint (Megatron-LM's --no-save-rng)")  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(1)  # one reduction order, whatever the machine's load
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel()
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    own, rng = args.resume == "own", not args.no_save_rng
    chunk, model, optimizer, scheduler = build(args.steps)
    rank, ranks = dist.get_rank(), dist.get_world_size()
    data = torch.utils.data.TensorDataset(*shared.rows(args.rows))
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=ranks, rank=rank, seed=0)
    folder = args.dir / "ckpt"
    if own:
        loader = torch.utils.data.DataLoader(data, batch_size=shared.BATCH_SIZE, sampler=sampler)
        step, ckpt = _own_restore(chunk, optimizer, scheduler, folder, rng=rng), None
        skip = (step * args.accumulate) % len(loader)
    else:
        from torchdata.stateful_dataloader import StatefulDataLoader

        from unbroken.integrations.megatron import checkpointer_for

        loader = StatefulDataLoader(data, batch_size=shared.BATCH_SIZE, sampler=sampler)
        ckpt = checkpointer_for(model, optimizer, folder, scheduler=scheduler, dataloader=loader)
        step, skip = ckpt.restore().step, 0  # the loader resumes mid-epoch by itself
    stop = shared.stop_step()
    log = shared.StepLog(args.dir) if rank == 0 else None
    model.train()
    losses: list[torch.Tensor] = []
    done = step * args.accumulate  # micro-batches trained
    # A restored loader stopped after its epoch's last batch first ends that epoch (it
    # yields nothing): the loop starts in it. The own skip starts in the next one.
    epoch = done // len(loader) if own else max(0, done - 1) // len(loader)
    while step < args.steps and step != stop:
        sampler.set_epoch(epoch)
        for x, y in itertools.islice(loader, skip, None):
            if not losses:
                model.zero_grad_buffer()
                optimizer.zero_grad()
            seen = [torch.empty_like(x) for _ in range(ranks)]
            dist.all_gather(seen, x)  # both ranks' inputs go into the step's digest
            if log is not None:
                log.saw(torch.cat(seen))
            loss = nn.functional.mse_loss(model(x), y)
            (loss / args.accumulate).backward()
            losses.append(loss.detach())
            if len(losses) < args.accumulate:
                continue
            model.finish_grad_sync()
            optimizer.step()
            scheduler.step(increment=1)
            step += 1
            mean = torch.stack(losses).mean()
            dist.all_reduce(mean)
            mean /= ranks  # the mean over micro-batches and ranks
            losses.clear()
            if log is not None:
                log.step(step, mean.item())
            if ckpt is not None:
                ckpt.track(step, loss=mean)
            if step % args.every == 0 or step == stop or (ckpt and ckpt.should_stop(step)):
                if ckpt is None:
                    _own_save(chunk, optimizer, scheduler, folder, step, rng=rng)
                else:
                    ckpt.save(step)
            if step == args.steps or step == stop:
                break
        skip, epoch = 0, epoch + 1
    if step == args.steps and rank == 0:
        _write_final(args.dir, chunk, optimizer)
    if ckpt is not None:
        ckpt.close()
    dist.barrier()
    dist.destroy_process_group()


# Megatron's own checkpoints ----------------------------------------------------------------


def _rng_state() -> ShardedObject:
    """The generators' states as Megatron-LM saves them (one copy, replicated over DP)."""
    state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state()}  # fmt: skip
    dp_rank = parallel_state.get_data_parallel_rank()
    return ShardedObject("rng_state", [state], (1, 1), (0, 0), replica_id=dp_rank)


def _sharded(chunk, optimizer, scheduler, step: int, *, loading: bool, rng: bool) -> dict:
    model_sd = chunk.sharded_state_dict()
    state = {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=loading),
        "opt_param_scheduler": scheduler.state_dict(),
        "iteration": step,
    }
    return {**state, "rng_state": _rng_state()} if rng else state


def _own_save(chunk, optimizer, scheduler, folder: Path, step: int, *, rng: bool) -> None:
    target = folder / f"iter_{step:07d}"
    if dist.get_rank() == 0:
        target.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = _sharded(chunk, optimizer, scheduler, step, loading=False, rng=rng)
    dist_checkpointing.save(state, str(target))
    dist.barrier()
    if dist.get_rank() == 0:
        (folder / "latest_checkpointed_iteration.txt").write_text(str(step))


def _own_restore(chunk, optimizer, scheduler, folder: Path, *, rng: bool) -> int:
    latest = folder / "latest_checkpointed_iteration.txt"
    if not latest.exists():
        return 0
    step = int(latest.read_text())
    template = _sharded(chunk, optimizer, scheduler, step, loading=True, rng=rng)
    state = dist_checkpointing.load(template, str(folder / f"iter_{step:07d}"))
    chunk.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["opt_param_scheduler"])
    if rng:  # DP rank 0's states, on every rank (what Megatron-LM loads by default)
        generators = state["rng_state"][0]
        random.setstate(generators["random_rng_state"])
        np.random.set_state(generators["np_rng_state"])
        torch.set_rng_state(generators["torch_rng_state"])
    return int(state["iteration"])


def _write_final(run_dir: Path, chunk, optimizer) -> None:
    """The end state: the bf16 model, and per parameter its fp32 main weight and AdamW's
    state (which the optimizer keeps on the main weight)."""
    from safetensors.torch import save_file

    leaf = getattr(optimizer, "chained_optimizers", [optimizer])[0]
    mains = {}
    for model_group, main_group in zip(
        leaf.float16_groups, leaf.fp32_from_float16_groups, strict=True
    ):
        mains.update({id(p): m for p, m in zip(model_group, main_group, strict=True)})
    tensors = {f"model.{k}": v for k, v in chunk.state_dict().items() if v is not None}
    for name, p in chunk.named_parameters():
        main = mains[id(p)]
        tensors[f"optimizer.{name}.main_param"] = main
        for key, value in leaf.optimizer.state[main].items():
            tensors[f"optimizer.{name}.{key}"] = value
    plain = {k: v.detach().cpu().clone().contiguous() for k, v in tensors.items()}
    save_file(plain, str(Path(run_dir) / shared.FINAL))


if __name__ == "__main__":
    main()
