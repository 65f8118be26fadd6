"""The gap between ``restore()`` and the first optimizer step, checked once per resume.

A restore is verified when it ends, but the training loop may change the model after it
and before it trains: Lightning's own ``ModelParallelStrategy`` example calls
``init_weights()`` in ``on_train_start``, which Lightning runs after the callbacks' hook
where the restore happens; a script may load pretrained weights, re-initialize or
re-wrap after ``restore()``. Training then goes on from values that were never restored,
with the restored optimizer, step, data position and RNG, and nothing fails.

:class:`FirstStepCheck` closes that gap: the first step of any optimizer after a restore
first compares the model's parameters and the optimizers' state with what the restore
installed (this rank's fingerprint shares, as the restore's own check computed them;
on the tensors' own device) and raises ``StateMismatchError`` naming what changed. The
model's buffers are left out: a forward in training mode updates BatchNorm's running
statistics before the first step. No collective beyond what capturing the state needs
(an FSDP1 optimizer's), which every rank does at the same first step.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from ..core import collective
from ..core.verify import held_partial
from ..errors import StateMismatchError
from ..live.components import component_prefix
from ..live.optimizer import OptimizerComponent
from ..live.state import Component, ModelComponent, live_tensors

_SHOWN = 8  # changed tensors named in the error


class FirstStepCheck:
    """Armed by a restore; the first optimizer step checks and disarms it.

    Args:
        components: the Checkpointer's components (models and optimizers are checked).
        installed: key -> this rank's fingerprint share of the value the restore
            installed (None where it holds none).
        algorithm: the fingerprint algorithm of those shares.
    """

    def __init__(
        self,
        components: list[Component],
        installed: Mapping[str, int | None],
        algorithm: str,
    ) -> None:
        self._components = [
            c for c in components if isinstance(c, ModelComponent | OptimizerComponent)
        ]
        self._installed = dict(installed)
        self._algorithm = algorithm
        self._hooks: list[RemovableHandle] = []
        self.done = False  # checked (or closed): the hooks do nothing any more
        ref = weakref.ref(self)

        def before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
            check = ref()
            if check is not None:
                check.before_first_step()

        self._hooks.append(register_optimizer_step_pre_hook(before_step))
        for c in self._components:
            if isinstance(c, OptimizerComponent):
                for opt in c.optimizers.values():
                    if not isinstance(opt, torch.optim.Optimizer):  # the common hook skips it
                        register = getattr(opt, "register_step_pre_hook", None)
                        if callable(register):
                            self._hooks.append(register(before_step))

    def before_first_step(self) -> None:
        """Disarm, then compare; raise ``StateMismatchError`` naming what changed. The
        hooks stay registered, doing nothing, until :meth:`close`: torch iterates them
        while this runs, and removing one then breaks its iteration."""
        if self.done:
            return
        self.done = True
        changed = self.changed()
        if changed:
            shown = ", ".join(changed[:_SHOWN])
            more = f" and {len(changed) - _SHOWN} more" if len(changed) > _SHOWN else ""
            raise StateMismatchError(
                "something changed the model or the optimizer after restore() and before "
                f"the first optimizer step; not the restored values any more: {shown}{more}. "
                "Likely an initialization in a framework hook that runs after the "
                "restore (Lightning: on_train_start of the LightningModule), a pretrained "
                "load, or a re-wrap after restore(); do it before restore(), or not on a "
                "resume"
            )

    def changed(self) -> list[str]:
        """The keys whose live value is not the one installed (buffers left out)."""
        rank = collective.rank()
        out: list[str] = []
        for c in self._components:
            _, live = live_tensors(c, component_prefix(c, rank))
            buffers = _buffer_storages(c) if isinstance(c, ModelComponent) else set()
            for key, t in live.items():
                if key not in self._installed or _storage(t) in buffers:
                    continue
                if held_partial(t, self._algorithm, key) != self._installed[key]:
                    out.append(key)
        return out

    def close(self) -> None:
        """Disarm and remove the hooks (never from within an optimizer step; safe to call
        more than once)."""
        self.done = True
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def _storage(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.untyped_storage().data_ptr() if local.numel() else -1


def _buffer_storages(c: ModelComponent) -> set[int]:
    return {_storage(b) for m in c.models.values() for b in m.buffers()} - {-1}
