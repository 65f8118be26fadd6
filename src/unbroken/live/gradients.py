"""Gradients a save finds on the parameters: pending work, warned about or saved.

A save in the middle of gradient accumulation (``backward()`` ran for some micro-batches,
the optimizer has not stepped) finds parameters holding gradients that the next
``optimizer.step()`` would use. A checkpoint without them resumes with the accumulation
restarted from nothing, and the resumed run diverges. So a save either

- warns (``Checkpointer(gradients="warn")``, the default): :func:`held` names the
  parameters holding a nonzero gradient, the manifest records how many (``gradients``)
  and the warning joins the save's warnings; or
- saves them (``gradients="save"``): :class:`GradientsComponent` holds every ``.grad``
  that exists, keyed by parameter FQN, and a restore puts each back bit for bit (and
  sets the others to None), so a stop between micro-batches resumes exactly.

Cheap by design: with torch's default ``zero_grad(set_to_none=True)`` no gradient exists
between steps and the check is one ``p.grad is not None`` scan. Gradients that exist
are read once, on their device, in one reduction per device: a gradient that is all
zeros (``zero_grad(set_to_none=False)``) holds no pending work and is not warned about.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..errors import CheckpointError
from ..format import tree
from .state import Component, ModelComponent, StatefulComponent, empty_target, listing

MODES = ("warn", "save")
NAME = "gradients"  # the component's name, and the manifest field's
_SHOWN = 5  # FQNs a record and a warning name


def check_mode(mode: Any) -> str:
    """``mode`` if it is one of :data:`MODES`, else ``ValueError`` naming the argument."""
    if mode not in MODES:
        raise ValueError(f"gradients must be 'warn' or 'save', got {mode!r}")
    return mode


class _Grads:
    """The ``.grad`` of every parameter of a model, as a Stateful object."""

    def __init__(self, model: ModelComponent) -> None:
        self._model = model

    def params(self) -> dict[str, torch.nn.Parameter]:
        try:
            return {fqn: p for p, fqn in self._model.parameter_fqns().items()}
        except CheckpointError as exc:
            raise CheckpointError(f'gradients="save": {exc}') from None

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {fqn: p.grad for fqn, p in self.params().items() if p.grad is not None}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        params = self.params()
        unknown = sorted(set(state) - set(params))
        if unknown:
            raise CheckpointError(
                f"the checkpoint holds gradients of {len(unknown)} parameter(s) the live "
                f"model lacks: {listing(unknown)}; the architecture changed since the save"
            )
        for fqn, p in params.items():  # the loaded (verified) tensors themselves: no copy
            p.grad = state.get(fqn)


class GradientsComponent(StatefulComponent):
    """``gradients``: the parameters' ``.grad`` (``Checkpointer(gradients="save")``).

    Saved once when every rank holds the same gradients (synchronized DDP), per rank
    when they differ (DDP accumulating under ``no_sync()``: restorable onto the same world
    size only); an FSDP2 model's gradients are DTensors, saved sharded like its parameters.
    """

    def __init__(self, model: ModelComponent) -> None:
        super().__init__(NAME, _Grads(model), kind=NAME)
        self._grads: _Grads = self.objects[None]

    def targets(self, saved_keys: dict[str, dict], live: dict[str, torch.Tensor]) -> dict:
        """Each saved gradient's target placed like its parameter (device, sharding)."""
        like = {tree.join_key(fqn): p for fqn, p in self._grads.params().items()}
        return {
            key: empty_target(entry, like.get(key.rsplit("/", 1)[-1]))
            for key, entry in saved_keys.items()
        }


def saves(components: list[Component]) -> bool:
    """Whether a save of ``components`` keeps the gradients (``gradients="save"``)."""
    return any(isinstance(c, GradientsComponent) for c in components)


def held(components: list[Component]) -> list[str]:
    """This rank's view, at save: the FQNs of the parameters whose gradients the save
    keeps (with a :class:`GradientsComponent`: every existing ``.grad``), else of those
    holding a nonzero gradient (pending work the checkpoint will lack). Sorted."""
    models = [c for c in components if isinstance(c, ModelComponent)]
    found: list[tuple[str, torch.Tensor]] = []
    for model in models:
        for param, fqns in model.parameter_fqn_sets().items():
            if param.grad is not None:
                found.append((min(fqns), param.grad))
    if not saves(components):
        flags = _nonzero([g for _, g in found])
        found = [pair for pair, live in zip(found, flags, strict=True) if live]
    return sorted(fqn for fqn, _ in found)


def _nonzero(grads: list[torch.Tensor]) -> list[bool]:
    """Whether each gradient holds a nonzero value (NaN counts): one reduction per
    tensor, one device round trip per device."""
    flags: list[bool] = [True] * len(grads)
    by_device: dict[torch.device, list[int]] = {}
    parts = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    for i, g in enumerate(parts):
        by_device.setdefault(g.device, []).append(i)
    for where in by_device.values():
        try:
            anys = [_any(parts[i]) for i in where]
            for i, flag in zip(where, torch.stack(anys).tolist(), strict=True):
                flags[i] = bool(flag)
        except (RuntimeError, NotImplementedError):  # a dtype without any(): say pending
            pass
    return flags


def _any(g: torch.Tensor) -> torch.Tensor:
    g = g.detach()
    return (torch.view_as_real(g) if g.is_complex() else g).any()


def record(per_rank: list[list[str]], *, saved: bool) -> dict[str, Any] | None:
    """The manifest's ``gradients`` record from every rank's :func:`held`: how many
    parameters held gradients at save, whether the checkpoint holds them, the first few
    FQNs; None when none did."""
    fqns = sorted({fqn for names in per_rank for fqn in names})
    if not fqns:
        return None
    return {"held": len(fqns), "saved": saved, "parameters": fqns[:_SHOWN]}


def warning(found: Mapping[str, Any] | None) -> str | None:
    """The save warning for a ``gradients`` record of gradients not saved, else None."""
    if not found or found.get("saved"):
        return None
    count, names = found["held"], found["parameters"]
    more = f" and {count - len(names)} more" if count > len(names) else ""
    return (
        f"saved in the middle of gradient accumulation: {count} parameter(s) hold nonzero "
        f"gradients ({', '.join(names)}{more}) from backward() calls whose optimizer step "
        "has not run; the checkpoint does not hold them, so a resume from it restarts the "
        "accumulation from nothing and diverges from an uninterrupted run. Save after "
        'optimizer.step() and zero_grad(), or pass Checkpointer(gradients="save") to '
        "save them with the checkpoint"
    )
