"""A tiny Megatron-Core GPT trained on a repeating token pattern, checkpointed by
``unbroken.integrations.megatron`` (CPU, gloo, through the test-only ``megatron_cpu``).

Run under ``torchrun --standalone --nproc_per_node N``::

    megatron_train.py DIR [--tp T] [--fp32] [--distopt] [--steps S] [--every E] [--resave DIR2]

Every data-parallel rank trains on its own rows; the loss tracked is the mean over them.
``--distopt``: Megatron's DistributedOptimizer (main weights and Adam state sharded over
the data-parallel ranks) instead of its non-distributed optimizer.
``--resave DIR2``: restore DIR's latest checkpoint, save what was installed into DIR2 at
the same step; restore it again into a fresh model with ``reset={"optimizer"}``; write
both restores' outcome to DIR2/report.json, and stop (no training).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the CPU shim
import megatron_cpu  # noqa: F401  (before Megatron places anything)

# isort: split
import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module

from unbroken.integrations.megatron import checkpointer_for

VOCAB, SEQ, BATCH = 64, 16, 4


def batch(step: int, dp_rank: int) -> torch.Tensor:
    """Rows of a repeating pattern (token t+1 follows t, modulo 11), offset per row."""
    starts = torch.arange(BATCH) * 7 + step * 3 + dp_rank * 5
    return (starts[:, None] + torch.arange(SEQ + 1)[None, :]) % 11


def build(tp: int, fp32: bool, distopt: bool = False):
    dtype = torch.float32 if fp32 else torch.bfloat16
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, bf16=not fp32, params_dtype=dtype,
        pipeline_dtype=dtype, tensor_model_parallel_size=tp,
    )  # fmt: skip
    model = GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB, max_sequence_length=SEQ,
    )  # fmt: skip
    if not fp32:
        model = Float16Module(config, model)  # bf16 throughout, as Megatron's get_model does
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=distopt)
    model = DistributedDataParallel(config, ddp, model)
    opt_config = OptimizerConfig(
        optimizer="adam", lr=1e-2, bf16=not fp32, clip_grad=0.0, use_distributed_optimizer=distopt
    )
    optimizer = get_megatron_optimizer(opt_config, [model])
    return model, optimizer


def train_step(model, optimizer, step: int) -> torch.Tensor:
    dp = parallel_state.get_data_parallel_group()
    rows = batch(step, parallel_state.get_data_parallel_rank())
    tokens, labels = rows[:, :-1], rows[:, 1:]
    positions = torch.arange(SEQ)[None, :].expand(BATCH, SEQ)
    model.zero_grad_buffer()
    optimizer.zero_grad()
    loss = model(tokens, positions, None, labels=labels).float().mean()
    loss.backward()
    model.finish_grad_sync()
    optimizer.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean, group=dp)
    return mean / dist.get_world_size(dp)


def probe(model) -> torch.Tensor:
    """The loss on a fixed batch: recorded at save, recomputed after restore (F4)."""
    rows = batch(0, 0)
    positions = torch.arange(SEQ)[None, :].expand(BATCH, SEQ)
    return model(rows[:, :-1], positions, None, labels=rows[:, 1:]).float().mean()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--fp32", action="store_true")
    parser.add_argument("--distopt", action="store_true")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--resave")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    model, optimizer = build(args.tp, args.fp32, args.distopt)
    # At another TP size the forward sums in another order: the probe would differ.
    ckpt = checkpointer_for(model, optimizer, args.dir, probe=None if args.resave else probe)
    # Another world size: the per-rank RNG state does not map, and is not what is checked.
    report = ckpt.restore(reset={"rng"} if args.resave else None)
    if args.resave:
        return resave(report, model, optimizer, args)
    start = report.step
    for step in range(start, args.steps):
        loss = train_step(model, optimizer, step)
        ckpt.track(step + 1, loss=loss)
        if (step + 1) % args.every == 0 or ckpt.should_stop(step + 1):
            ckpt.save(step + 1)
        if ckpt.should_stop(step + 1):
            break
    ckpt.close()
    dist.destroy_process_group()


def resave(report, model, optimizer, args) -> None:
    again = checkpointer_for(model, optimizer, args.resave)
    again.save(report.step)
    again.close()
    fields = ("step", "restored", "verified", "resharded", "saved_world_size", "world_size")
    out = {f: getattr(report, f) for f in fields}
    # Restored before any step: each compute weight must already be its main weight
    # rounded to the compute dtype, not wait for the first step to be refreshed (F4).
    pairs = mains_and_weights(model, optimizer)
    out["compute_from_main"] = all(torch.equal(m.to(w.dtype), w) for m, w in pairs)
    # Restored into a fresh model with the optimizer reset: each fp32 main weight must
    # start from the restored compute weight, not from the fresh model's initial one.
    model, optimizer = build(args.tp, args.fp32, args.distopt)
    fresh = checkpointer_for(model, optimizer, args.dir)
    reset = fresh.restore(reset={"optimizer", "rng"})
    pairs = mains_and_weights(model, optimizer)
    out["reset_verified"] = reset.verified
    out["mains"] = len(pairs)
    out["mains_from_restored"] = all(torch.equal(m, w.float()) for m, w in pairs)
    if dist.get_rank() == 0:
        (Path(args.resave) / "report.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def mains_and_weights(model, optimizer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(fp32 main weight, the compute weight it stands for) of each bf16 parameter this
    rank holds a main weight of: whole, or with the DistributedOptimizer the rank's range."""
    leaf = getattr(optimizer, "chained_optimizers", [optimizer])[0]
    out = []
    for p in model.parameters():
        main = getattr(p, "main_param", None)
        if main is None:
            continue
        weight = p.detach()
        if getattr(p, "main_param_sharded", False):
            within = leaf._get_model_param_range_map(p)["param"]
            weight = weight.reshape(-1)[within.start : within.end]
        out.append((main, weight))
    return out


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
