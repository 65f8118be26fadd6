"""DeepSpeed's checkpoint files read without unpickling code, and without DeepSpeed.

Besides tensors and plain containers, a ZeRO optimizer file holds three DeepSpeed objects:
the stage (an ``IntEnum``), each parameter's place in a rank's partition (a dataclass of
``numel`` and ``start``) and the loss scaler (attributes only). ``torch.load(weights_only=
True)`` is allowed exactly these names, each mapped to a stand-in here that only takes
the values; anything else in a file is refused, naming it.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Any

import torch

from ..errors import CorruptCheckpointError


class ZeroStage(enum.IntEnum):
    """``deepspeed.runtime.zero.config.ZeroStageEnum``'s values."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


class FragmentAddress:
    """``deepspeed.utils.tensor_fragment.fragment_address``: ``numel`` elements of a
    parameter at ``start`` in a rank's flat partition."""

    numel: int
    start: int


class LossScaler:
    """``deepspeed.runtime.fp16.loss_scaler.LossScaler``'s attributes (unused here)."""


ALLOWED = [
    (ZeroStage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
    (LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
]


def load(path: Path, *, trust_pickle: bool = False) -> dict[str, Any]:
    """One DeepSpeed checkpoint file; ``trust_pickle``: plain pickle (needs DeepSpeed)."""
    try:
        if trust_pickle:
            return torch.load(path, map_location="cpu", weights_only=False)
        with torch.serialization.safe_globals(ALLOWED):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # any refusal or damage, named
        text = str(exc).strip()
        first = text.splitlines()[0] if text else type(exc).__name__
        hint = "" if trust_pickle else ". If you trust the file, pass --trust-pickle"
        raise CorruptCheckpointError(
            f"{path} cannot be loaded with torch.load(weights_only={not trust_pickle}): "
            f"{first}{hint}"
        ) from None
