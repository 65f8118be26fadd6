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

Pending means not yet used by an optimizer step: a gradient that the last ``step()`` of
its optimizer already consumed (a loop that calls ``zero_grad()`` at the start of each
step keeps it until then) is no pending work; :class:`StepWatch` tells it by a step
post-hook noting which ``.grad`` each parameter held (the tensor, by weak reference, and
its version counter, which backward's accumulation advances). Nor is a gradient that is
all zeros (``zero_grad(set_to_none=False)``).

Cheap by design: with torch's default ``zero_grad(set_to_none=True)`` no gradient exists
between steps and the save's check is one ``p.grad is not None`` scan. Gradients that
exist and were not consumed are read once, on their device, in one reduction per
device, to tell zeros from work.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..errors import CheckpointError, StateMismatchError
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
            try:
                p.grad = state.get(fqn)
            except RuntimeError as exc:  # torch's own checks: dtype, shape, device
                raise StateMismatchError(
                    f"the saved gradient of {fqn!r} does not fit the live parameter ({exc}); "
                    "restore with the model built as at the save, or "
                    'restore(reset={"gradients"}) to start without the saved gradients'
                ) from None


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


class StepWatch:
    """Which gradients optimizer steps consumed (module docstring).

    A global optimizer step post-hook (torch's ``register_optimizer_step_post_hook``:
    every optimizer counts, passed to the Checkpointer or not, e.g. one a framework
    wraps) notes, for each parameter of the optimizer that stepped, the ``.grad`` it
    held after the step: by weak references (a gradient freed by ``zero_grad()`` is not
    kept alive) and its version counters. Costs one pass over that optimizer's
    parameters per ``step()``. Not thread-safe: steps and saves come from the training
    loop's thread.
    """

    def __init__(self) -> None:
        self._seen: dict[int, tuple[weakref.ref, weakref.ref, tuple[int, int]]] = {}
        mine = weakref.ref(self)  # the hook keeps no watch alive; a dropped one goes

        def hook(opt: torch.optim.Optimizer, *_: Any) -> None:
            watch = mine()
            if watch is not None:
                watch._stepped(opt)

        self._handle: Any = register_optimizer_step_post_hook(hook)
        weakref.finalize(self, self._handle.remove)

    def _stepped(self, opt: torch.optim.Optimizer) -> None:
        # On every step: kept lean (a parameter without a gradient leaves a stale entry,
        # which consumed() never matches, rather than costing a deletion).
        seen, ref = self._seen, weakref.ref
        for group in opt.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is not None:
                    seen[id(p)] = (ref(p), ref(g), _versions(g))

    def consumed(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s gradient is the one an optimizer's last step of ``p`` used,
        unchanged since."""
        g, seen = p.grad, self._seen.get(id(p))
        if g is None or seen is None:
            return False
        return seen[0]() is p and seen[1]() is g and seen[2] == _versions(g)

    def close(self) -> None:
        """Remove the step hook."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._seen.clear()


# One watch for the process, from the import of unbroken on: a step taken before the
# Checkpointer was made (a warm-up, a run that builds it at its first save) is seen too,
# where a watch of the Checkpointer's own would take its gradients for pending work.
WATCH = StepWatch()


def _versions(g: torch.Tensor) -> tuple[int, int]:
    # A DTensor's in-place ops advance its own counter, writes into its shard only the
    # shard's: both are watched.
    return g._version, (g.to_local() if isinstance(g, DTensor) else g)._version


def held(components: list[Component], watch: StepWatch | None = None) -> list[str]:
    """This rank's view, at save: the FQNs of the parameters whose gradients the save
    keeps (with a :class:`GradientsComponent`: every existing ``.grad``), else of those
    holding pending work the checkpoint will lack: a nonzero gradient that the ``watch``
    does not know as consumed by an optimizer step. Sorted."""
    models = [c for c in components if isinstance(c, ModelComponent)]
    saving = saves(components)
    found: list[tuple[str, torch.Tensor]] = []
    for model in models:
        modules = model.models.values()
        if all(p.grad is None for m in modules for p in m.parameters()):
            continue  # the common case, torch's default: no FQNs worked out
        for param, fqns in model.parameter_fqn_sets().items():
            if param.grad is None:
                continue
            if saving or watch is None or not watch.consumed(param):
                found.append((min(fqns), param.grad))
    if not saving:
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
