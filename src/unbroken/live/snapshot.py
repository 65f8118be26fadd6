"""Undo for a restore: what each live object held before anything was installed into it.

A restore is all or nothing. Everything is read and verified before the first live
object changes; if installing or the checks after it fail midway, each component is put
back with the undo taken here (or, for a model installed by exchanging bytes, with the
exchange: see ``exchange``). Costs: a model's tensors are cloned on their own device
(one extra copy of the weights while the restore runs; :func:`begin` makes that copy
while the checkpoint is being read; a GPU tensor the device has no room to copy is copied
to host memory instead, with a warning), and a lazy module's uninitialized tensors, which the
install materializes, are made uninitialized again; an optimizer keeps references to its
previous state (``load_state_dict`` replaces state objects, it does not write into them);
other components' ``state_dict()`` is deep-copied.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from . import torch_compat
from .optimizer import OptimizerComponent
from .state import Component, ModelComponent

logger = logging.getLogger(__name__)

Undo = Callable[[], None]


class Pending:
    """Undos being taken (:func:`begin`); :meth:`collect` waits for them."""

    def __init__(self, collect: Callable[[], list[Undo]]) -> None:
        self._collect = collect

    def collect(self) -> list[Undo]:
        """The undos, in the order of the components given to :func:`begin`."""
        return self._collect()


def begin(components: Sequence[Component], given: Mapping[str, Undo] | None = None) -> Pending:
    """Start taking the undos of ``components``, to be collected (in order) with
    :meth:`Pending.collect` before anything is installed; an undo raises if the previous
    state cannot be put back. ``given``: undos the caller already has, by component name (a model
    installed by exchanging bytes keeps its previous values itself). Each other
    component's state is captured here, in the calling thread (a capture may be
    collective); a model's tensors are cloned in a background thread meanwhile,
    overlapping whatever the caller does next (the read). The live objects must not
    change until the undos are collected."""
    given = given or {}
    models = {
        i: c.capture()
        for i, c in enumerate(components)
        if isinstance(c, ModelComponent) and c.name not in given
    }
    others = {
        i: given[c.name] if c.name in given else _take(c)
        for i, c in enumerate(components)
        if i not in models
    }
    copying = None
    if models:
        pool = ThreadPoolExecutor(1, thread_name_prefix="unbroken-undo")
        copying = pool.submit(lambda: {i: _clone(state) for i, state in models.items()})
        pool.shutdown(wait=False)

    def collect() -> list[Undo]:
        copies = copying.result() if copying is not None else {}
        return [
            others[i] if i in others else _reinstall(c, copies[i]) for i, c in enumerate(components)
        ]

    return Pending(collect)


def _take(component: Component) -> Undo:
    if isinstance(component, OptimizerComponent):
        return _optimizer(component)
    return _stateful(component)


def _reinstall(component: Component, before: Any) -> Undo:
    # Every undo is idempotent (it installs the same copy, or the same objects, again): a
    # rollback that an interrupt cut short runs it again to complete it (core/transaction).
    def undo() -> None:
        lazy: list[_Uninitialized] = []
        state = _values(before, lazy)
        for held in lazy:  # materialized by the install: uninitialized again, as before
            if not torch_compat.is_uninitialized(held.tensor):
                torch_compat.unmaterialize(held.tensor, held.kind)
        component.install(state)
        if isinstance(component, ModelComponent):
            _require_put_back(component, before)

    return undo


def _require_put_back(component: ModelComponent, before: Any) -> None:
    """Raise unless the model holds its copies bit for bit again: the install goes through
    the module's own load hooks, which may convert what they are given."""
    live = component.capture()
    changed = [key for key, held, now in _pairs(before, live) if not _same_bits(held, now)]
    if changed:
        shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if changed[5:] else "")
        raise RuntimeError(
            f"its previous values did not come back bit for bit ({shown}): its own "
            "load_state_dict (a load hook, a cast) changed what it was given back"
        )


def _pairs(held: Any, live: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(key, held copy, live value) of every tensor copied by :func:`_clone`."""
    if isinstance(held, dict):
        live = live if isinstance(live, Mapping) else {}
        return [
            pair
            for k, v in held.items()
            for pair in _pairs(v, live.get(k), f"{prefix}{k}" if not prefix else f"{prefix}.{k}")
        ]
    if isinstance(held, DTensor | torch.Tensor):
        return [(prefix, held, live)]
    return []


def _same_bits(a: torch.Tensor, b: Any) -> bool:
    if not isinstance(b, DTensor | torch.Tensor):
        return False
    a = a.to_local() if isinstance(a, DTensor) else a
    b = b.to_local() if isinstance(b, DTensor) else b
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.detach().reshape(-1).contiguous(), b.detach().reshape(-1).to(a.device).contiguous()
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


class _Uninitialized:
    """A lazy module's tensor that had no values yet (kept itself, not copied)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.kind = type(tensor)


def _clone(value: Any) -> Any:
    if isinstance(value, DTensor | torch.Tensor):
        if torch_compat.is_uninitialized(value):
            return _Uninitialized(value)
        try:
            return value.detach().clone()
        except torch.OutOfMemoryError:
            if isinstance(value, DTensor) or value.device.type == "cpu":
                raise
            # The device has no room for the copy: it is kept in host memory instead,
            # and put back from there (slower, one copy to and one from the host).
            logger.warning(
                "restore: no room on %s for the undo copy of a %s tensor of %d bytes; kept "
                "in host memory instead",
                value.device,
                tuple(value.shape),
                value.nbytes,
            )
            return value.detach().to("cpu")
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value


def _values(copy: Any, lazy: list[_Uninitialized]) -> Any:
    """The state to install from a :func:`_clone` copy; its uninitialized tensors listed."""
    if isinstance(copy, _Uninitialized):
        lazy.append(copy)
        return copy.tensor
    if isinstance(copy, dict):
        return {k: _values(v, lazy) for k, v in copy.items()}
    return copy


def _optimizer(component: OptimizerComponent) -> Undo:
    saved = [
        (opt, opt.state, opt.param_groups, opt.state_dict())
        for opt in component.optimizers.values()
    ]

    def undo() -> None:
        for opt, state, groups, state_dict in saved:
            # Through load_state_dict first, so wrappers put back their own attributes;
            # then the very objects the optimizer held (torch casts on load).
            opt.load_state_dict(state_dict)
            _put_back(opt, "state", state)
            _put_back(opt, "param_groups", groups)

    return undo


def _put_back(opt: torch.optim.Optimizer, name: str, before: Any) -> None:
    """``opt.<name> = before``; where a wrapper gives its base optimizer's as a read-only
    property (a Lookahead), ``before``'s contents go into the one it gives."""
    try:
        setattr(opt, name, before)
    except AttributeError:
        live = getattr(opt, name)
        if live is before:
            return
        live.clear()
        if isinstance(live, dict):
            live.update(before)
        else:
            live.extend(before)


def _stateful(component: Component) -> Undo:
    try:
        before = copy.deepcopy(component.capture())
    except Exception as exc:
        why = f"{type(exc).__name__}: {exc}"

        def cannot() -> None:
            raise RuntimeError(f"its state_dict() could not be copied beforehand ({why})")

        return cannot
    return _reinstall(component, before)
