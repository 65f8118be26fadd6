"""Megatron-Core: one ``ub.Checkpointer`` over a Megatron model and its optimizer.

``checkpointer_for(model, optimizer, path)`` takes what Megatron built (the model chunk
wrapped in Megatron's ``DistributedDataParallel``, and the optimizer from
``get_megatron_optimizer``) and saves, by the model's parameter FQNs:

- ``model``: the compute weights (bf16 where the model is), tensor-parallel slices as
  whole tensors sharded over the TP group, so a checkpoint restores at another TP size;
- ``optimizer``: per parameter the torch optimizer's state (Adam's ``exp_avg``,
  ``exp_avg_sq``, ``step``) and the fp32 main weight (``main_param``) of a bf16/fp16
  parameter, each whole and in its own dtype, and any loss scaler's state; the same
  whether Megatron's non-distributed optimizer holds them or its ``DistributedOptimizer``
  (each data-parallel rank a range of them, gathered at save), so a checkpoint of either
  restores into the other at any data-parallel size (DESIGN.md F3);
- ``megatron_rng``: the generator states of Megatron's model-parallel RNG tracker (what
  its dropout draws from), per rank.

A model wrapped by the ``megatron-fsdp`` package's ``MegatronFSDP`` (with the torch
optimizer ``fully_shard_optimizer`` wrapped) is saved the same way, by
``_megatron_fsdp`` (ZeRO-3 only; megatron-core's vendored copy is refused).

Both weights are installed before the first step and fingerprinted again after the
install (DESIGN.md F4). What cannot be captured exactly is refused when the Checkpointer
is built, with what to do instead: a ``DistributedOptimizer`` that gathers weights in the
background (``overlap_param_gather``) or keeps its state outside a torch optimizer, pipeline
parallelism, more than one model chunk, mixture-of-experts, gated linear units split by
TP, strided TP partitions. Tested with megatron-core 0.16.1 (``pip install
"unbroken[megatron]"``); see docs/integrations/megatron.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..checkpointer import Checkpointer
from . import _megatron_fsdp
from ._megatron_distopt import DistOptLeaf, check_distributed
from ._megatron_state import (
    LeafView,
    ModelState,
    OptimizerState,
    PlainLeaf,
    RNGTrackerState,
    TensorParallel,
)

__all__ = ["checkpointer_for"]

# The extra component holding Megatron's model-parallel RNG tracker.
RNG_TRACKER = "megatron_rng"

_SUPPORTED_OPTIMIZERS = (
    "Float16OptimizerWithFloat16Params",
    "FP32Optimizer",
    "DistributedOptimizer",
)


def checkpointer_for(
    model: Any, optimizer: Any, path: str, **checkpointer_args: Any
) -> Checkpointer:
    """A Checkpointer over a Megatron-Core model and its Megatron optimizer.

    Call it on every rank after ``get_megatron_optimizer``, then use the result like any
    Checkpointer (``restore``, ``track``, ``should_stop``, ``save``, ``close``); every
    call is collective.

    Args:
        model: the model chunk: Megatron's ``DistributedDataParallel`` (or
            ``Float16Module``) around it, the bare ``MegatronModule``, or a list holding
            one of these (what Megatron's ``get_model`` returns).
        optimizer: what ``get_megatron_optimizer`` returned: a
            ``Float16OptimizerWithFloat16Params``, an ``FP32Optimizer``, a
            ``DistributedOptimizer``, or a ``ChainedOptimizer`` of them.
        path: the run's checkpoint folder (as for ``Checkpointer``).
        **checkpointer_args: any other ``Checkpointer`` keyword (``scheduler`` for
            Megatron's ``OptimizerParamScheduler``, ``dataloader``, ``extra``,
            ``keep_last``, ``probe``, ``async_save``, ...); a ``probe`` is called with
            ``model`` as given here.
    Returns:
        the Checkpointer, with components ``model``, ``optimizer`` and ``megatron_rng``
        as described in this module's docstring.
    Raises:
        TypeError: the model or optimizer is of a kind this cannot save exactly (the
            message names it and says what to use instead).
        ValueError: a parallel layout this cannot save exactly (pipeline or expert
            parallelism, gated linear units or strided partitions under TP, a
            ``DistributedOptimizer`` with ``overlap_param_gather``), or
            ``checkpointer_args`` names ``model`` or ``optimizer``, or ``extra`` reuses
            ``megatron_rng``.

    Example::

        ckpt = checkpointer_for(model, optimizer, "ckpts/run1", scheduler=scheduler)
        for step in range(ckpt.restore().step, total):
            loss = train_step()
            ckpt.track(step + 1, loss=loss)
            if (step + 1) % 100 == 0 or ckpt.should_stop(step + 1):
                ckpt.save(step + 1)
    """
    taken = sorted({"model", "optimizer"} & set(checkpointer_args))
    if taken:
        raise ValueError(f"checkpointer_for passes {taken} itself: leave them out")
    extra = dict(checkpointer_args.pop("extra", None) or {})
    if RNG_TRACKER in extra:
        raise ValueError(
            f"extra reuses the component name {RNG_TRACKER!r}, which checkpointer_for adds"
        )
    if _megatron_fsdp.is_megatron_fsdp(model):
        return _megatron_fsdp.checkpointer_for(model, optimizer, path, extra, **checkpointer_args)
    chunk = _chunk(model)
    _check_layout(chunk)
    tp = TensorParallel(_tp_mesh(chunk))
    leaves = _leaves(optimizer, chunk)
    state = ModelState(chunk, tp, leaves)
    _check_optimizer_params(leaves, state, chunk)
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    extra[RNG_TRACKER] = RNGTrackerState(get_cuda_rng_tracker)
    extra[RNG_TRACKER].state_dict()  # refuses a tracker it cannot save, now
    user_probe = checkpointer_args.pop("probe", None)
    if user_probe is not None:
        # The Checkpointer holds the view (state only): the probe gets the model given.
        checkpointer_args["probe"] = lambda _view: user_probe(model)
    return Checkpointer(
        path,
        model=state,
        optimizer=OptimizerState(leaves, state, tp),
        extra=extra,
        **checkpointer_args,
    )


def _chunk(model: Any) -> nn.Module:
    """The one model chunk inside Megatron's wrappers."""
    if isinstance(model, Sequence) and not isinstance(model, nn.Module):
        if len(model) != 1:
            raise TypeError(
                f"model is a list of {len(model)} model chunks (virtual pipeline "
                "parallelism); checkpointer_for saves one chunk: build the model without "
                "virtual_pipeline_model_parallel_size"
            )
        model = model[0]
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a Megatron model chunk, got {type(model).__qualname__}")
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    wrappers = (DistributedDataParallel, Float16Module, nn.parallel.DistributedDataParallel)
    while isinstance(model, wrappers):
        model = model.module
    return model


def _check_layout(chunk: nn.Module) -> None:
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        raise ValueError(
            "pipeline parallelism (pipeline_model_parallel_size > 1) is not supported: each "
            "stage numbers its layers from 0, so FQNs collide across stages. Train with "
            "pipeline_model_parallel_size=1, or save with Megatron's dist_checkpointing"
        )
    config = getattr(chunk, "config", None)
    if getattr(config, "num_moe_experts", None):
        raise ValueError(
            "mixture-of-experts models (num_moe_experts) are not supported: expert "
            "parameters are split over the expert-parallel group, which this does not map; "
            "save them with Megatron's dist_checkpointing"
        )
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    for name, p in chunk.named_parameters():
        if not getattr(p, "tensor_model_parallel", False):
            continue
        if tp_size > 1 and getattr(config, "gated_linear_unit", False) and "linear_fc1" in name:
            raise ValueError(
                f"parameter {name} is a gated linear unit (gated_linear_unit=True, e.g. "
                "swiglu) split across tensor-parallel ranks: each rank holds its slice of "
                "the gate and of the up projection one after the other, so the ranks' "
                "slices joined are not the layer's weight and would restore wrong at another "
                "TP size. Use tensor_model_parallel_size=1 or a non-gated MLP"
            )
        stride = getattr(p, "partition_stride", 1)
        if tp_size > 1 and stride != 1:
            raise ValueError(
                f"parameter {name} is split across tensor-parallel ranks with partition_stride="
                f"{stride}: its slices are interleaved, not one block per rank, so a whole "
                "tensor cannot be made of them. Build the model without strided partitions"
            )
    for name, module in chunk.named_modules():
        extra = module.get_extra_state() if _has_extra_state(module) else None
        if extra is not None:
            raise TypeError(
                f"module {name or '(root)'} ({type(module).__name__}) keeps extra state "
                "(Transformer Engine's FP8 metadata?) that this does not save: build the "
                "model with the local layer spec (get_gpt_layer_local_spec)"
            )


def _has_extra_state(module: nn.Module) -> bool:
    return type(module).get_extra_state is not nn.Module.get_extra_state


def _tp_mesh(chunk: nn.Module) -> DeviceMesh | None:
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return None
    device = next((p.device for p in chunk.parameters()), torch.device("cpu"))
    group = parallel_state.get_tensor_model_parallel_group()
    return DeviceMesh.from_group(group, device_type=device.type)


def _leaves(optimizer: Any, chunk: nn.Module) -> list[LeafView]:
    """The optimizers inside a ChainedOptimizer (or the one given), each checked and seen
    per model parameter."""
    from megatron.core.optimizer import ChainedOptimizer

    leaves = (
        list(optimizer.chained_optimizers)
        if isinstance(optimizer, ChainedOptimizer)
        else [optimizer]
    )
    views: list[LeafView] = []
    for i, leaf in enumerate(leaves):
        name = type(leaf).__name__
        where = "optimizer" if leaf is optimizer else f"optimizer.chained_optimizers[{i}]"
        if name not in _SUPPORTED_OPTIMIZERS or getattr(leaf, "optimizer", None) is None:
            raise TypeError(
                f"{where} is a {name} object; checkpointer_for saves Megatron's "
                f"{', '.join(_SUPPORTED_OPTIMIZERS)} (and a ChainedOptimizer of them), "
                "as get_megatron_optimizer builds them"
            )
        if name == "DistributedOptimizer":
            check_distributed(leaf, where)
        if not isinstance(leaf.optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"{where}.optimizer is a {type(leaf.optimizer).__name__}, not a torch "
                "optimizer (Apex or Transformer Engine's fused Adam?): its state is not "
                "torch's; install megatron-core without them, or use torch's Adam"
            )
        if name == "DistributedOptimizer":
            names = {p: n for n, p in chunk.named_parameters()}
            views.append(DistOptLeaf(leaf, names))
        else:
            views.append(PlainLeaf(leaf))
    return views


def _check_optimizer_params(leaves: list[LeafView], state: ModelState, chunk: nn.Module) -> None:
    """Every parameter a leaf optimizer steps belongs to this model chunk."""
    known = set(state.faces)
    for leaf in leaves:
        for g, (_, params) in enumerate(leaf.groups()):
            for j, p in enumerate(params):
                if p not in known:
                    raise ValueError(
                        f"the optimizer steps a parameter (group {g}, position {j}, shape "
                        f"{tuple(p.shape)}) that is not one of {type(chunk).__name__}'s: pass "
                        "the model chunk the optimizer was built for"
                    )
