"""The tiny GPT of ``megatron_train.py`` with Megatron's DistributedOptimizer, resumed by
Megatron's own ``dist_checkpointing`` (``dp_reshardable``, a synchronous torch_dist save),
as ``megatron.training`` does it. One process (CPU, gloo, test-only ``megatron_cpu``).

An unbroken Checkpointer runs beside it only to keep what ``unbroken resume-test``
compares: the tracked loss, the run's lineage, and at each save the model and, as
``dist_optimizer``, the torch optimizer's state over this rank's main-weight shards. On a
resume it restores none of those (``reset``): the model and optimizer come from
Megatron's checkpoint alone.

Measured with megatron-core 0.16.1 and torch's AdamW (no Apex, no Transformer Engine):
after the load every parameter's ``step`` is the value the optimizer held before it (1,
from the step that gives the fresh state its shape), not the saved 3, and it is one tensor
shared by all parameters, so each optimizer step adds the number of parameters to it.
``unbroken resume-test`` reports DIFFERENT, naming ``dist_optimizer/0/step`` first.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the CPU shim
import megatron_cpu  # noqa: F401  (before Megatron places anything)

# isort: split
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module
from megatron_train import train_step

import unbroken as ub

SHARDING = {"distrib_optim_sharding_type": "dp_reshardable"}
RESET = {"model", "dist_optimizer"}


def build():
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
    )  # fmt: skip
    gpt = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16)
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=True)
    model = DistributedDataParallel(config, ddp, Float16Module(config, gpt))
    opt_config = OptimizerConfig(
        optimizer="adam", lr=1e-2, bf16=True, clip_grad=0.0, use_distributed_optimizer=True
    )
    return model, get_megatron_optimizer(opt_config, [model])


class ShardState:
    """The torch optimizer's state over this rank's main-weight shards, by position."""

    def __init__(self, optimizer) -> None:
        self.inner = optimizer.chained_optimizers[0].optimizer

    def state_dict(self) -> dict:
        params = [p for group in self.inner.param_groups for p in group["params"]]
        return {str(i): dict(self.inner.state.get(p, {})) for i, p in enumerate(params)}

    def load_state_dict(self, state: dict) -> None:
        raise AssertionError("never restored: pass it in reset")


def sharded(model, optimizer, loading: bool) -> dict:
    model_sd = model.module.sharded_state_dict()
    opt_sd = optimizer.sharded_state_dict(model_sd, is_loading=loading, metadata=SHARDING)
    return {"model": model_sd, "optimizer": opt_sd}


def main() -> None:
    folder = Path(sys.argv[1])
    own = folder / "megatron"
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel()
    random.seed(0)
    torch.manual_seed(0)
    model, optimizer = build()
    ckpt = ub.Checkpointer(
        folder, model=model.module, extra={"dist_optimizer": ShardState(optimizer)}
    )
    start = ckpt.restore(reset=RESET if ckpt.latest_step() else None).step
    if start:
        # A fresh torch Adam has no state, and Megatron's DistributedOptimizer.state_dict()
        # (called to build the load template) needs its ``step``: give the state a value
        # first, as Megatron does for its fsdp_dtensor format (a step on zero gradients;
        # the load overwrites the main weights and moments it changed).
        optimizer.chained_optimizers[0]._init_optimizer_states_with_dummy_values()
        state = dist_checkpointing.load(sharded(model, optimizer, True), str(own / f"iter_{start}"))
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    for step in range(start, 6):
        loss = train_step(model, optimizer, step)
        ckpt.track(step + 1, loss=loss)
        if (step + 1) % 2 == 0 or ckpt.should_stop(step + 1):
            target = own / f"iter_{step + 1}"
            target.mkdir(parents=True, exist_ok=True)
            strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)
            dist_checkpointing.save(sharded(model, optimizer, False), str(target), strategy)
            ckpt.save(step + 1)
        if ckpt.should_stop(step + 1):
            break
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
