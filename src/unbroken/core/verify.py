"""Fingerprints of flat state across ranks, and the checks of a restore: the loaded
tensors against the manifest, the live objects against what was loaded.

Whole (unsharded) tensors are fingerprinted where they live; a ``DTensor`` contributes
the partial sum of its local shard, once per distinct shard, and the partials add up to
the fingerprint of the logical tensor. Each value counts once:

- within its mesh, a shard replicated along a mesh dimension counts only at coordinate 0
  of that dimension (:func:`counted_here`);
- a DTensor on a sub-mesh (the "dp" mesh of a ("dp", "tp") world, an FSDP2 module's mesh
  beside tensor parallelism) has one instance of that mesh per coordinate of the other
  dimensions, each holding the whole tensor: only the instance holding the lowest global
  rank among those that hold the tensor counts (:func:`instance`, chosen in the round
  that adds up the partials at save, in one small all-reduce at restore).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ..errors import CheckpointError, StateMismatchError
from ..format import bitwise, fingerprint, layout, shards, state_compare
from ..live.components import component_prefix
from ..live.exchange import Exchange
from ..live.state import Component, live_tensors
from . import collective


def held_partial(t: torch.Tensor, algorithm: str, key: str = "") -> int | None:
    """The share of ``t``'s fingerprint of the values this rank holds, whether or not this
    rank is the one that counts them (a replica's too); None if it holds none."""
    if not isinstance(t, DTensor):
        return fingerprint.partial(t, t.shape, [0] * t.dim(), algorithm)
    if t.device_mesh.get_coordinate() is None:
        return None
    local = t.to_local()
    (chunk,) = t.__create_chunk_list__()
    if tuple(chunk.sizes) != tuple(local.shape):  # torch's own invariant; checked, not assumed
        raise CheckpointError(
            f"tensor {key!r}: its local shard {tuple(local.shape)} is not one block of the "
            f"global tensor (placements {t.placements}); it cannot be checkpointed"
        )
    return fingerprint.partial(local, t.shape, list(chunk.offsets), algorithm)


def counted_here(t: torch.Tensor, key: str = "") -> bool:
    """Whether this rank's values of ``t`` count in its fingerprint within its mesh: a
    replica's (a coordinate other than 0 along a ``Replicate`` dimension) do not."""
    if not isinstance(t, DTensor):
        return True
    coord = t.device_mesh.get_coordinate()
    if coord is None:
        return False
    for dim, placement in enumerate(t.placements):
        # _StridedShard: FSDP2 over tensor parallelism (a TP shard sharded again on the
        # same dim); each rank's values are still one block (``held_partial`` checks).
        if not isinstance(placement, Replicate | Shard | _StridedShard):
            raise CheckpointError(
                f"tensor {key!r} is a DTensor with placement {placement} (placements "
                f"{t.placements}), which cannot be checkpointed: reduce it to Shard or "
                "Replicate first (a Partial is a sum not yet taken: redistribute it)"
            )
        if isinstance(placement, Replicate) and coord[dim] != 0:
            return False
    return True


def instance(t: torch.Tensor) -> int | None:
    """The lowest global rank of the mesh holding ``t`` on this rank (which of a sub-mesh's
    instances this is); None for a tensor that is not a DTensor, or no mesh here."""
    if not isinstance(t, DTensor) or t.device_mesh.get_coordinate() is None:
        return None
    return int(t.device_mesh.mesh.min())


def partials(
    tensors: Mapping[str, torch.Tensor], whole_here: Iterable[str], algorithm: str
) -> dict[str, tuple[int, int | None]]:
    """Local partial sums, each with the instance of its mesh (:func:`instance`):
    sharded tensors where this rank counts them within their mesh, whole ones only if
    listed."""
    whole = set(whole_here)
    out = {}
    for key, t in tensors.items():
        if isinstance(t, DTensor) and counted_here(t, key):
            p = held_partial(t, algorithm, key)
            if p is not None:
                out[key] = (p, instance(t))
        elif key in whole and not isinstance(t, DTensor):
            out[key] = (fingerprint.partial(t, t.shape, [0] * t.dim(), algorithm), None)
    return out


def combine(per_rank: list[dict[str, tuple[int, int | None]]]) -> dict[str, str]:
    """Fingerprints from every rank's :func:`partials`: for each tensor, the partials of
    the instance of its mesh holding the lowest rank (a plain tensor's, from the one rank
    that wrote it)."""
    first: dict[str, int] = {}
    for rank_partials in per_rank:
        for key, (_, where) in rank_partials.items():
            if where is not None:
                first[key] = min(first.get(key, where), where)
    sums: dict[str, list[int]] = {}
    for rank_partials in per_rank:
        for key, (p, where) in rank_partials.items():
            if where is None or where == first[key]:
                sums.setdefault(key, []).append(p)
    return {key: fingerprint.combine(ps) for key, ps in sums.items()}


class LoadedFingerprints:
    """Fingerprints of freshly loaded tensors, computed in a worker thread as each tensor
    finishes loading, so the work overlaps with reading the next ones. ``algorithm``:
    the one the checkpoint's fingerprints were computed with (its manifest says which)."""

    def __init__(self, targets: Mapping[str, torch.Tensor], algorithm: str) -> None:
        self._targets = targets
        self.algorithm = algorithm
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="unbroken-fp")
        # Start its thread now, before the reads: started while readers run, it took
        # 17-34 ms (measured), and the first fingerprints waited for it.
        self._pool.submit(int)
        self._futures: dict[str, Future[int | None]] = {}
        # The share of each of the values this rank holds (a replica's too), once checked.
        self.partials: dict[str, int | None] = {}

    def loaded(self, key: str) -> None:
        if key in self._targets and key not in self._futures:
            target = self._targets[key]
            self._futures[key] = self._pool.submit(held_partial, target, self.algorithm, key)

    def abandon(self) -> None:
        """Stop fingerprinting (the read failed): drop what has not started."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def check(self, entries: Mapping[str, dict[str, Any]]) -> list[str]:
        """Compare with the manifest's fingerprints (collective); return problems."""
        problems, sharded = self.check_local(entries)
        keys = list(entries)  # the manifest's: the same list on every rank
        _, sums = collective.agree_summing(lambda: None, self.terms(keys, sharded))
        return problems + self.check_sharded(entries, dict(zip(keys, sums, strict=True)))

    def check_local(
        self, entries: Mapping[str, dict[str, Any]]
    ) -> tuple[list[str], dict[str, tuple[int, int]]]:
        """Wait for every fingerprint; compare whole tensors' with the manifest. Returns
        their problems and this rank's partials of sharded tensors with their mesh's
        instance, for :meth:`terms` (no collective here)."""
        try:
            for key in self._targets:
                self.loaded(key)
            # The reads are over: this thread takes what the worker has not started, from
            # the back of its queue, so that two cores share the last fingerprints.
            mine = {}
            for key, f in reversed(self._futures.items()):
                if f.cancel():
                    mine[key] = held_partial(self._targets[key], self.algorithm, key)
            done = {k: mine[k] if k in mine else f.result() for k, f in self._futures.items()}
        finally:
            self._pool.shutdown(wait=True)
        self.partials = done
        problems = []
        sharded: dict[str, tuple[int, int]] = {}
        for key, p in done.items():
            t = self._targets[key]
            if isinstance(t, DTensor):
                where = instance(t)
                if p is not None and where is not None and counted_here(t, key):
                    sharded[key] = (p, where)
            elif fingerprint.combine([p or 0]) != entries[key]["fingerprint"]:
                problems.append(f"{key}: the loaded value does not match its saved fingerprint")
        return problems, sharded

    @staticmethod
    def terms(keys: list[str], sharded: Mapping[str, tuple[int, int]]) -> list[int]:
        """This rank's term of each of ``keys``' sums (``keys``: the same list on every
        rank): its partial where its mesh instance is the one that counts, the one holding
        the lowest rank (agreed in one small all-reduce; collective), else 0."""
        nobody = 1 << 61
        first = collective.least([sharded[k][1] if k in sharded else nobody for k in keys])
        return [
            sharded[k][0] if k in sharded and sharded[k][1] == f else 0
            for k, f in zip(keys, first, strict=True)
        ]

    def check_sharded(
        self, entries: Mapping[str, dict[str, Any]], sums: Mapping[str, int]
    ) -> list[str]:
        """Problems of sharded tensors, from the sums of every rank's partials (the same on
        every rank)."""
        return [
            f"{key}: the loaded value does not match its saved fingerprint"
            for key, t in self._targets.items()
            if isinstance(t, DTensor)
            and fingerprint.combine([sums.get(key, 0)]) != entries[key]["fingerprint"]
        ]


def compare_installed(
    saved: Mapping[str, dict[str, Any]],
    targets: Mapping[str, torch.Tensor],
    live: Mapping[str, torch.Tensor],
) -> list[str]:
    """Check that the live objects now hold exactly the verified loaded tensors.

    Catches state an install dropped, cast (DESIGN.md F5) or did not copy (F4).
    """
    problems: list[str] = []
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
        elif (
            "stride" in entry and not isinstance(t, DTensor) and list(t.stride()) != entry["stride"]
        ):
            problems.append(
                f"{key}: saved with {layout.describe(entry['stride'], entry['shape'])}, live "
                f"has {layout.describe(t.stride(), entry['shape'])} after restore"
            )
        elif t is not targets[key] and not bitwise.equal(t, targets[key]):
            problems.append(f"{key}: the live value differs from the loaded one after restore")
    return problems


def compare_exchanged(
    keys: Iterable[str],
    loaded: Mapping[str, int | None],
    live: Mapping[str, torch.Tensor],
    algorithm: str,
    read_whole: Mapping[str, shards.ChunkLocation],
) -> list[str]:
    """Check the values of tensors installed by exchanging bytes (the loaded tensors now
    hold the previous values). Where one checked chunk was read straight into the whole
    loaded tensor on the host (``read_whole``: ``ShardReader.read_whole``), the live
    bytes' xxh3-128 must be that chunk's checksum (xxh3 runs at over twice a
    fingerprint's speed); elsewhere, and on a GPU (nothing copied to the host), the share
    of its fingerprint of what the live tensor holds here must be the loaded one's
    (``loaded``: :attr:`LoadedFingerprints.partials`)."""
    problems = []
    for key in keys:
        if key not in live:
            continue
        local = live[key].to_local() if isinstance(live[key], DTensor) else live[key]
        chunk = read_whole.get(key)
        on_host = local.device.type == "cpu"  # a device tensor is fingerprinted where it is
        if chunk is not None and on_host and local.is_contiguous() and local.nbytes == chunk.length:
            same = shards.checksum(shards.tensor_bytes(local)) == chunk.checksum
        else:
            expected = loaded.get(key)
            same = expected is None or held_partial(live[key], algorithm, key) == expected
        if not same:
            problems.append(f"{key}: the live value differs from the loaded one after restore")
    return problems


def live_problems(
    c: Component,
    skeleton: Any,
    saved: Mapping[str, dict[str, Any]],
    targets: Mapping[str, torch.Tensor],
    swap: Exchange | None,
    loaded: LoadedFingerprints,
    read_whole: Mapping[str, shards.ChunkLocation],
) -> list[str]:
    """What differs between the component's live state after its install and what was
    loaded for it (no collective): values, dtypes, shapes, strides (:func:`compare_installed`)
    and non-tensor state. Where ``swap`` installed it by exchanging bytes, the targets of
    its keys now hold the previous values: those are checked by :func:`compare_exchanged`."""
    live_skeleton, live = live_tensors(c, component_prefix(c, collective.rank()))
    if swap is None:
        problems = compare_installed(saved, targets, live)
    else:
        expected = {**targets, **{k: live[k] for k in swap.keys if k in live}}
        problems = compare_installed(saved, expected, live)
        problems += compare_exchanged(
            swap.keys, loaded.partials, live, loaded.algorithm, read_whole
        )
    expected = c.installed_skeleton(skeleton)
    where = None if problems else state_compare.difference(expected, live_skeleton, c.name)
    if where is not None:
        problems.append(
            f"{c.name}: non-tensor state (hyperparameters, structure, types) differs from "
            f"the saved one at {where}"
        )
    return problems


def raise_problems(problems: list[str], what: str) -> None:
    if problems:
        shown = "\n  ".join(problems[:10])
        more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise StateMismatchError(f"{what} failed verification after restore:\n  {shown}{more}")
