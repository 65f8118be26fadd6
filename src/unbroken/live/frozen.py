"""Which of a model's tensors are its frozen parameters, and the model's state without them.

With ``frozen="verify"`` a checkpoint leaves out the parameters that do not require grad
(a fine-tune's base) and records their fingerprints instead (core/frozen.py). A parameter
counts as frozen only where nothing trainable can change it: a name it shares with a
trainable parameter (a tie: one ``Parameter`` under two names) or memory it shares with
one (two ``Parameter`` objects over one storage) makes it follow the trainable side, and
it is saved.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..format import tree
from .torch_compat import normalized_fqns

MODES = ("save", "verify")


@dataclasses.dataclass
class Base:
    """What a run knows of its frozen base: each frozen parameter's dtype, shape and
    fingerprint when the run first left it out (``entries``: the manifest's ``frozen``
    records), and its fingerprint at the previous save (``previous``)."""

    entries: dict[str, dict[str, Any]]
    previous: dict[str, str]


def check_mode(frozen: object) -> str:
    """``frozen`` as given, if it is one of :data:`MODES`.

    Raises:
        ValueError: anything else.
    """
    if frozen not in MODES:
        raise ValueError(f'frozen must be "save" or "verify", got {frozen!r}')
    return str(frozen)


def state_key(component: str, model: str | None, fqn: str) -> str:
    """The tensor key a model state entry is saved under (as ``tree.encode`` names it)."""
    return tree.join_key(component, fqn) if model is None else tree.join_key(component, model, fqn)


def frozen_keys(models: Mapping[str | None, nn.Module], component: str) -> set[str]:
    """Tensor keys of the parameters that do not require grad and share neither a name nor
    memory with one that does."""
    trainable: set[str] = set()
    frozen: dict[str, torch.Tensor] = {}
    spans: list[tuple[str, int, int]] = []
    for name, module in models.items():
        for raw, param in module.named_parameters(remove_duplicate=False):
            keys = {state_key(component, name, fqn) for fqn in normalized_fqns(module, raw)}
            if param.requires_grad:
                trainable |= keys
                span = _span(param)
                if span is not None:
                    spans.append(span)
            else:
                frozen.update(dict.fromkeys(keys, param))
    overlap = _Overlap(spans)
    return {key for key, p in frozen.items() if key not in trainable and not overlap.hits(p)}


def without(state: Any, omit: Iterable[str], component: str, dict_of_models: bool) -> Any:
    """A captured model state (``{fqn: value}``, or ``{name: {fqn: value}}`` for a dict
    of models) without the entries whose tensor keys are in ``omit``."""
    left_out = set(omit)
    if not left_out:
        return state
    if not dict_of_models:
        return {f: v for f, v in state.items() if state_key(component, None, f) not in left_out}
    return {
        name: {f: v for f, v in part.items() if state_key(component, name, f) not in left_out}
        for name, part in state.items()
    }


def tensors_of(state: Any, keys: Iterable[str], component: str, dict_of_models: bool) -> dict:
    """The entries of a captured model state whose tensor keys are in ``keys``."""
    wanted = set(keys)
    parts = state.items() if dict_of_models else [(None, state)]
    return {
        key: value
        for name, part in parts
        for fqn, value in part.items()
        if (key := state_key(component, name, fqn)) in wanted and isinstance(value, torch.Tensor)
    }


def _span(t: torch.Tensor) -> tuple[str, int, int] | None:
    local = t.to_local() if isinstance(t, DTensor) else t
    if local.numel() == 0:
        return None
    start = local.data_ptr()
    return str(local.device), start, start + local.numel() * local.element_size()


class _Overlap:
    """Whether a tensor's memory overlaps any of the given spans (per device: starts
    sorted, with the largest end seen so far)."""

    def __init__(self, spans: list[tuple[str, int, int]]) -> None:
        self._by_device: dict[str, tuple[list[int], list[int]]] = {}
        for device, group in itertools.groupby(sorted(spans), key=lambda s: s[0]):
            ordered = list(group)
            starts = [s for _, s, _ in ordered]
            ends = list(itertools.accumulate((e for _, _, e in ordered), max))
            self._by_device[device] = (starts, ends)

    def hits(self, t: torch.Tensor) -> bool:
        span = _span(t)
        if span is None or span[0] not in self._by_device:
            return False
        device, start, end = span
        starts, ends = self._by_device[device]
        i = bisect.bisect_left(starts, end)  # spans starting before this one ends
        return i > 0 and ends[i - 1] > start
