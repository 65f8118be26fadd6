"""DeepSpeed: one :class:`unbroken.Checkpointer` over a ``DeepSpeedEngine``.

    import deepspeed
    from unbroken.integrations.deepspeed import checkpointer_for

    engine, _, loader, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    ckpt = checkpointer_for(engine, "ckpts/run1", dataloader=loader)
    start = ckpt.restore().step

What it saves, by component name (``docs/integrations/deepspeed.md``):

- ``model``: ``engine.module``'s compute weights (bf16 or fp32), whole; under ZeRO-3,
  gathered from each parameter's partitions.
- ``optimizer``: per parameter, the optimizer's fp32 master weight (``fp32_master``) and
  its state (Adam's moments, Muon's ``momentum_buffer``, each in its own dtype), taken
  from ZeRO's flat partitions at every stage (``_deepspeed_zero.py``), and the param
  groups' hyperparameters. What is saved does not depend on the world size or the stage:
  a checkpoint restores onto another world size and another stage.
- ``scheduler``: ``engine.lr_scheduler``, if any.
- ``deepspeed``: the engine's counters (``global_steps``, ``global_samples``,
  ``skipped_steps``, ``micro_steps``).
- ``rng`` and whatever ``dataloader`` / ``extra`` you pass, as with any Checkpointer.

Refused at construction, naming what and what to do: fp16 (its dynamic loss scaler is not
captured), stage 0 with bf16 (DeepSpeed's ``FP16_UnfusedOptimizer``), offloaded optimizer
state or parameters, an optimizer class whose state layout is not known to be captured
whole (DeepSpeed's ``FusedAdam``/``DeepSpeedCPUAdam``: use ``"torch_adam": true`` or a
torch optimizer), and Muon's auxiliary FusedAdam on the CPU (its bias-correction powers
live in its C++ object).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..checkpointer import Checkpointer
from ..errors import CheckpointError, StateMismatchError
from ._byte_gather import gather_bytes
from ._deepspeed_zero import MASTER, MUON_MOMENTUM, ZeroLayout

__all__ = ["checkpointer_for"]

ENGINE_COMPONENT = "deepspeed"
COUNTERS = ("global_steps", "global_samples", "skipped_steps", "micro_steps")
# The torch optimizers over ZeRO's flat partitions whose state is captured whole: Adam's
# family and SGD keep per-element tensors and a step; DeepSpeed's Muon adds its momentum.
KNOWN_OPTIMIZERS = {
    "torch.optim.adamw.AdamW",
    "torch.optim.adam.Adam",
    "torch.optim.sgd.SGD",
    "deepspeed.runtime.zero.muon.muon_optimizer.MuonWithAuxAdam",
}
FUSED_ADAM = "deepspeed.ops.adam.fused_adam.FusedAdam"
KNOWN_AUX = {FUSED_ADAM, *KNOWN_OPTIMIZERS}


def checkpointer_for(
    engine: Any, path: str | os.PathLike, **checkpointer_args: Any
) -> Checkpointer:
    """A :class:`unbroken.Checkpointer` over ``engine`` (``deepspeed.initialize``'s engine).

    Args:
        engine: a ``DeepSpeedEngine`` at ZeRO stage 1, 2 or 3 (bf16 or fp32), or stage 0
            in fp32.
        path: the checkpoint folder (local path or fsspec URL), as for ``Checkpointer``.
        **checkpointer_args: any other ``Checkpointer`` argument (``dataloader``,
            ``extra``, ``keep_last``, ``async_save``...); ``model`` and ``optimizer``
            come from the engine, ``scheduler`` too unless given.

    Raises:
        ValueError: the engine holds state this integration cannot capture exactly
            (named, with what to do), or ``checkpointer_args`` names the engine's parts.
    """
    _check_engine(engine)
    for taken in ("model", "optimizer"):
        if taken in checkpointer_args:
            raise ValueError(
                f"checkpointer_for(engine) takes {taken} from the engine; do not pass {taken}="
            )
    extra = dict(checkpointer_args.pop("extra", None) or {})
    if ENGINE_COMPONENT in extra:
        raise ValueError(f"extra key {ENGINE_COMPONENT!r} is taken by the engine's counters")
    extra[ENGINE_COMPONENT] = EngineCounters(engine)
    scheduler = checkpointer_args.pop("scheduler", None) or engine.lr_scheduler
    zero = _zero_optimizer(engine)
    if zero is None:
        model, optimizer = engine.module, engine.optimizer
    else:
        layout = ZeroLayout(zero)
        model = Zero3Module(engine.module, layout) if layout.stage3 else engine.module
        optimizer = ZeroOptimizerView(layout)
    return Checkpointer(
        path,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        extra=extra,
        **checkpointer_args,
    )


def _qualname(obj: object) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _check_engine(engine: Any) -> None:
    from deepspeed.runtime.engine import DeepSpeedEngine

    if not isinstance(engine, DeepSpeedEngine):
        raise ValueError(
            f"checkpointer_for needs the engine deepspeed.initialize returned, got "
            f"{type(engine).__name__}"
        )
    if engine.fp16_enabled():
        raise ValueError(
            "DeepSpeed fp16 is not supported: its dynamic loss scaler is not captured, so a "
            'resume would not continue exactly. Use "bf16": {"enabled": true} or fp32'
        )
    if engine.zero_offload_optimizer() or engine.zero_offload_param():
        raise ValueError(
            "DeepSpeed ZeRO offload (offload_optimizer / offload_param) is not supported: "
            "the offloaded state is not captured. Remove the offload settings from the config"
        )
    zero = _zero_optimizer(engine)
    if zero is None:
        return
    inner = zero.optimizer
    name = _qualname(inner)
    if name not in KNOWN_OPTIMIZERS:
        raise ValueError(
            f"the DeepSpeed engine's optimizer is {name}, whose state layout unbroken does not "
            "capture exactly. Use a torch optimizer (torch.optim.AdamW, Adam, SGD), DeepSpeed's "
            '"AdamW"/"Adam" with "torch_adam": true, or DeepSpeed\'s "Muon"'
        )
    aux = getattr(inner, "aux_optimizer", None)
    if aux is not None and _qualname(aux) not in KNOWN_AUX:
        raise ValueError(
            f"DeepSpeed Muon's auxiliary optimizer is {_qualname(aux)}, whose state layout "
            "unbroken does not capture exactly"
        )
    if aux is not None and _qualname(aux) == FUSED_ADAM and _on_cpu():
        raise ValueError(
            "DeepSpeed Muon's auxiliary Adam is FusedAdam on the CPU, which keeps its "
            "bias-correction powers (beta**step, multiplied up step by step) inside its C++ "
            "object, where no checkpoint can hold them: the first step after a resume "
            "computes them afresh and the fp32 masters differ in the last bit. Add "
            '"torch_adam": true to the Muon optimizer\'s params (its auxiliary Adam is then '
            "torch.optim.AdamW)"
        )


def _on_cpu() -> bool:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() == "cpu"


def _zero_optimizer(engine: Any) -> Any:
    """The engine's optimizer when it keeps flat partitions (ZeRO 1-3, bf16 at stage 0),
    else None (no optimizer, or a plain torch optimizer over the module's parameters)."""
    opt = engine.optimizer
    if opt is None or isinstance(opt, torch.optim.Optimizer):
        return None
    known = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")
    if any(hasattr(opt, a) for a in (*known, "fp32_groups_flat_partition")):
        return opt
    raise ValueError(
        f"the DeepSpeed engine's optimizer wrapper {_qualname(opt)} is not one unbroken "
        "knows (ZeRO stages 1-3, the bf16 optimizer); its state is not captured"
    )


class EngineCounters:
    """The engine's step and sample counters; saved only at a gradient-accumulation
    boundary (gradients in DeepSpeed's own buffers are not saved)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def state_dict(self) -> dict[str, int]:
        gas = self.engine.gradient_accumulation_steps()
        if self.engine.micro_steps % gas:
            raise CheckpointError(
                f"DeepSpeed engine: save called after micro-step {self.engine.micro_steps}, "
                f"inside a gradient accumulation cycle of {gas}; the accumulated gradients live "
                "in DeepSpeed's buffers and are not saved. Save after the engine.step() that "
                "ends a cycle (when engine.is_gradient_accumulation_boundary() was True)"
            )
        return {name: int(getattr(self.engine, name)) for name in COUNTERS}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        for name in COUNTERS:
            setattr(self.engine, name, int(state[name]))


class Zero3Module(nn.Module):
    """``engine.module`` under ZeRO-3, seen whole: ``state_dict()`` gathers each
    parameter's partitions, ``load_state_dict()`` writes this rank's partition of each.

    It shares the module's children, parameters and buffers, so its FQNs are the
    module's own."""

    def __init__(self, module: nn.Module, layout: ZeroLayout) -> None:
        super().__init__()
        self.__dict__["_wrapped"] = module
        self.__dict__["_layout"] = layout
        self._modules = module._modules
        self._parameters = module._parameters
        self._buffers = module._buffers
        self._non_persistent_buffers_set = module._non_persistent_buffers_set

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        layout = self.__dict__["_layout"]
        out: dict[str, Any] = {}
        for key, value in self.__dict__["_wrapped"].state_dict(keep_vars=True).items():
            if hasattr(value, "ds_tensor"):  # a partitioned parameter (buffers are whole)
                parts = gather_bytes(value.ds_tensor, layout.group, layout.world)
                whole = torch.cat(parts)[: value.ds_numel].reshape(value.ds_shape).clone()
                out[key] = whole
            else:
                out[key] = value.detach() if isinstance(value, torch.Tensor) else value
        return out

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ):  # type: ignore[override]
        layout = self.__dict__["_layout"]
        live = self.__dict__["_wrapped"].state_dict(keep_vars=True)
        missing = [k for k in live if k not in state_dict]
        unexpected = [k for k in state_dict if k not in live]
        if strict and (missing or unexpected):
            raise RuntimeError(f"missing keys {missing}, unexpected keys {unexpected}")
        with torch.no_grad():
            for key, value in state_dict.items():
                target = live.get(key)
                if target is None:
                    continue
                if hasattr(target, "ds_tensor"):
                    part = target.ds_tensor
                    lo = layout.rank * part.ds_numel
                    piece = value.detach().reshape(-1)[lo : lo + part.ds_numel]
                    _same_dtype(key, part, piece)
                    part.data.reshape(-1)[: piece.numel()].copy_(piece)
                elif isinstance(target, torch.Tensor):
                    _same_dtype(key, target, value)
                    target.copy_(value)
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.__dict__["_wrapped"](*args, **kwargs)


def _same_dtype(key: str, live: torch.Tensor, saved: torch.Tensor) -> None:
    if live.dtype != saved.dtype:
        raise StateMismatchError(
            f"{key}: saved as {saved.dtype}, the DeepSpeed engine keeps it in {live.dtype}; "
            "build the engine with the precision it was saved with (bf16 or fp32)"
        )


class ZeroOptimizerView(torch.optim.Optimizer):
    """A ZeRO optimizer as a torch optimizer over the model's own parameters: its
    ``state_dict()`` holds each parameter's whole state (plus its fp32 master weight under
    ``fp32_master``), gathered from every rank's partitions; ``load_state_dict()`` writes
    this rank's partitions from such a state. It never steps itself: the engine does,
    running this view's step hooks first."""

    def __init__(self, layout: ZeroLayout) -> None:
        self.layout = layout
        # ZeRO steps one group at a time, swapping the torch optimizer's param_groups
        # list for a list of that group alone; the group dicts themselves stay.
        self.inner_groups = list(layout.inner.param_groups)
        # Recorded as the optimizer class (live/optimizer.py): a checkpoint of another
        # optimizer's state is refused, not installed into this one.
        self.shown_class = _qualname(layout.inner)
        groups = [
            {**_hyper(g), "params": list(params)}
            for g, params in zip(self.inner_groups, layout.params, strict=True)
        ]
        super().__init__(groups, defaults={})
        zero, zero_step = layout.zero, layout.zero.step

        # DeepSpeed changes optimizer state before its torch optimizer steps (ZeRO 1-2
        # commit Muon's momentum first): this view "steps" as the ZeRO step begins, so the
        # step hooks a Checkpointer relies on (the first-step check, step counts) run then.
        def step_with_view(*args: Any, **kwargs: Any) -> Any:
            self.step()
            return zero_step(*args, **kwargs)

        zero.step = step_with_view

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Nothing: the engine steps. Called as each ZeRO step begins, for its hooks."""

    def _index(self) -> dict[nn.Parameter, int]:
        return {p: i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        layout, index = self.layout, self._index()
        state: dict[int, dict[str, Any]] = {}
        groups = []
        for g, (live, ours) in enumerate(zip(self.inner_groups, self.param_groups, strict=True)):
            groups.append({**_hyper(live), "params": [index[p] for p in ours["params"]]})
            for p in ours["params"]:
                state[index[p]] = {}
            flat = layout.flats[g]
            for p, whole in layout.whole(g, flat):
                state[index[p]][MASTER] = whole
            held = layout.state_of(g)
            for key in sorted(held):
                value = held[key]
                if isinstance(value, torch.Tensor) and value.shape == flat.shape and value.dim():
                    for p, whole in layout.whole(g, value):
                        state[index[p]][key] = whole
                elif key == MUON_MOMENTUM and isinstance(value, torch.Tensor) and not layout.stage3:
                    for p, whole in layout.muon_momentum(g, value).items():
                        state[index[p]][key] = whole
                else:  # a step count, kept once per group
                    for p in ours["params"]:
                        state[index[p]][key] = (
                            value.clone() if isinstance(value, torch.Tensor) else value
                        )
        return {"state": {i: s for i, s in state.items() if s}, "param_groups": groups}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        layout = self.layout
        saved_state = state_dict["state"]
        order = [p for g in self.param_groups for p in g["params"]]
        by_param = {p: saved_state.get(i, {}) for i, p in enumerate(order)}
        for g, (saved, live) in enumerate(
            zip(state_dict["param_groups"], self.inner_groups, strict=True)
        ):
            for key, value in saved.items():
                if key != "params":
                    live[key] = value
            params = self.param_groups[g]["params"]
            entries = [by_param[p] for p in params]
            if not any(entries):
                continue
            missing = [i for i, e in enumerate(entries) if MASTER not in e]
            if missing:
                raise StateMismatchError(
                    f"DeepSpeed optimizer group {g}: the checkpoint has no {MASTER} for "
                    f"{len(missing)} parameter(s); it was not saved from a DeepSpeed engine's "
                    "ZeRO optimizer. Pass reset={'optimizer'} to start the optimizer fresh"
                )
            flat = layout.flats[g]
            _check_whole_dtype(g, MASTER, flat, entries[0][MASTER])
            layout.write(g, flat.data, lambda p: by_param[p][MASTER])
            held = layout.inner.state.setdefault(flat, {})
            keys = [k for k in entries[0] if k != MASTER]
            for key in keys:
                held[key] = self._install_entry(g, key, held.get(key), params, by_param)

    def _install_entry(
        self, g: int, key: str, live: Any, params: list[nn.Parameter], by_param: Mapping
    ) -> Any:
        layout = self.layout
        values = [by_param[p].get(key) for p in params]
        first = values[0]
        flat = layout.flats[g]
        if (
            isinstance(first, torch.Tensor)
            and first.dim()
            and not (key == MUON_MOMENTUM and not layout.stage3)
        ):
            target = live
            if (
                not isinstance(target, torch.Tensor)
                or target.shape != flat.shape
                or target.dtype != first.dtype
            ):
                target = torch.zeros(flat.shape, dtype=first.dtype, device=flat.device)
            layout.write(g, target, lambda p: by_param[p][key])
            return target
        if isinstance(first, torch.Tensor) and first.dim():  # Muon's momentum, stages 1-2
            pieces = [by_param[s.param][key].reshape(-1) for s in layout.touching(g, layout.rank)]
            return _into(live, torch.cat(pieces) if pieces else first.new_zeros(0))
        for other in values[1:]:
            if not _same_value(first, other):
                raise StateMismatchError(
                    f"DeepSpeed optimizer group {g}: {key!r} differs between parameters of the "
                    "group in the checkpoint; ZeRO keeps one per group"
                )
        return _into(live, first) if isinstance(first, torch.Tensor) else first


def _into(live: Any, value: torch.Tensor) -> torch.Tensor:
    """``value`` copied into the live tensor where it has the same shape and dtype (whoever
    else holds that tensor sees the restored value), else a copy of its own."""
    if isinstance(live, torch.Tensor) and live.shape == value.shape and live.dtype == value.dtype:
        live.copy_(value)
        return live
    return value.clone()


def _hyper(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


def _check_whole_dtype(g: int, key: str, flat: torch.Tensor, saved: torch.Tensor) -> None:
    if saved.dtype != flat.dtype:
        raise StateMismatchError(
            f"DeepSpeed optimizer group {g}: {key} saved as {saved.dtype}, the engine keeps "
            f"{flat.dtype}"
        )
