"""The components of a Checkpointer, built from what the caller passed, in install order:
model, optimizer, the gradients (when saved), scheduler, extras, dataloader, and the RNG
streams last (so nothing installed before it can shift a random draw)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from .dataloader import dataloader_component
from .gradients import GradientsComponent
from .optimizer import OptimizerComponent
from .rng import RNGState
from .state import Component, ModelComponent, StatefulComponent

BUILTIN_COMPONENTS = ("model", "optimizer", "scheduler", "dataloader", "rng")


def rank_prefix(name: str, rank: int) -> str:
    """The tensor-key prefix of ``rank``'s state of a component saved per rank."""
    return f"{name}/rank_{rank:05d}"


def component_prefix(component: Component, rank: int) -> str:
    """The tensor-key prefix of ``component``'s state on ``rank``."""
    return rank_prefix(component.name, rank) if component.per_rank else component.name


def build_components(
    model: nn.Module | Mapping[str, nn.Module],
    optimizer: Any,
    scheduler: Any,
    dataloader: Any,
    extra: Mapping[str, Any] | None,
    *,
    gradients: str = "warn",
    frozen: str = "save",
) -> list[Component]:
    """One component per argument given; ``rng`` always; ``gradients`` with
    ``gradients="save"`` (live/gradients.py); ``frozen``: the model's frozen mode."""
    model_c = ModelComponent(model, frozen_mode=frozen)
    comps: list[Component] = [model_c]
    if optimizer is not None:
        comps.append(OptimizerComponent(optimizer, model_c))
    if gradients == "save":
        if "gradients" in (extra or {}):
            raise ValueError('extra key "gradients" is taken by gradients="save": rename it')
        comps.append(GradientsComponent(model_c))
    if scheduler is not None:
        comps.append(StatefulComponent("scheduler", scheduler, kind="scheduler"))
    for name, obj in (extra or {}).items():
        if not isinstance(name, str) or not name.isidentifier() or name in BUILTIN_COMPONENTS:
            raise ValueError(
                f"extra key {name!r} must be an identifier other than {BUILTIN_COMPONENTS}"
            )
        comps.append(StatefulComponent(name, obj, kind="extra"))
    if dataloader is not None:
        comps.append(dataloader_component(dataloader))
    comps.append(StatefulComponent("rng", RNGState(), kind="rng", per_rank=True))
    return comps


def as_step(step: Any) -> int:
    """A step as an int: Python, NumPy and 0-d integer tensors are accepted."""
    if isinstance(step, torch.Tensor) and step.dim() == 0 and not step.is_floating_point():
        step = step.item()
    elif isinstance(step, np.integer):
        step = int(step)
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    return int(step)
