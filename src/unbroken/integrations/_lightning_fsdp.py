"""The Lightning strategies :class:`~unbroken.integrations.lightning.UnbrokenCallback`
supports, and what sharding changes for it: which module holds the trained state, and how
the gradients' total norm is summed over shards.

Checked against Lightning 2.6:

- ``SingleDeviceStrategy`` and ``DDPStrategy``: the LightningModule holds every parameter
  whole (DDP's wrapper is outside it).
- ``FSDPStrategy`` (FSDP1): ``strategy.model`` is ``FullyShardedDataParallel`` around the
  LightningModule (``FSDPStrategy._setup_model``), unless ``configure_model`` wrapped
  submodules itself. The root wrapper holds the flat parameters of everything not in a
  nested unit, so the state is read through it; its FQNs are the LightningModule's
  (torch drops FSDP's prefixes). On one device FSDP1 falls back to ``NO_SHARD``
  (supported with ``use_orig_params=True``, Lightning's default).
- ``ModelParallelStrategy`` (FSDP2 ``fully_shard`` and tensor parallel, applied in
  ``configure_model``): the LightningModule itself holds the DTensor parameters.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import (
    DDPStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
)
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.tensor import DTensor

from ..live import fsdp1

SUPPORTED_STRATEGIES = (SingleDeviceStrategy, DDPStrategy, FSDPStrategy, ModelParallelStrategy)
SUPPORTED_NAMES = (
    "one device, strategy='ddp', FSDPStrategy (FSDP1) or ModelParallelStrategy (FSDP2)"
)


def trained_module(trainer: pl.Trainer, pl_module: pl.LightningModule) -> nn.Module:
    """The module whose state is the run's model: FSDP1's root wrapper under
    ``FSDPStrategy``, else the LightningModule."""
    if isinstance(trainer.strategy, FSDPStrategy):
        return trainer.strategy.model
    return pl_module


def shard_group(module: nn.Module) -> dist.ProcessGroup | None:
    """The process group ``module``'s sharded FSDP1 units split their flat parameters
    over (each rank holds a part of every flat gradient), or None where plain gradients
    are whole on every rank (one device, DDP, FSDP1 ``NO_SHARD``, FSDP2)."""
    if not fsdp1.is_fsdp1(module):
        return None
    return FullyShardedDataParallel.fsdp_modules(module)[0].process_group


def grad_norm(module: nn.Module, group: dist.ProcessGroup | None) -> torch.Tensor | None:
    """The L2 norm of all of ``module``'s gradients, whole across ranks (collective when
    sharded); None without gradients.

    Plain gradients are whole on every rank, unless ``group`` (:func:`shard_group`) is
    given: then each rank holds its shard of FSDP1's flat gradients, and the squares are
    summed over ``group`` (the parameters of modules FSDP1 ignores, whole on every rank,
    are then counted once per rank). DTensor gradients (FSDP2, tensor parallel) are
    reduced by DTensor over their own mesh (one collective).
    """
    grads = [p.grad.detach() for p in module.parameters() if p.grad is not None]
    if not grads:
        return None
    plain = [g for g in grads if not isinstance(g, DTensor)]
    sharded = [g for g in grads if isinstance(g, DTensor)]
    parts = []
    if plain:
        norm = _norm(plain)
        if group is not None:
            square = norm.square()
            dist.all_reduce(square, group=group)
            norm = square.sqrt()
        parts.append(norm)
    if sharded:
        parts.append(_norm(sharded).full_tensor())
    return parts[0] if len(parts) == 1 else torch.linalg.vector_norm(torch.stack(parts))


def _norm(grads: list[torch.Tensor]) -> torch.Tensor:
    norms = torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])
    return torch.linalg.vector_norm(norms)
