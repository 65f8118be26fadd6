"""Which model parameters the saved optimizer state covers, from the manifest alone.

Silent loss of optimizer state (DESIGN.md F1, F3) shows up on disk as parameters in a
param group with no state, or state keyed by an FQN the model does not have (failures),
and as model parameters that no optimizer group holds: a warning only, since parts of a
model that no optimizer trains are normal (an EMA, a frozen tower). This module finds
each of them in a committed checkpoint without live objects. A tied weight (``lm_head.weight`` that is
``wte.weight``) is optimized under its parameter's name: it is listed as tied, not as a
tensor in no param group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ..errors import CheckpointError
from ..format.tree import TAG
from ..live.optimizer import PARAM_SHAPED
from .contents import model_fqns
from .reporting import JsonResult
from .tying import tied_weights

_FLOATING = {"float64", "float32", "float16", "bfloat16", "complex64", "complex128"}


@dataclasses.dataclass
class ParamCoverage:
    """One parameter of an optimizer param group and the state saved for it."""

    fqn: str  # the parameter's normalized FQN
    optimizer: str | None  # the dict key for a dict of optimizers
    group: int  # index of its param group
    entries: list[str]  # names of the saved state entries (empty: none saved)
    step: float | None  # the ``step`` entry's value, if any and readable
    in_model: bool  # the model has a tensor of that FQN


@dataclasses.dataclass
class OptimizerCoverage(JsonResult):
    """Findings (FQNs); the :attr:`failures` make a checkpoint fail ``unbroken verify``."""

    JSON_PROPERTIES = ("failures", "warnings")

    params: list[ParamCoverage] = dataclasses.field(default_factory=list)  # group order
    no_state: list[str] = dataclasses.field(default_factory=list)  # in a group, no state
    not_in_model: list[str] = dataclasses.field(default_factory=list)  # state, no parameter
    state_without_group: list[str] = dataclasses.field(default_factory=list)
    unoptimized: list[str] = dataclasses.field(default_factory=list)  # buffers, frozen
    unoptimized_parameters: list[str] = dataclasses.field(default_factory=list)  # trainable
    # (a warning: an EMA or averaged copy, a part no optimizer trains)
    shape_mismatches: list[str] = dataclasses.field(default_factory=list)  # messages
    missing_tensors: list[str] = dataclasses.field(default_factory=list)  # unlisted keys
    unreadable_steps: list[str] = dataclasses.field(default_factory=list)
    tied: dict[str, str] = dataclasses.field(default_factory=dict)  # alias -> its parameter

    @property
    def failures(self) -> list[str]:
        """What makes the checkpoint unsound: state that fits no parameter or group, shapes
        that differ, unlisted tensors."""
        out = [
            f"optimizer state for {f!r}, which is not a model parameter (FQNs orphaned)"
            for f in self.not_in_model
        ]
        out += [
            f"optimizer state for {f!r} belongs to no param group" for f in self.state_without_group
        ]
        out += self.shape_mismatches
        out += [
            f"optimizer state references tensor {k!r}, which the manifest does not list"
            for k in self.missing_tensors
        ]
        return out

    @property
    def warnings(self) -> list[str]:
        """What may be intended: parameters without state (never given a gradient),
        trainable parameters no optimizer trains (an EMA or averaged copy, a tower left
        untrained), and floating-point tensors in no param group (buffers, frozen
        parameters)."""
        out = [
            f"parameter {f!r} is in a param group but has no optimizer state (expected "
            "only if it never received a gradient)"
            for f in self.no_state
        ]
        if self.unoptimized_parameters:
            shown = self.unoptimized_parameters
            out.append(
                f"{len(shown)} trainable model parameter(s) are in no optimizer param group: "
                f"{', '.join(shown[:5])}{' ...' if len(shown) > 5 else ''}. Normal for an "
                "EMA or averaged copy (torch.optim.swa_utils.AveragedModel) or a part no "
                "optimizer trains; if an optimizer does train them, it was not passed to the "
                "Checkpointer and its state is not saved"
            )
        if self.unoptimized:
            out.append(
                f"{len(self.unoptimized)} floating-point model tensor(s) are in no optimizer "
                f"param group (buffers, or frozen parameters): {', '.join(self.unoptimized[:5])}"
                + (" ..." if len(self.unoptimized) > 5 else "")
            )
        return out


def optimizer_coverage(
    doc: dict[str, Any], *, read: Callable[[str], torch.Tensor] | None = None
) -> OptimizerCoverage | None:
    """Coverage of the model by the saved optimizer state; None without an optimizer.

    Args:
        doc: a manifest read with ``unbroken.format.manifest.read``.
        read: reads a tensor by key, to report each parameter's ``step`` value.
    """
    comp = doc["components"].get("optimizer")
    if comp is None or comp.get("per_rank"):
        return None
    skeleton = comp.get("state")
    named = {None: skeleton} if _is_single(skeleton) else dict(skeleton or {})
    model = model_fqns(doc)
    cov = OptimizerCoverage()
    grouped: set[str] = set()
    for name, opt in named.items():
        if not _is_single(opt):
            raise CheckpointError(f"optimizer {name!r} has no param_groups in the manifest")
        state = opt.get("state") or {}
        if isinstance(state, dict) and state.get(TAG) == "dict":  # non-string keys
            state = {str(k): v for k, v in state["items"]}
        members: set[str] = set()
        for g, group in enumerate(opt["param_groups"]):
            for fqn in group.get("params", []):
                members.add(fqn)
                cov.params.append(_param(doc, cov, fqn, name, g, state.get(fqn), model, read))
        grouped |= members
        cov.state_without_group += sorted(set(state) - members)
    params = doc["components"].get("model", {}).get("parameters")
    ties = tied_weights(doc)
    for fqn, key in sorted(model.items()):
        if fqn in grouped or doc["tensors"].get(key, {}).get("dtype") not in _FLOATING:
            continue
        if fqn in ties:  # the same parameter as ties[fqn], optimized under that name
            cov.tied[fqn] = ties[fqn]
            continue
        if params is not None and fqn in params:  # trainable, yet nothing optimizes it
            cov.unoptimized_parameters.append(fqn)
        else:  # a buffer or a frozen parameter (or an old manifest that does not say)
            cov.unoptimized.append(fqn)
    return cov


def _is_single(skeleton: Any) -> bool:
    return isinstance(skeleton, dict) and "param_groups" in skeleton


def _param(
    doc: dict[str, Any],
    cov: OptimizerCoverage,
    fqn: str,
    optimizer: str | None,
    group: int,
    entries: Any,
    model: dict[str, str],
    read: Callable[[str], torch.Tensor] | None,
) -> ParamCoverage:
    in_model = fqn in model
    if not in_model:
        cov.not_in_model.append(fqn)
    if not isinstance(entries, dict) or not entries:
        cov.no_state.append(fqn)
        return ParamCoverage(fqn, optimizer, group, [], None, in_model)
    step = None
    for entry, value in entries.items():
        ref = value.get("key") if isinstance(value, dict) and value.get(TAG) == "tensor" else None
        if ref is not None and ref not in doc["tensors"]:
            cov.missing_tensors.append(ref)
            continue
        if entry in PARAM_SHAPED and ref is not None and in_model:
            saved = doc["tensors"][ref]["shape"]
            want = doc["tensors"][model[fqn]]["shape"]
            if saved != want:
                cov.shape_mismatches.append(
                    f"optimizer state {entry!r} of {fqn!r} has shape {saved}, the parameter {want}"
                )
        if entry == "step":
            step = _step_value(value, ref, read, cov, fqn)
    return ParamCoverage(fqn, optimizer, group, sorted(entries), step, in_model)


def _step_value(
    value: Any,
    ref: str | None,
    read: Callable[[str], torch.Tensor] | None,
    cov: OptimizerCoverage,
    fqn: str,
) -> float | None:
    if ref is None:
        return float(value) if isinstance(value, int | float) else None
    if read is None:
        return None
    try:
        t = read(ref)
    except (CheckpointError, KeyError):  # damaged (reported elsewhere) or not read
        cov.unreadable_steps.append(fqn)
        return None
    return float(t.item()) if t.numel() == 1 else None
