"""Plain tensors that several ranks hold under one name must hold one value there.

DCP writes a plain (non-DTensor) tensor that several ranks hold once, from whichever rank
its plan deduplication picks, tensor by tensor (``weight`` from rank 1, ``bias`` from rank
0). Where the ranks' values differ - experts kept by hand in one plain parameter per
rank, BatchNorm statistics under DDP with ``broadcast_buffers=False``, per-rank heads or
adapters - the checkpoint would hold a mix no rank held and restore it on every rank.

So at each save of several ranks, every rank fingerprints every plain tensor it holds
(beside the writes, as the written ones are); the 64-bit values travel to rank 0 in the
round that gathers the save's fingerprints anyway, and there a difference refuses the
commit, naming each tensor and which ranks hold which value. Nothing is committed.

One difference is by design: DDP (``broadcast_buffers=True``, the default) broadcasts
rank 0's buffers at the start of every forward, and each rank's forward then updates its
own copy (BatchNorm's running statistics), so at a save they differ, and rank 0's is the
value every rank trains on next. Those buffers are written from rank 0 alone and not
compared.

Refused rather than saved per rank: a model's and an optimizer's tensors are restored
keyed by their live FQNs (targets, byte exchange, the checks after install and at the
first step), which a per-rank copy would have to be mapped back to at every one of them.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from concurrent.futures import Executor, Future

import torch
import torch.distributed as dist
import xxhash
from torch import nn
from torch.distributed.tensor import DTensor

from ..errors import CheckpointError
from ..format import fingerprint, tree
from ..live.state import Component, ModelComponent
from ..live.torch_compat import normalized_fqns
from . import collective

_LISTED = 10


class HeldHere:
    """What this rank writes of a save's flat tensors (:attr:`to_write`: all of them but
    DDP's broadcast buffers, which only rank 0 writes) and its 64-bit value (fingerprint,
    dtype, shape) of each other plain tensor it holds, for :func:`refuse_differing` on
    rank 0. Nothing is left out or computed in a single process."""

    def __init__(
        self, flat: Mapping[str, torch.Tensor], algorithm: str, components: list[Component]
    ) -> None:
        several = collective.world_size() > 1
        from_rank0 = broadcast_buffer_keys(components) if several else set()
        mine = collective.rank() == 0
        self.to_write = {k: t for k, t in flat.items() if mine or k not in from_rank0}
        self._plain = {
            k: t
            for k, t in flat.items()
            if several and not isinstance(t, DTensor) and k not in from_rank0
        }
        self._algorithm = algorithm
        self._rest: Future[dict[str, int]] | None = None

    def start(self, pool: Executor, written: Collection[str]) -> None:
        """Fingerprint, in ``pool``, the plain tensors this rank holds but does not write
        (those it writes are fingerprinted for the manifest already)."""
        done = set(written)
        rest = {k: t for k, t in self._plain.items() if k not in done}
        self._rest = pool.submit(_partials, rest, self._algorithm)

    def values(self, written: Mapping[str, tuple[int, int | None]]) -> dict[str, int]:
        """Key -> value of every plain tensor held here, given the partials of those this
        rank wrote (``verify.partials``)."""
        rest = self._rest.result() if self._rest is not None else {}
        out = {}
        for key, t in self._plain.items():
            p = written[key][0] if key in written else rest.get(key)
            if p is None:
                p = _partials({key: t}, self._algorithm)[key]
            out[key] = xxhash.xxh3_64_intdigest(f"{p}\0{t.dtype}\0{list(t.shape)}".encode())
        return out


def broadcast_buffer_keys(components: list[Component]) -> set[str]:
    """The flat keys of the buffers that DDP broadcasts from rank 0 at every forward: those
    of a ``DistributedDataParallel`` with ``broadcast_buffers=True`` over every rank (its
    own group's rank 0 is global rank 0 then), less those it was told to ignore."""
    keys: set[str] = set()
    for c in components:
        if not isinstance(c, ModelComponent):
            continue
        for name, root in c.models.items():
            for at, m in root.named_modules():
                if not _broadcasts_from_rank0(m):
                    continue
                prefix = f"{at}." if at else ""
                for raw, _ in m.named_buffers():
                    if raw.removeprefix("module.") in m.parameters_to_ignore:
                        continue
                    for fqn in normalized_fqns(root, prefix + raw):
                        path = (fqn,) if name is None else (name, fqn)
                        keys.add(tree.join_key(c.name, *path))
    return keys


def _broadcasts_from_rank0(m: nn.Module) -> bool:
    if not isinstance(m, nn.parallel.DistributedDataParallel) or not m.broadcast_buffers:
        return False
    group = m.process_group
    return group.size() == collective.world_size() and dist.get_global_rank(group, 0) == 0


def _partials(tensors: Mapping[str, torch.Tensor], algorithm: str) -> dict[str, int]:
    return {
        k: fingerprint.partial(t, t.shape, [0] * t.dim(), algorithm) for k, t in tensors.items()
    }


def differing(held: list[dict[str, int]]) -> dict[str, list[list[int]]]:
    """Each tensor whose holders (``held``: every rank's :meth:`HeldHere.values`, in rank
    order) hold more than one value: key -> the ranks grouped by value, in rank order."""
    groups: dict[str, dict[int, list[int]]] = {}
    for rank, values in enumerate(held):
        for key, value in values.items():
            groups.setdefault(key, {}).setdefault(value, []).append(rank)
    return {key: list(by.values()) for key, by in groups.items() if len(by) > 1}


def refuse_differing(step: int, held: list[dict[str, int]]) -> None:
    """Raise ``CheckpointError`` naming every plain tensor the ranks hold with different
    values (sorted), the ranks that hold each value, and what to do."""
    found = differing(held)
    if not found:
        return
    keys = sorted(found)
    shown = "; ".join(f"{key} ({_groups(found[key])})" for key in keys[:_LISTED])
    more = f"; and {len(keys) - _LISTED} more" if len(keys) > _LISTED else ""
    raise CheckpointError(
        f"step {step} was not saved: {len(keys)} plain (non-DTensor) tensor(s) are held by "
        "several ranks under one name with different values, and a checkpoint keeps one "
        "value per name, so a restore would give every rank the same one (tensors of "
        f"different ranks mixed): {shown}{more}. Nothing was committed. Keep such a "
        "tensor equal on every rank (BatchNorm statistics under DDP: broadcast_buffers="
        "True, or nn.SyncBatchNorm), or, where each rank holds its own part (experts by "
        "hand, per-rank heads), make it a DTensor sharded over the ranks "
        "(torch.distributed.tensor.distribute_tensor(..., placements=[Shard(0)]) on an "
        "expert-parallel mesh), or keep it out of the state (a non-persistent buffer)"
    )


def _groups(groups: list[list[int]]) -> str:
    """``rank 0 holds one value, ranks 1, 3 another`` or ``3 values: rank 0 / 1 / 2, 3``."""
    names = [f"rank{'s' if len(g) > 1 else ''} {', '.join(map(str, g))}" for g in groups]
    if len(groups) == 2:
        return f"{names[0]} hold{'' if len(groups[0]) > 1 else 's'} one value, {names[1]} another"
    return f"{len(groups)} different values: " + " / ".join(names)
