"""The saved ``rng`` component seen one generator at a time, from the manifest alone.

The ``rng`` component holds, per rank, the state of Python's ``random``, NumPy's global
generator, torch's CPU generator and (if used) each CUDA device's. Comparing two
checkpoints generator by generator says *which* one differs (``torch: differs``) instead
of listing hundreds of state words; the resume test and ``unbroken diff`` both do.
"""

from __future__ import annotations

import json
from typing import Any

from ..format.tree import TAG

# How people name the generators the ``rng`` component saves (live/rng.py).
LABELS = {"python": "python random", "numpy": "numpy", "torch": "torch CPU", "cuda": "torch CUDA"}


def generator_states(doc: dict[str, Any]) -> dict[tuple[int, str], str]:
    """(rank, generator) -> a canonical text of its saved state; {} without ``rng``.

    Tensors stand as their fingerprints (layout-independent), so two checkpoints' states
    compare equal exactly when every value and every saved tensor is equal.
    """
    comp = doc["components"].get("rng")
    if comp is None:
        return {}
    ranks = comp.get("ranks") if comp.get("per_rank") else {"0": comp.get("state")}
    out: dict[tuple[int, str], str] = {}
    for rank, skeleton in (ranks or {}).items():
        if not isinstance(skeleton, dict):
            continue
        for name, state in skeleton.items():
            resolved = _resolve(state, doc["tensors"])
            out[(int(rank), name)] = json.dumps(resolved, sort_keys=True, default=str)
    return out


def differing(a: dict[str, Any], b: dict[str, Any]) -> dict[tuple[int, str], bool]:
    """(rank, generator) -> whether its state differs between manifests ``a`` and ``b``
    (a generator saved in only one of them differs)."""
    sa, sb = generator_states(a), generator_states(b)
    order = list(LABELS)
    keys = sorted(sa.keys() | sb.keys(), key=lambda k: (k[0], _index(order, k[1]), k[1]))
    return {key: sa.get(key) != sb.get(key) for key in keys}


def label(rank: int, name: str, world_size: int) -> str:
    """``torch CPU``, or ``torch CPU (rank 1)`` when there is more than one rank."""
    text = LABELS.get(name, name)
    return text if world_size <= 1 else f"{text} (rank {rank})"


def _index(order: list[str], name: str) -> int:
    return order.index(name) if name in order else len(order)


def _resolve(node: Any, tensors: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        if node.get(TAG) == "tensor":
            entry = tensors.get(node.get("key"), {})
            return {"tensor": [entry.get("dtype"), entry.get("shape"), entry.get("fingerprint")]}
        return {k: _resolve(v, tensors) for k, v in node.items()}
    if isinstance(node, list):
        return [_resolve(v, tensors) for v in node]
    return node
