"""Undo for a restore: what each live object held before anything was installed into it.

A restore is all or nothing. Everything is read and verified before the first live
object changes; if installing or the checks after it fail midway, each component is put
back with the undo taken here (or, for a model installed by exchanging bytes, with the
exchange: see ``exchange``). Costs: a model's tensors are cloned on their own device
(one extra copy of the weights while the restore runs; :func:`begin` makes that copy
while the checkpoint is being read); an optimizer keeps references to its previous state
(``load_state_dict`` replaces state objects, it does not write into them); other
components' ``state_dict()`` is deep-copied.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .optimizer import OptimizerComponent
from .state import Component, ModelComponent

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
    return lambda: component.install(before)


def _clone(value: Any) -> Any:
    if isinstance(value, DTensor | torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value


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
            opt.state, opt.param_groups = state, groups

    return undo


def _stateful(component: Component) -> Undo:
    try:
        before = copy.deepcopy(component.capture())
    except Exception as exc:
        why = f"{type(exc).__name__}: {exc}"

        def cannot() -> None:
            raise RuntimeError(f"its state_dict() could not be copied beforehand ({why})")

        return cannot
    return _reinstall(component, before)
