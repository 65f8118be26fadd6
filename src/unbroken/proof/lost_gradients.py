"""A resume from a checkpoint saved in the middle of gradient accumulation, named.

A save between two micro-batches without ``Checkpointer(gradients="save")`` records in
its manifest how many parameters held gradients it did not keep (``gradients``,
live/gradients.py). A resume from it restarts the accumulation from nothing, so the
runs differ after it while the checkpoint of the stop matches the straight run's: the
cause line says so (proof/divergence.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def note(stops: Sequence[int], *kept: Mapping[int, Mapping[str, Any]]) -> str:
    """``; ...`` naming each of ``stops`` whose checkpoint (the first of ``kept`` holding
    one) was saved with gradients it does not hold; empty if none."""
    found = []
    for stop in stops:
        doc = next((docs[stop] for docs in kept if stop in docs), None)
        held = doc.get("gradients") if doc is not None else None
        if held and not held.get("saved"):
            names = ", ".join(held.get("parameters") or [])
            found.append(f"step {stop} ({held.get('held')} parameter(s): {names})")
    if not found:
        return ""
    return (
        f"; the checkpoint of {' and '.join(found)} was saved in the middle of gradient "
        "accumulation, with gradients no optimizer step had used yet, which it does not "
        "hold: the resumed run restarted that accumulation from nothing. Save after "
        'optimizer.step(), or pass Checkpointer(gradients="save") to keep them'
    )
