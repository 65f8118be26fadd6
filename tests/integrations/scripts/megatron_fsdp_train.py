"""The tiny GPT of ``megatron_train.py`` (bf16, Megatron's Float16Module) under
Megatron-FSDP (ZeRO-3: ``optim_grads_params``), trained with torch's AdamW wrapped by
``fully_shard_optimizer``. CPU, gloo, through the test-only ``megatron_fsdp_cpu`` shim.

Run under ``torchrun --standalone --nproc_per_node N``::

    megatron_fsdp_train.py DIR [--steps S] [--every E] [--own] [--resave DIR2]

Default: the ``megatron-fsdp`` package's ``MegatronFSDP``, checkpointed by
``unbroken.integrations.megatron.checkpointer_for``.

``--resave DIR2``: restore DIR's latest checkpoint (at this world size), save what was
installed into DIR2 at the same step, write the restore's outcome to DIR2/report.json;
then try what ``checkpointer_for`` refuses (megatron-core's vendored copy, the package's
ZeRO-2) and write case -> error message (None where nothing was refused) to
DIR2/refusals.json; and stop (no training). One launch for both, to spare a process.

``--own``: megatron-core's vendored copy (``fully_shard_model``), resumed by its own
checkpointing as its README shows (torch DCP of ``model.state_dict()`` and
``optimizer.state_dict()``, then ``load_state_dict`` of both). An unbroken Checkpointer
runs beside it only to keep what ``unbroken resume-test`` compares: the tracked loss and,
at each save, the model and, as ``dist_optimizer``, the torch optimizer's state by
position (one process: each shard is the whole tensor). On a resume it restores none of
those (``reset``). Measured with megatron-core 0.16.1: the vendored optimizer's
``state_dict()`` is the (empty) dict captured when it was wrapped, so the resumed AdamW
starts again from no moments, and ``resume-test`` reports DIFFERENT.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the CPU shims
import megatron_fsdp_cpu  # (before Megatron places anything)

# isort: split
import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron_train import BATCH, SEQ, VOCAB, batch
from torch.distributed.device_mesh import init_device_mesh

import unbroken as ub
from unbroken.integrations.megatron import checkpointer_for

RESET = {"model", "dist_optimizer"}


def gpt() -> torch.nn.Module:
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
    )  # fmt: skip
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ)
    return Float16Module(config, model)


def build(own: bool, strategy: str = "optim_grads_params"):
    mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("dp", "tp"))
    where = {"device_mesh": mesh, "dp_shard_dim": "dp", "tp_dim": "tp"}
    with megatron_fsdp_cpu.device_index():
        if own:
            from megatron.core.distributed.fsdp.src import megatron_fsdp as vendored

            model = vendored.fully_shard_model(
                gpt(), **where, fsdp_unit_modules=[TransformerLayer], device=torch.device("cpu")
            )
            return model, vendored.fully_shard_optimizer(torch.optim.AdamW(model.parameters()))
        import megatron_fsdp

        # The package's fully_shard_model builds megatron-core's DistributedDataParallelConfig
        # when megatron-core is installed, which lacks fields 0.6.1 passes: build the
        # MegatronFSDP with the package's own config, as fully_shard_model would.
        model = megatron_fsdp.MegatronFSDP(
            gpt(),
            dist_index=megatron_fsdp.FSDPDistributedIndex(**where),
            ddp_config=megatron_fsdp.DistributedDataParallelConfig(
                data_parallel_sharding_strategy=strategy
            ),
            mixed_precision_policy=megatron_fsdp.MixedPrecisionPolicy(
                main_params_dtype=torch.float32
            ),
            fsdp_unit_modules=[TransformerLayer],
            device=torch.device("cpu"),
            sync_model_each_microbatch=True,
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, megatron_fsdp.fully_shard_optimizer(optimizer)


def train_step(model, optimizer, step: int) -> torch.Tensor:
    rows = batch(step, dist.get_rank())
    positions = torch.arange(SEQ)[None, :].expand(BATCH, SEQ)
    optimizer.zero_grad()
    loss = model(rows[:, :-1], positions, None, labels=rows[:, 1:]).float().mean()
    loss.backward()
    optimizer.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return mean / dist.get_world_size()


def probe(model) -> torch.Tensor:
    """The loss on a fixed batch: recorded at save, recomputed after restore (F4)."""
    rows = batch(0, 0)
    positions = torch.arange(SEQ)[None, :].expand(BATCH, SEQ)
    with torch.no_grad():
        return model(rows[:, :-1], positions, None, labels=rows[:, 1:]).float().mean()


class ShardState:
    """The torch optimizer's state by position (one process: the shards are whole)."""

    def __init__(self, optimizer) -> None:
        self.inner = optimizer

    def state_dict(self) -> dict:
        params = [p for group in self.inner.param_groups for p in group["params"]]
        return {
            str(i): {k: v.to_local() if hasattr(v, "to_local") else v for k, v in held.items()}
            for i, p in enumerate(params)
            if (held := self.inner.state.get(p))
        }

    def load_state_dict(self, state: dict) -> None:
        raise AssertionError("never restored: pass it in reset")


class Whole(torch.nn.Module):
    """The vendored model's compute weights by FQN (one process: the shards are whole)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def state_dict(self, *args, **kwargs) -> dict:
        return {k: v.to_local() for k, v in self.model.state_dict().items() if v is not None}

    def load_state_dict(self, *args, **kwargs):
        raise AssertionError("never restored: pass it in reset")


def own_run(model, optimizer, folder: Path, steps: int, every: int) -> None:
    ckpt = ub.Checkpointer(
        folder, model=Whole(model), extra={"dist_optimizer": ShardState(optimizer)}
    )
    start = ckpt.restore(reset=RESET if ckpt.latest_step() else None).step
    own = folder / "megatron_fsdp"
    if start:
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        dcp.load(state, checkpoint_id=str(own / f"iter_{start}"))
        model.load_state_dict(state["model"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
    for step in range(start, steps):
        loss = train_step(model, optimizer, step)
        ckpt.track(step + 1, loss=loss)
        if (step + 1) % every == 0 or ckpt.should_stop(step + 1):
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            dcp.save(state, checkpoint_id=str(own / f"iter_{step + 1}"))
            ckpt.save(step + 1)
        if ckpt.should_stop(step + 1):
            break
    ckpt.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--own", action="store_true")
    parser.add_argument("--resave")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel()
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    model, optimizer = build(args.own)
    if args.own:
        own_run(model, optimizer, Path(args.dir), args.steps, args.every)
        return dist.destroy_process_group()
    ckpt = checkpointer_for(model, optimizer, args.dir, probe=probe)
    # Another world size: the per-rank RNG state does not map, and is not what is checked.
    report = ckpt.restore(reset={"rng"} if args.resave else None)
    if args.resave:
        return resave(report, model, optimizer, Path(args.resave))
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


def resave(report, model, optimizer, folder: Path) -> None:
    again = checkpointer_for(model, optimizer, str(folder))
    again.save(report.step)
    again.close()
    fields = ("step", "restored", "verified", "resharded", "saved_world_size", "world_size")
    out = {f: getattr(report, f) for f in fields}
    refused = refusals(folder)
    if dist.get_rank() == 0:
        (folder / "report.json").write_text(json.dumps(out))
        (folder / "refusals.json").write_text(json.dumps(refused, indent=1))
    dist.destroy_process_group()


def refusals(folder: Path) -> dict:
    cases = {"vendored": {"own": True}, "zero2": {"own": False, "strategy": "optim_grads"}}
    out = {}
    for case, how in cases.items():
        model, optimizer = build(**how)
        try:
            checkpointer_for(model, optimizer, str(folder / case))
            out[case] = None
        except (TypeError, ValueError) as e:
            out[case] = f"{type(e).__name__}: {e}"
    return out


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
