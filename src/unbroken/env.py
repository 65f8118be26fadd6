"""Tunables read from environment variables, all read and validated the same way."""

from __future__ import annotations

import os


def env_number(name: str, default: float, low: float) -> float:
    """The number in the environment variable ``name`` (``default`` if unset or blank).

    Raises:
        ValueError: naming the variable, if it is not a number >= ``low``.
    """
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a number >= {low}") from None
    if value < low:
        raise ValueError(f"{name}={raw!r}: expected a number >= {low}")
    return value
