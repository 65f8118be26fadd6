"""A save into the local tier: each rank writes its shard into its node's folder, the
manifest (built by rank 0 as for any save) is committed on every node, and replication
is queued.

A save that cannot fit (a node's free memory is short of its ranks' shards plus the
replicas it receives) or that fails while writing is not committed anywhere: every rank
raises :class:`LocalSaveSkipped`, which the Checkpointer turns into a warning. The
persistent tier is never touched. A state that no save may commit (plain tensors that
differ between ranks, core/replicas.py) is refused with the same error as a persistent
save's.
"""

from __future__ import annotations

import shutil
import uuid
from typing import TYPE_CHECKING, Any

from torch.distributed.tensor import DTensor

from ..core import collective, saving
from ..errors import CheckpointError
from ..storage.locate import location
from ..storage.posix import size_text
from .replication import Job
from .transfer import file_rank

if TYPE_CHECKING:
    from pathlib import Path

    from .store import LocalStore


class LocalSaveSkipped(CheckpointError):
    """A local save that was not committed (no room, or a write failed); a warning."""


def state_bytes(staged: saving.Staged) -> int:
    """This rank's bytes of the staged state (an upper bound of its shard files)."""
    total = 0
    for t in staged.flat.values():
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def save(store: LocalStore, staged: saving.Staged) -> tuple[str, list[str]]:
    """Write and commit ``staged`` as a local step on every node; collective. Returns the
    committed folder on this node and the save's warnings."""
    rank, nodes, folder = collective.rank(), store.nodes, store.folder
    step = staged.request.step
    token = collective.from_rank0(uuid.uuid4().hex[:12])
    sizes = collective.gather_all(state_bytes(staged))
    partial: Path | None = None

    def prepare() -> None:
        nonlocal partial
        if not nodes.is_leader(rank):
            return
        node = nodes.node_of(rank)
        need = sum(sizes[r] for r in nodes.ranks[node])
        need += sum(sizes[s] for r in nodes.ranks[node] for s in store.sources(r))
        free = shutil.disk_usage(folder.path).free
        if need > free:
            raise LocalSaveSkipped(
                f"local step {step} not saved: node {node}'s shards and the replicas it "
                f"keeps need about {size_text(need)}, and {folder.path} has {size_text(free)} free. "
                "Lower LocalTier(keep_last=...) or replicas, or give the folder more room"
            )
        partial = folder.new_partial(step, token)

    here = folder.root / f".partial-step_{step:08d}-{token}"  # every rank's, on its node
    body: dict[str, Any] = {}

    def build() -> tuple[bytes, dict[str, Any], list[str]]:
        assert gathered is not None
        tier = {"tier": "local", **nodes.record(store.tier.replicas)}
        doc, data = saving.manifest_of(location(here), staged, writer, gathered, tier)
        body.update(doc)
        return data, doc["files"], list(doc.get("save_warnings", []))

    def commit() -> None:
        if nodes.is_leader(rank):
            folder.commit(here, step, data)

    try:
        _agreed(prepare)  # a node without room: no node writes (partials removed below)
        try:
            writer, gathered = saving.write_shards(
                location(here), f"rank_{rank:05d}.bin", staged, rank
            )
        except Exception as exc:  # no room, an I/O error: a warning
            raise LocalSaveSkipped(f"local step {step} not saved: {exc}") from exc
        # A refusal of the state itself (plain tensors that differ between ranks, a
        # manifest too large) is an error, as for a persistent save.
        data, files, warnings = collective.on_rank0(build)
        try:
            _agreed(commit)
        except Exception as exc:
            raise LocalSaveSkipped(f"local step {step} not saved: {exc}") from exc
    except BaseException:
        if partial is not None:
            folder.discard(partial)
        raise
    run = staged.request.run
    if rank == 0 and run is not None:
        run.committed(step, staged.skeletons, body["tensors"], body["fingerprint_algorithm"])
    store.queue_replicas(step, _job(store, step, files))
    return str(folder.step_path(step)), warnings


def _job(store: LocalStore, step: int, files: dict[str, Any]) -> Job:
    """This rank's part in replicating ``step``: its files to its targets, its sources'
    files from them."""
    rank = collective.rank()
    by_rank: dict[int, list[str]] = {}
    for name in sorted(files):
        owner = file_rank(name)
        if owner is not None:
            by_rank.setdefault(owner, []).append(name)
    targets = store.targets(rank)
    mine = [(n, files[n]["size"]) for n in by_rank.get(rank, [])] if targets else []
    # Linked aside now: retention may remove the step before the thread sends it.
    kept = {n: store.folder.outgoing(step, n) for n, _ in mine}
    sends = [(t, kept[n], size) for t in targets for n, size in mine]
    receives = [(s, n, files[n]["size"]) for s in store.sources(rank) for n in by_rank.get(s, [])]
    return Job(step, sends, receives)


def _agreed(fn: Any) -> Any:
    """``fn`` on every rank; the first failure raised on every rank."""
    return collective.agree(fn)
