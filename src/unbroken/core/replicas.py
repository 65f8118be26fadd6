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
value every rank trains on next. So a model's buffers are written from rank 0 (small, as
a rule; DCP's pick would be any rank's), and those a DDP over every rank broadcasts are
not refused when they differ. The DDP may be inside the model passed or wrap it (a
LightningModule, a Trainer's model): it is looked for only when some tensor differs.

Refused rather than saved per rank: a model's and an optimizer's tensors are restored
keyed by their live FQNs (targets, byte exchange, the checks after install and at the
first step), which a per-rank copy would have to be mapped back to at every one of them.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Collection, Iterator, Mapping
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
    """What this rank writes of a save's flat tensors (:attr:`to_write`: all of them but,
    on ranks other than 0, the models' buffers) and its 64-bit value (fingerprint, dtype,
    shape) of each plain tensor it holds, for :func:`refuse_differing` on rank 0. Nothing
    is left out or computed in a single process."""

    def __init__(
        self,
        flat: Mapping[str, torch.Tensor],
        algorithm: str,
        components: list[Component],
        partitioned: Collection[str],
    ) -> None:
        several = collective.world_size() > 1
        from_rank0 = set()
        if several and collective.rank() != 0:
            from_rank0 = _buffer_keys(components, partitioned)
        # A DTensor's shards are each rank's own: written where they are.
        self.to_write = {
            k: t for k, t in flat.items() if k not in from_rank0 or isinstance(t, DTensor)
        }
        self._plain = {k: t for k, t in flat.items() if several and not isinstance(t, DTensor)}
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


def _model_buffers(
    components: list[Component], partitioned: Collection[str] = ()
) -> Iterator[tuple[str, nn.Module, nn.Module, str]]:
    """(flat key, root module, module whose buffer it is, its name there) of each buffer
    of every model but those split into pipeline stages (each rank holds other ones)."""
    for c in components:
        if not isinstance(c, ModelComponent) or c.name in partitioned:
            continue
        for name, root in c.models.items():
            for at, owner in root.named_modules(remove_duplicate=False):
                for leaf, _ in owner.named_buffers(recurse=False):
                    raw = f"{at}.{leaf}" if at else leaf
                    for fqn in normalized_fqns(root, raw):
                        path = (fqn,) if name is None else (name, fqn)
                        yield tree.join_key(c.name, *path), root, owner, raw


def _buffer_keys(components: list[Component], partitioned: Collection[str]) -> set[str]:
    return {key for key, *_ in _model_buffers(components, partitioned)}


def broadcast_buffer_keys(components: list[Component]) -> set[str]:
    """The flat keys of the buffers a ``DistributedDataParallel`` with
    ``broadcast_buffers=True`` over every rank (its rank 0 global rank 0) broadcasts at
    every forward, less those it was told to ignore: a DDP inside a model, or around it
    (Lightning's DDP wraps a wrapper of the LightningModule passed)."""
    keys: set[str] = set()
    ddps: dict[int, list[tuple[nn.Module, str]]] = {}  # root -> (DDP, root's name in it)
    for key, root, _, raw in _model_buffers(components):
        if id(root) not in ddps:
            inside = [(m, at) for at, m in root.named_modules() if _broadcasts_from_rank0(m)]
            ddps[id(root)] = inside or [(m, "") for m in _around(root)]
        for ddp, at in ddps[id(root)]:
            inner = _inner_name(ddp, root, at, raw)
            if inner is not None and inner not in ddp.parameters_to_ignore:
                keys.add(key)
    return keys


def _inner_name(ddp: nn.Module, root: nn.Module, at: str, raw: str) -> str | None:
    """``raw`` (a buffer's name in ``root``) as a name within ``ddp.module`` (``ddp`` is
    at ``at`` in ``root``, or around it), or None when the buffer is not ``ddp``'s."""
    if at or ddp is root:
        prefix = f"{at}.module." if at else "module."
        return raw.removeprefix(prefix) if raw.startswith(prefix) else None
    for name, m in ddp.module.named_modules(remove_duplicate=False):
        if m is root:
            return f"{name}.{raw}" if name else raw
    return None


_UP = 3  # modules around a model searched for a DDP: DDP(wrapper(model)) is two
# root -> the DDP found around it: each gc search scans the whole heap (about 0.13 s at a
# million objects), so one found is kept while it still holds the root.
_FOUND: weakref.WeakKeyDictionary[nn.Module, weakref.ref[nn.Module]] = weakref.WeakKeyDictionary()


def _around(module: nn.Module) -> list[nn.Module]:
    """The broadcasting ``DistributedDataParallel`` holding ``module`` at most ``_UP``
    levels up (the nearest), found through the garbage collector's referrers (a module
    does not know its parents): looked for only when some tensor differs."""
    kept = _FOUND.get(module)
    ddp = kept() if kept is not None else None
    if ddp is not None and any(m is module for m in ddp.modules()):
        return [ddp] if _broadcasts_from_rank0(ddp) else []
    level = [module]
    for _ in range(_UP):
        level = _parents(level)
        found = [m for m in level if isinstance(m, nn.parallel.DistributedDataParallel)]
        if found:
            _FOUND[module] = weakref.ref(found[0])
            return [m for m in found if _broadcasts_from_rank0(m)]
    return []


def _parents(modules: list[nn.Module]) -> list[nn.Module]:
    """The modules holding any of ``modules`` as a child (in their ``_modules``): three
    scans of the heap, whatever the number of modules."""
    if not modules:
        return []
    ids = {id(m) for m in modules}
    children = [
        d
        for d in gc.get_referrers(*modules)
        if isinstance(d, dict) and any(id(v) in ids for v in d.values())
    ]
    if not children:
        return []
    child_ids = {id(d) for d in children}
    out, dicts = [], []
    for holder in gc.get_referrers(*children):
        if isinstance(holder, nn.Module) and id(holder._modules) in child_ids:
            out.append(holder)
        elif isinstance(holder, dict) and id(holder.get("_modules")) in child_ids:
            dicts.append(holder)
    if dicts:
        out += [o for o in gc.get_referrers(*dicts) if isinstance(o, nn.Module)]
    unique = {id(m): m for m in out if id(m._modules) in child_ids}
    return list(unique.values())


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


def refuse_differing(
    step: int, held: list[dict[str, int]], components: list[Component] | None = None
) -> None:
    """Raise ``CheckpointError`` naming every plain tensor the ranks hold with different
    values (sorted), the ranks that hold each value, and what to do; DDP's broadcast
    buffers among ``components``' models (written from rank 0) are not refused."""
    found = differing(held)
    if found and components:
        for key in broadcast_buffer_keys(components):
            found.pop(key, None)
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
