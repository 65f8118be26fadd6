"""A run's identity: one id from its first start through every resume, fork and reset.

The id lives in the manifest as the ``run`` field of the lineage's first event (the
``start`` that began the run), so every checkpoint of the run carries it and a restore
reads it back. It is 32 hex digits, valid as is as a tracker's run id (W&B) and in paths
(``format.schema.RUN_ID``, which also refuses a hostile one).

A checkpoint written before the field existed gets an id derived from its lineage's first
event, which every later checkpoint of the run copies: the same id at every restore. A
lineage with no event at all (a hand-made manifest) gets a synthetic ``start`` event
holding an id derived from the checkpoint itself, so the next save records it.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import xxhash

from ..errors import CheckpointError
from . import collective


def mint() -> str:
    """A new run id (each rank mints its own; :func:`agree` makes rank 0's everyone's)."""
    return uuid.uuid4().hex


def agree(lineage: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """``lineage`` whose first event carries rank 0's run id on every rank, and that id.
    Collective."""
    run = collective.from_rank0(lineage[0]["run"])
    return [{**lineage[0], "run": run}, *lineage[1:]], run


def restored(doc: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """The lineage a restore of manifest ``doc`` continues, and the run's id.

    Args:
        doc: a manifest read and checked by ``format.manifest.read`` (a ``run`` in it
            is a valid id).
    """
    lineage = list(doc["lineage"])
    if not lineage:  # no start event to keep the id in: one is added, and saved next
        start = {"event": "start", "run": _derived([doc["step"], doc.get("created_unix")])}
        return [start, *lineage], start["run"]
    run = lineage[0].get("run")
    return lineage, run if isinstance(run, str) else _derived(lineage[0])


def _derived(seed: Any) -> str:
    """A stable id for a run whose checkpoints record none (written before ids were)."""
    text = json.dumps(seed, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return xxhash.xxh3_128_hexdigest(text.encode())


def unknown() -> CheckpointError:
    """The error of ``Checkpointer.run_id`` read before the run's id is decided."""
    return CheckpointError(
        "the run id is decided by restore() (the restored checkpoint's, or a new one on "
        "a fresh start) or, without a restore, by the first save(): call restore() "
        "first, on every rank"
    )
