"""The optional probe: a value computed from the model at save, recomputed after restore.

It catches weights that were loaded but not installed where the forward pass reads them
(DESIGN.md F4). The probe runs without gradients and leaves every RNG as it found it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from . import rng

Probe = Callable[[Any], "torch.Tensor | float"]


def _plain(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return repr(x)
    return x


def record(probe: Probe, model: Any) -> dict[str, Any]:
    """Run the probe and return its value in exact, JSON-safe form."""
    with rng.preserved(), torch.no_grad():
        value = probe(model)
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu()
        if t.numel() > 65536:
            raise ValueError(f"probe returned {t.numel()} elements; return a small tensor")
        return {
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "values": [_plain(v) for v in t.reshape(-1).tolist()],
        }
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"probe must return a tensor or a number, got {type(value).__name__}")
    return {"dtype": type(value).__name__, "shape": [], "values": [_plain(value)]}


def describe(value: dict[str, Any]) -> str:
    vals = value["values"]
    shown = ", ".join(str(v) for v in vals[:4]) + (", ..." if len(vals) > 4 else "")
    return f"{value['dtype']}{value['shape']} [{shown}]"
