"""The saved ``rng`` component seen one generator at a time, from the manifest alone.

The ``rng`` component holds, per rank, the state of Python's ``random``, NumPy's global
generator, torch's CPU generator and (if used) each CUDA device's. Comparing two
checkpoints generator by generator says *which* one differs (``torch: differs``) instead
of listing hundreds of state words; the resume test and ``unbroken diff`` both do.
"""

from __future__ import annotations

from typing import Any

from ..format.state_compare import skeleton_differences

# How people name the generators the ``rng`` component saves (live/rng.py).
LABELS = {"python": "python random", "numpy": "numpy", "torch": "torch CPU", "cuda": "torch CUDA"}


def generator_states(doc: dict[str, Any]) -> dict[tuple[int, str], Any]:
    """(rank, generator) -> its saved state (a JSON skeleton); {} without ``rng``."""
    comp = doc["components"].get("rng")
    if comp is None:
        return {}
    ranks = comp.get("ranks") if comp.get("per_rank") else {"0": comp.get("state")}
    out: dict[tuple[int, str], Any] = {}
    for rank, skeleton in (ranks or {}).items():
        if not isinstance(skeleton, dict):
            continue
        for name, state in skeleton.items():
            out[(int(rank), name)] = state
    return out


def differing(a: dict[str, Any], b: dict[str, Any]) -> dict[tuple[int, str], bool]:
    """(rank, generator) -> whether its state differs between manifests ``a`` and ``b``
    (a generator saved in only one of them differs), by the one "same value" rule
    (format/state_compare.py: saved tensors by their fingerprints, numbers by bits)."""
    sa, sb = generator_states(a), generator_states(b)
    tables = (a["tensors"], b["tensors"])
    order = list(LABELS)
    keys = sorted(sa.keys() | sb.keys(), key=lambda k: (k[0], _index(order, k[1]), k[1]))
    return {
        key: key not in sa
        or key not in sb
        or bool(skeleton_differences([sa[key]], [sb[key]], key[1], tables=tables))
        for key in keys
    }


def label(rank: int, name: str, world_size: int) -> str:
    """``torch CPU``, or ``torch CPU (rank 1)`` when there is more than one rank."""
    text = LABELS.get(name, name)
    return text if world_size <= 1 else f"{text} (rank {rank})"


def _index(order: list[str], name: str) -> int:
    return order.index(name) if name in order else len(order)
