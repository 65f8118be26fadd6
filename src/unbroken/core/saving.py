"""One save: live objects -> flat tensors -> shard files -> manifest -> commit."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.tensor import DTensor

from ..errors import CheckpointError
from ..format import fingerprint, layout, manifest, tree
from ..format.shard_writer import ShardWriter, write_files
from ..format.shards import quiet_single_process
from ..live import gradients, stages
from ..live.adapters import peft_configs
from ..live.components import rank_prefix
from ..live.optimizer import OptimizerComponent
from ..live.state import Component, ModelComponent, StatefulComponent, device_kind
from ..storage.interface import CheckpointDir, Location
from . import collective, frozen, replicas, verify
from .staging import StagingBuffers, settle

logger = logging.getLogger(__name__)


class RunHooks(Protocol):
    """What one save asks of the run it belongs to (``run/run.py``'s ``RunSave``), fixed
    when ``save()`` was called. Rank 0 calls the methods, in this order, holding the
    folder's save lock; a background save calls them from its own thread."""

    lineage: list[dict[str, Any]]  # the run's history, as the manifest records it
    metrics: list[dict[str, Any]]  # the last tracked steps, for the manifest
    retire: list[int]  # committed steps of an abandoned branch, retired at the commit

    def check(self, step: int) -> None:
        """Before anything is written: raise ``CheckpointError`` if the save must not
        happen (another run committed into the folder)."""
        ...

    def other_writer(self, committed: bytes) -> str | None:
        """At the commit, the step found committed already (its manifest's bytes): who
        wrote it (for the refusal), or None if it is this run's and may be replaced."""
        ...

    def findings(
        self, skeletons: Mapping[str, Any], tensors: Mapping[str, Any], algorithm: str
    ) -> list[str]:
        """Before the commit: the run's warnings about this save (the manifest keeps
        them), given its skeletons and tensor entries."""
        ...

    def committed(
        self, step: int, skeletons: Mapping[str, Any], tensors: Mapping[str, Any], algorithm: str
    ) -> None:
        """Once the save committed. Never raises."""
        ...


@dataclasses.dataclass
class SaveRequest:
    step: int
    components: list[Component]
    run: RunHooks | None  # None: a save outside a run (tools, tests)
    probe: dict[str, Any] | None  # this rank's probe record
    # shared components already reported as saved per rank (warned once, then kept quiet)
    noted_per_rank: set[str] = dataclasses.field(default_factory=set)
    # which gradients the optimizers' steps consumed (None: every nonzero one is pending)
    gradient_watch: gradients.StepWatch | None = None


@dataclasses.dataclass
class Staged:
    """What one save writes: JSON skeletons and flat tensors, fixed at ``stage`` time."""

    request: SaveRequest
    skeletons: dict[str, Any]
    flat: dict[str, torch.Tensor]
    info: dict[str, dict[str, Any]]  # key -> manifest fields known at capture (device, stride)
    per_rank: set[str] = dataclasses.field(default_factory=set)  # components saved per rank
    # Live tensors not yet copied (async_save="overlap"): ``flat`` holds them until a copy
    # in the background replaces them (core/background.py).
    deferred: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    # What the save found worth a warning (the manifest's save_warnings), on every rank
    # once committed.
    warnings: list[str] = dataclasses.field(default_factory=list)
    # Components each rank holds a part of (pipeline stages), merged at commit.
    partitioned: set[str] = dataclasses.field(default_factory=set)
    # What the components found at capture (Component.save_warnings; rank 0's are kept).
    notes: list[str] = dataclasses.field(default_factory=list)
    # This rank's parameters holding gradients at capture (live/gradients.py: held).
    gradients: list[str] = dataclasses.field(default_factory=list)
    # The manifest's ``frozen`` records (frozen="verify": core/frozen.py).
    frozen: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)


def stage(
    request: SaveRequest,
    buffers: StagingBuffers | None = None,
    defer: Callable[[torch.Tensor], bool] | None = None,
) -> Staged:
    """Capture the live state (collective on errors). With ``buffers``, tensors are copied
    so training may change the live ones while the copy is written in the background;
    those for which ``defer`` is true are left live in ``Staged.deferred``, to be copied
    later (core/background.py). Everything else (skeletons, small state) is fixed here.

    A shared component (scheduler, extra) whose state differs between ranks is saved per
    rank in this checkpoint, each rank's own value, so none is lost or mixed.
    """
    rank = collective.rank()
    captured: dict[str, Any] = {}

    verifying = frozen.verifying(request.components)

    def capture() -> tuple[dict[str, str], dict[str, str], dict[str, dict]]:
        digests, names = {}, {}
        for c in request.components:
            captured[c.name] = c.capture()
            if isinstance(c, StatefulComponent) and not c.per_rank:
                digests[c.name] = _digest(captured[c.name], c.name)
            elif isinstance(c, ModelComponent):
                names[c.name] = _names_digest(captured[c.name])
        shares = {
            c.name: frozen.shares(c, c.frozen_keys(), fingerprint.ALGORITHM, captured[c.name])
            for c in verifying
        }
        return digests, names, shares

    gathered = collective.agree_all(capture)
    partitioned = _partitioned(request.components, [names for _, names, _ in gathered])
    digests = [d for d, _, _ in gathered]
    frozen_records, frozen_warnings = {}, []
    for c in verifying:
        found = frozen.fingerprints([shares.get(c.name, {}) for _, _, shares in gathered])
        omit, records, warning = frozen.decide(c, {k: r for k, r in found.items() if r})
        captured[c.name] = frozen.without(c, captured[c.name], omit)
        frozen_records.update(records)
        frozen_warnings += [warning] if warning else []
    if rank == 0:
        for warning in frozen_warnings:
            logger.warning("step %d: %s", request.step, warning)
    differ = {name for name in digests[0] if len({d[name] for d in digests}) > 1}
    per_rank = {c.name for c in request.components if c.per_rank or c.name in differ}
    if rank == 0:
        for name in sorted(differ - request.noted_per_rank):
            logger.warning(
                "the state of %r differs between ranks: it is saved per rank (each rank's "
                "own value) and restores only onto the same world size; pass per-rank "
                "state on purpose, or keep it equal on every rank",
                name,
            )
    request.noted_per_rank |= differ

    def encode() -> Staged:
        skeletons: dict[str, Any] = {}
        flat: dict[str, torch.Tensor] = {}
        for c in request.components:
            prefix = rank_prefix(c.name, rank) if c.name in per_rank else c.name
            skeletons[c.name] = tree.encode(captured[c.name], prefix, flat)
        for key, t in flat.items():
            _check_savable(key, t)  # before anything is written
        info = {k: _capture_info(t) for k, t in flat.items()}
        deferred: dict[str, torch.Tensor] = {}
        if buffers is not None:
            deferred = {k: t for k, t in flat.items() if defer is not None and defer(t)}
            flat = {**flat, **buffers.copy({k: t for k, t in flat.items() if k not in deferred})}
            buffers.keep_only(flat)
        notes = [note for c in request.components for note in c.save_warnings()]
        return Staged(
            request,
            skeletons,
            flat,
            info,
            per_rank,
            deferred,
            partitioned=partitioned,
            notes=notes + frozen_warnings,
            frozen=frozen_records,
            gradients=gradients.held(request.components, request.gradient_watch),
        )

    staged = collective.agree(encode)
    assert staged is not None
    return staged


def _names_digest(state: Any) -> str:
    """xxh3-128 of the names a model's state holds (its FQNs, nested by model name)."""

    def names(value: Any) -> Any:
        return {k: names(v) for k, v in value.items()} if isinstance(value, dict) else None

    return xxhash.xxh3_128_hexdigest(json.dumps(names(state), sort_keys=True).encode())


def _partitioned(components: list[Component], per_rank: list[dict[str, str]]) -> set[str]:
    """The models whose state has other names on some rank (pipeline stages: each rank
    holds other modules), and the optimizers over them: saved as the ranks' skeletons
    merged (live/stages.py)."""
    split = {name for name in per_rank[0] if any(n[name] != per_rank[0][name] for n in per_rank)}
    return split | {
        c.name for c in components if isinstance(c, OptimizerComponent) and c.model.name in split
    }


def _capture_info(t: torch.Tensor) -> dict[str, Any]:
    info: dict[str, Any] = {"device": device_kind(t)}
    if not isinstance(t, DTensor):
        stride = layout.recorded_stride(t)
        if stride is not None:
            info["stride"] = stride
    return info


def _check_savable(key: str, t: torch.Tensor) -> None:
    if t.layout != torch.strided:
        raise CheckpointError(
            f"tensor {key!r} is {str(t.layout).removeprefix('torch.')}; only dense tensors "
            "can be checkpointed: keep it dense (e.g. .to_dense()) in the state, or register "
            "it as a non-persistent buffer and rebuild it after restore"
        )
    try:
        manifest.dtype_name(t.dtype)
    except TypeError as exc:
        raise TypeError(f"tensor {key!r}: {exc}") from None


def _digest(state: Any, name: str) -> str:
    """xxh3-128 of a component's state: its JSON skeleton and each tensor's dtype, shape
    and bytes (a sharded DTensor contributes its global shape only)."""
    flat: dict[str, torch.Tensor] = {}
    skeleton = tree.encode(state, name, flat)
    h = xxhash.xxh3_128(json.dumps(skeleton, sort_keys=True).encode())
    for key, t in flat.items():
        h.update(f"\0{key}\0{t.dtype}\0{list(t.shape)}\0".encode())
        if not isinstance(t, DTensor) and t.layout == torch.strided:
            data = t.detach().resolve_conj().resolve_neg().cpu().contiguous().reshape(-1)
            h.update(data.view(torch.uint8).numpy().data)
    return h.hexdigest()


def write(ckdir: CheckpointDir, staged: Staged) -> Location:
    """Write and commit a staged checkpoint; collective. Returns the committed folder.

    Rank 0 holds the folder's save lock throughout, refuses the save if its run says so
    (``RunHooks.check``: another run committed into the folder), cleans leftovers of crashed saves,
    and removes its partial folder if anything fails: committed checkpoints are never
    touched by a failed save.
    """
    started = time.perf_counter()
    rank = collective.rank()
    step = staged.request.step
    with contextlib.ExitStack() as stack:

        def prepare() -> str:
            stack.enter_context(ckdir.save_lock())
            if staged.request.run is not None:
                staged.request.run.check(step)  # before any write
            ckdir.clean_leftovers()
            return ckdir.token(ckdir.new_partial(step))

        token = collective.on_rank0(prepare)
        partial = ckdir.from_token(token)
        try:
            final = _write(ckdir, partial, staged, rank)
        except BaseException:
            if rank == 0:
                ckdir.discard(partial)
            raise
    if rank == 0:
        logger.info("saved step %d to %s in %.2fs", step, final, time.perf_counter() - started)
    return final


def _write(ckdir: CheckpointDir, partial: Location, staged: Staged, rank: int) -> Location:
    request = staged.request
    writer, gathered = write_shards(partial, ckdir.shard_name(partial, rank), staged, rank)

    def commit() -> tuple[str, list[str]]:
        assert gathered is not None
        body, data = manifest_of(partial, staged, writer, gathered)
        run = request.run
        final = ckdir.commit(
            partial,
            request.step,
            retire=run.retire if run is not None else [],
            manifest=data,
            other_writer=run.other_writer if run is not None else None,
        )
        if request.run is not None:
            request.run.committed(
                request.step, staged.skeletons, body["tensors"], body["fingerprint_algorithm"]
            )
        return str(final), body.get("save_warnings", [])

    committed = collective.on_rank0(commit)
    assert committed is not None
    staged.warnings = list(committed[1])
    return ckdir.from_token(committed[0])


def manifest_of(
    partial: Location,
    staged: Staged,
    writer: ShardWriter,
    gathered: list[dict],
    tier: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], bytes]:
    """Rank 0: the manifest's document and bytes once every rank wrote its shard (a
    plain tensor that ranks hold with different values refuses the save here);
    ``tier``: a local step's record of its nodes and replicas."""
    request = staged.request
    replicas.refuse_differing(request.step, [g["held"] for g in gathered], request.components)
    body = _manifest_body(request, staged, writer, gathered)
    if tier is not None:
        body["tier"] = tier
    return body, manifest.encode(partial, body)


def write_shards(
    partial: Location, name: str, staged: Staged, rank: int
) -> tuple[ShardWriter, list[dict] | None]:
    """This rank's shard written into ``partial`` (as ``name``), fingerprinted while it is
    written; every rank's record gathered on rank 0 (None elsewhere). Collective."""
    request, flat = staged.request, staged.flat
    writer = ShardWriter(partial, rank=rank, name=name, files=write_files())
    settle(flat)
    # Fingerprints are computed while DCP writes: file I/O and torch kernels both
    # release the GIL, so the two overlap on separate cores (on a GPU, the fingerprints
    # run on the device and the writes copy through pinned buffers: format/host_ring.py).
    # A sharded tensor's share on every rank that counts it; a whole one on the rank that
    # writes it (DCP picks one rank per tensor: with pipeline stages, not always rank 0).
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="unbroken-fp") as pool:
        algorithm = fingerprint.ALGORITHM  # one for every tensor, recorded in the manifest
        sharded = {k: t for k, t in flat.items() if isinstance(t, DTensor)}
        jobs = [pool.submit(verify.partials, sharded, (), algorithm)]
        held = replicas.HeldHere(flat, algorithm, request.components, staged.partitioned)

        def written_here(keys: list[str]) -> None:
            jobs.append(pool.submit(verify.partials, {k: flat[k] for k in keys}, keys, algorithm))
            held.start(pool, keys)

        writer.on_plan = written_here
        try:
            with quiet_single_process():
                dcp.save(
                    held.to_write,  # the models' buffers from rank 0 only
                    storage_writer=writer,
                    planner=DefaultSavePlanner(),
                    process_group=collective.group(),
                    no_dist=not collective.active(),
                )
        except CheckpointException as exc:
            raise collective.unwrap(
                exc, f"saving step {request.step} into {partial}", partial
            ) from None
        partials = {k: v for job in jobs for k, v in job.result().items()}
        local = {
            "partials": partials,
            "held": held.values(partials),
            "fingerprint_algorithm": algorithm,
            "info": staged.info,
            "skeletons": {
                name: staged.skeletons[name] for name in staged.per_rank | staged.partitioned
            },
            "parameters": {
                c.name: c.trainable_fqns()
                for c in request.components
                if c.name in staged.partitioned and isinstance(c, ModelComponent)
            },
            "files": writer.file_records,
            "probe": request.probe,
            "gradients": staged.gradients,
        }
    return writer, collective.gather_to_rank0(local)  # only rank 0 writes the manifest


def _manifest_body(
    request: SaveRequest, staged: Staged, writer: ShardWriter, gathered: list[dict]
) -> dict[str, Any]:
    """The manifest's document (``format/manifest.py`` builds it): every rank's
    fingerprints, files and per-rank skeletons, and what the run records."""
    if writer.metadata is None:
        raise CheckpointError("internal error: the coordinator has no DCP metadata after save")
    info: dict[str, dict] = {}
    for g in gathered:
        for k, v in g["info"].items():
            info.setdefault(k, v)
    algorithm = gathered[0]["fingerprint_algorithm"]
    tensors = manifest.tensor_entries(
        writer.metadata, verify.combine([g["partials"] for g in gathered]), info
    )
    warnings = list(staged.notes)
    held = gradients.record(
        [g["gradients"] for g in gathered], saved=gradients.saves(request.components)
    )
    warnings += [w for w in [gradients.warning(held)] if w is not None]
    if request.run is not None:
        warnings += request.run.findings(staged.skeletons, tensors, algorithm)
    probes = [g["probe"] for g in gathered]
    return manifest.document(
        step=request.step,
        world_size=len(gathered),
        components=_component_entries(request.components, staged, gathered),
        tensors=tensors,
        files=dict(record for g in gathered for record in g["files"]),
        fingerprint_algorithm=algorithm,
        lineage=request.run.lineage if request.run is not None else [],
        metrics=request.run.metrics if request.run is not None else [],
        probes=probes if probes[0] is not None else None,
        warnings=warnings,
        gradients=held,
        frozen=staged.frozen,
        peft=_peft(request.components),
    )


def _peft(components: list[Component]) -> dict[str, Any] | None:
    """The PEFT adapters' configurations of the (first) model, if it is a PEFT model."""
    models = [c for c in components if isinstance(c, ModelComponent)]
    return peft_configs(models[0].models) if models else None


def _component_entries(
    components: list[Component], staged: Staged, gathered: list[dict]
) -> dict[str, Any]:
    """Each component's manifest entry: its kind, and its state's skeleton (one, one per
    rank, or every pipeline stage's part merged)."""
    entries: dict[str, Any] = {}
    for c in components:
        per_rank = c.name in staged.per_rank
        entry: dict[str, Any] = {"kind": c.kind, "per_rank": per_rank}
        if isinstance(c, ModelComponent):  # trainable parameters (not buffers, not frozen)
            entry["parameters"] = c.trainable_fqns()
        if per_rank:
            entry["ranks"] = {str(r): g["skeletons"][c.name] for r, g in enumerate(gathered)}
        elif c.name in staged.partitioned:  # every stage's part in one skeleton
            entry["state"] = stages.merge(c, [g["skeletons"][c.name] for g in gathered])
            if isinstance(c, ModelComponent):
                entry["parameters"] = sorted({f for g in gathered for f in g["parameters"][c.name]})
        else:
            entry["state"] = staged.skeletons[c.name]
        entries[c.name] = entry
    return entries
