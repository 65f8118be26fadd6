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
    _reshard(model)
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


def _reshard(model: Any) -> None:
    """FSDP2 keeps a root module unsharded after a forward without backward: put every
    FSDP2 module back into its sharded state, so ``model.parameters()`` are the sharded
    parameters again (an optimizer built right after restore() must see those)."""
    from torch.distributed.fsdp import FSDPModule

    modules = model.values() if isinstance(model, dict) else [model]
    for module in modules:
        for m in module.modules():
            if isinstance(m, FSDPModule):
                m.reshard()


def describe(value: dict[str, Any]) -> str:
    vals = value["values"]
    shown = ", ".join(str(v) for v in vals[:4]) + (", ..." if len(vals) > 4 else "")
    return f"{value['dtype']}{value['shape']} [{shown}]"


def mismatch(recorded: dict[str, Any], value: dict[str, Any], rank: int) -> str | None:
    """What is wrong with the probe's ``value`` after a restore, compared with the one
    ``rank`` recorded at save; None if it is the same."""
    expected = recorded["ranks"][rank]
    if value == expected:
        return None
    return (
        f"the probe differs after restore: saved {describe(expected)}, now "
        f"{describe(value)}. The weights the forward pass uses are not the ones saved: "
        "something installs them late (after the first step, say); see the probe in the README"
    )
