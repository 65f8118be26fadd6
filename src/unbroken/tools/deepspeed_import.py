"""``unbroken import`` of a DeepSpeed checkpoint folder: saved as ``checkpointer_for(engine)``
saves (``integrations/deepspeed.py``), so a DeepSpeed engine restores it at any world size
and ZeRO stage.

The factory builds the module as it was before ``deepspeed.initialize`` (floating tensors
are cast to the checkpoint's compute dtype, as the engine does) and, optionally, the torch
optimizer given to it, whose class is recorded (default ``torch.optim.AdamW``, also what
DeepSpeed's ``"AdamW"`` with ``"torch_adam": true`` runs).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import StateMismatchError
from ..live.optimizer import class_name
from . import deepspeed_folders

ENGINE_COMPONENT = "deepspeed"  # as integrations/deepspeed.py saves the engine's counters
DEFAULT_CLASS = "torch.optim.adamw.AdamW"


class ImportedZeroOptimizer(torch.optim.Optimizer):
    """The imported per-parameter state, shown as a torch optimizer over the model's
    parameters with the class it was trained with. It never steps."""

    def __init__(self, model: nn.Module, ds: deepspeed_folders.DeepSpeedState, shown: str) -> None:
        params = dict(model.named_parameters())
        self.shown_class = shown
        self._saved = ds
        groups = [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [params[n] for n in g["params"]],
            }
            for g in ds.param_groups
        ]
        super().__init__(groups, defaults={})
        self._names = [n for g in ds.param_groups for n in g["params"]]

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        raise RuntimeError("an imported DeepSpeed optimizer state does not step")

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        ds = self._saved
        index = {n: i for i, n in enumerate(self._names)}
        groups = [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [index[n] for n in g["params"]],
            }
            for g in ds.param_groups
        ]
        return {"state": {index[n]: dict(ds.state[n]) for n in self._names}, "param_groups": groups}


def prepare(
    source: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    trust_pickle: bool,
    ignore: Iterable[str] = (),
) -> tuple[deepspeed_folders.DeepSpeedState, ImportedZeroOptimizer]:
    """Read ``source`` and make ``model`` ready to take its compute weights; the optimizer
    view to save. Raises as :func:`deepspeed_folders.read`, and StateMismatchError when the
    factory's optimizer is not the checkpoint's kind or the model's parameters differ."""
    ds = deepspeed_folders.read(source, trust_pickle=trust_pickle, ignore=ignore)
    dtypes = {v.dtype for v in ds.model.values() if v.is_floating_point()}
    if len(dtypes) == 1:
        (dtype,) = dtypes
        if any(p.is_floating_point() and p.dtype != dtype for p in model.parameters()):
            model.to(dtype)  # as DeepSpeed's engine casts the module (bf16)
    names = {n for n, _ in model.named_parameters()}
    held = {n for g in ds.param_groups for n in g["params"]}
    if names != held:
        raise StateMismatchError(
            f"{ds.folder}: the factory's model has parameters {sorted(names - held)[:5]} the "
            f"checkpoint lacks, and lacks {sorted(held - names)[:5]} it holds"
        )
    shown = DEFAULT_CLASS
    if optimizer is not None:
        shown = class_name(optimizer)
        ours = {k for k in optimizer.param_groups[0] if k != "params"}
        theirs = {k for k in ds.param_groups[0] if k != "params"}
        if not ours <= theirs:  # a scheduler may add its own (initial_lr)
            raise StateMismatchError(
                f"{ds.folder}: the factory's {shown} has hyperparameters "
                f"{sorted(ours - theirs)} the checkpoint's optimizer groups lack (they hold "
                f"{sorted(theirs)}): return the optimizer it was trained with"
            )
    return ds, ImportedZeroOptimizer(model, ds, shown)


class Counters:
    """The engine's counters, saved as ``checkpointer_for`` saves them."""

    def __init__(self, counters: dict[str, int]) -> None:
        self.counters = counters

    def state_dict(self) -> dict[str, int]:
        return dict(self.counters)

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.counters = dict(state)
