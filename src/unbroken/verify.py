"""Fingerprints of flat state across ranks, and their comparison after a restore.

Whole (unsharded) tensors are fingerprinted where they live; a ``DTensor`` contributes
the partial sum of its local shard, once per distinct shard (replicas skip), and the
partials of all ranks add up to the fingerprint of the logical tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from . import collective, fingerprint
from .errors import CheckpointError, StateMismatchError


def local_partial(t: torch.Tensor) -> int | None:
    """This rank's share of ``t``'s fingerprint; None where another rank counts it."""
    if not isinstance(t, DTensor):
        return fingerprint.partial(t, t.shape, [0] * t.dim())
    coord = t.device_mesh.get_coordinate()
    if coord is None:
        return None
    for dim, placement in enumerate(t.placements):
        if isinstance(placement, Replicate) and coord[dim] != 0:
            return None
        if not isinstance(placement, Replicate | Shard):
            raise CheckpointError(
                f"a DTensor with placement {placement} cannot be checkpointed; "
                "reduce it to Shard or Replicate first"
            )
    (chunk,) = t.__create_chunk_list__()
    return fingerprint.partial(t.to_local(), t.shape, list(chunk.offsets))


def partials(tensors: Mapping[str, torch.Tensor], whole_here: Iterable[str]) -> dict[str, int]:
    """Local partial sums: sharded tensors everywhere, whole ones only if listed."""
    whole = set(whole_here)
    out = {}
    for key, t in tensors.items():
        if isinstance(t, DTensor) or key in whole:
            p = local_partial(t)
            if p is not None:
                out[key] = p
    return out


def combine(per_rank: list[dict[str, int]]) -> dict[str, str]:
    """Fingerprints from every rank's partials."""
    sums: dict[str, list[int]] = {}
    for rank_partials in per_rank:
        for key, p in rank_partials.items():
            sums.setdefault(key, []).append(p)
    return {key: fingerprint.combine(ps) for key, ps in sums.items()}


def compare_live(
    saved: Mapping[str, dict[str, Any]], live: Mapping[str, torch.Tensor]
) -> list[str]:
    """Check live tensors against saved entries on every rank; return problems found.

    Collective: every rank must call it with the same keys in ``saved``.
    """
    problems: list[str] = []
    whole = {k: t for k, t in live.items() if k in saved and not isinstance(t, DTensor)}
    sharded = {k: t for k, t in live.items() if k in saved and isinstance(t, DTensor)}
    for key, entry in saved.items():
        t = live.get(key)
        if t is None:
            problems.append(f"{key}: saved, but absent from the live objects after restore")
            continue
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype != entry["dtype"]:
            problems.append(f"{key}: saved as {entry['dtype']}, live is {dtype} after restore")
        elif list(t.shape) != entry["shape"]:
            problems.append(f"{key}: saved shape {entry['shape']}, live {list(t.shape)}")
    for key, t in whole.items():
        if fingerprint.fingerprint(t) != saved[key]["fingerprint"]:
            problems.append(f"{key}: value differs from the saved one after restore")
    got = combine(collective.gather_all(partials(sharded, ())))
    for key in sharded:
        if got.get(key) != saved[key]["fingerprint"]:
            problems.append(f"{key}: value differs from the saved one after restore")
    return problems


def raise_problems(problems: list[str], what: str) -> None:
    if problems:
        shown = "\n  ".join(problems[:10])
        more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise StateMismatchError(f"{what} failed verification after restore:\n  {shown}{more}")
