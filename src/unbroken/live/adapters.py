"""The adapter configuration of a PEFT model, recorded in its checkpoints' manifests so an
adapter can be exported (``unbroken export --format peft``) without the script."""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from typing import Any

from torch import nn

MAX_BYTES = 64 * 1024  # one adapter's configuration, as JSON


def peft_configs(models: Mapping[str | None, nn.Module]) -> dict[str, dict[str, Any]] | None:
    """``{adapter name: its config as JSON}`` of the first model that is a PEFT model (it
    has a ``peft_config`` dict of configs with ``to_dict()``), or None."""
    for module in models.values():
        configs = getattr(module, "peft_config", None)
        if not isinstance(configs, Mapping):
            continue
        out = {}
        for name, config in configs.items():
            to_dict = getattr(config, "to_dict", None)
            if isinstance(name, str) and callable(to_dict):
                out[name] = _json_safe(to_dict())
        if out and all(len(json.dumps(c)) <= MAX_BYTES for c in out.values()):
            return out
    return None


def _json_safe(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, set | frozenset):
        return sorted((_json_safe(v) for v in value), key=str)
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if isinstance(value, enum.Enum):
        return _json_safe(value.value)
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else str(value)
    return str(value)
