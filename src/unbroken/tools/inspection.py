"""Look inside committed checkpoints without live training objects: ``inspect_checkpoint``.

A run folder is listed (:class:`RunInspection`: every step folder summarized, the
lineage restore() resumes, the retired branches); one checkpoint is shown in detail
(:class:`CheckpointInspection`: components, every tensor mapped to its component, the
optimizer's coverage of the model). All of it comes from the JSON manifest except the
optimizer's ``step`` values, scalar tensors read checksummed. Nothing here writes to a
checkpoint folder or unpickles anything.

The listing imports no torch (``unbroken inspect --json RUN`` answers without it); the
detail imports it to read the ``step`` tensors.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError
from ..format import manifest
from ..format.fingerprint import weakness
from ..storage.interface import Location, vanished
from ..storage.locate import checkpoint_dir, location
from ..storage.names import MANIFEST, RETIRED, folder_step
from .contents import tensor_components
from .folders import is_step_folder, locate, step_folders
from .reporting import JsonResult

if TYPE_CHECKING:
    from .coverage import OptimizerCoverage

MAX_RELISTS = 100  # how often a listing may be redone because a save changed the folder


@dataclasses.dataclass
class CheckpointSummary:
    """One step folder, as ``unbroken inspect DIR`` lists it."""

    step: int | None  # the manifest's step (the folder name's if it cannot be read)
    path: str  # the step folder
    size_bytes: int  # bytes of its files (on a store: of the objects its manifest lists)
    created_unix: float | None = None  # when it was saved, seconds since 1970 (UTC)
    world_size: int | None = None  # ranks that saved it
    versions: dict[str, str] = dataclasses.field(default_factory=dict)  # torch, unbroken...
    lineage: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # start, resumes
    error: str | None = None  # why the manifest could not be read (None: it was)
    committed: bool = True  # False: a step folder without manifest.json (damaged)


@dataclasses.dataclass
class RunInspection(JsonResult):
    """A run folder's checkpoints: what :func:`inspect_checkpoint` returns for a run
    folder without ``step`` (``unbroken inspect DIR --json`` prints :meth:`to_dict`)."""

    path: str  # the run folder, as given
    checkpoints: list[CheckpointSummary]  # every step folder, by step (damaged ones too)
    branch: list[dict[str, Any]]  # the newest readable checkpoint's lineage: what restore()
    # resumes (start, then each resume with its world size, resets, retired steps, replay)
    retired: list[CheckpointSummary]  # abandoned branches kept aside (.retired-step_*)

    @property
    def newest(self) -> CheckpointSummary | None:
        """The newest checkpoint whose manifest can be read (its lineage is ``branch``)."""
        sound = [s for s in self.checkpoints if not s.error]
        return sound[-1] if sound else None

    @property
    def unreadable(self) -> list[CheckpointSummary]:
        """Committed checkpoints whose manifest cannot be read (the command exits 1)."""
        return [s for s in self.checkpoints if s.error and s.committed]


@dataclasses.dataclass
class TensorInfo:
    """One saved (logical, unsharded) tensor."""

    key: str  # its key in the manifest, e.g. ``model/inp.weight``
    component: str | None  # the component whose state references it
    shape: list[int]
    dtype: str  # torch's name, e.g. ``bfloat16``
    bytes: int  # of the whole tensor
    fingerprint: str  # the layout-independent digest recorded at save
    chunks: int  # pieces stored (shards)


@dataclasses.dataclass
class ComponentInfo:
    """One saved component (``model``, ``optimizer``, ``scheduler``, ``rng``, an extra)."""

    name: str
    kind: str  # what saved it, e.g. ``model``, ``optimizer``, ``stateful``
    per_rank: bool  # saved once per rank (rng, dataloader)
    tensors: int  # tensors its state references
    bytes: int  # their total size


@dataclasses.dataclass
class FrozenPart:
    """The frozen parameters of a checkpoint saved with ``frozen="verify"``."""

    tensors: int  # not stored: verified by fingerprint against the live base at restore
    bytes: int  # their total size (not on disk)
    stored: int  # frozen, but stored in full (changed since the base was recorded)
    keys: list[str]  # the tensors not stored, sorted


def frozen_part(doc: dict[str, Any]) -> FrozenPart | None:
    """What a manifest's ``frozen`` records say, or None where it has none."""
    records = doc.get("frozen") or {}
    if not records:
        return None
    left_out = sorted(k for k, r in records.items() if not r["stored"])
    size = sum(
        math.prod(records[k]["shape"]) * manifest.ITEMSIZES[records[k]["dtype"]] for k in left_out
    )
    return FrozenPart(len(left_out), size, len(records) - len(left_out), left_out)


@dataclasses.dataclass
class CheckpointInspection(JsonResult):
    """One committed checkpoint in detail: what :func:`inspect_checkpoint` returns for a
    step folder or a given step (``unbroken inspect DIR --step N --json``)."""

    path: str  # the step folder
    step: int
    created_unix: float | None  # when it was saved, seconds since 1970 (UTC)
    world_size: int  # ranks that saved it
    versions: dict[str, str]  # torch, unbroken (and python) versions that saved it
    lineage: list[dict[str, Any]]  # start, then each resume (world size, resets, replay)
    metrics: list[dict[str, Any]]  # the tracked-metric window kept with it, one per step
    probe: bool  # whether a probe value was recorded (checked after every restore)
    components: list[ComponentInfo]
    tensors: list[TensorInfo]  # every saved tensor, sorted by key
    optimizer: OptimizerCoverage | None  # the model's coverage by the optimizer state
    # (None without an optimizer); its ``failures`` make ``unbroken verify`` fail
    fingerprint_format: str = ""  # e.g. ``mix64-v3``
    fingerprint_note: str | None = None  # set for an older, weaker format
    frozen: FrozenPart | None = None  # saved with frozen="verify": the part not stored


def inspect_checkpoint(
    path: str | os.PathLike, *, step: int | None = None
) -> RunInspection | CheckpointInspection:
    """What a run's checkpoints hold, or one checkpoint in detail (``unbroken inspect``).

    Reads only manifests (and, for the detail, the optimizer's scalar ``step`` tensors);
    never writes. A checkpoint that a concurrent save prunes or re-saves while it is read
    is read again as it is now, not reported as damaged.

    Args:
        path: a run folder (holding ``step_*`` folders) or one step folder; local, or an
            fsspec URL such as ``s3://bucket/run``.
        step: a committed step of the run folder to show in detail.

    Returns:
        :class:`RunInspection` for a run folder without ``step``: every step folder
        summarized (one whose manifest is unreadable or missing is listed with its
        ``error``, not raised). :class:`CheckpointInspection` for a step folder or a
        given ``step``.

    Raises:
        CheckpointNotFoundError: ``path`` does not exist or holds no committed checkpoint,
            or ``step`` is not a committed step.
        CorruptCheckpointError: the manifest of the checkpoint shown in detail is
            damaged (or missing: ``step`` names a folder that lost it).

    Example::

        run = ub.inspect_checkpoint("ckpts/run1")
        print([c.step for c in run.checkpoints])
        detail = ub.inspect_checkpoint("ckpts/run1", step=200)
        print(detail.world_size, [t.key for t in detail.tensors][:3])
    """
    if step is None and not is_step_folder(path):
        return _inspect_run(path)
    return _inspect_one(path, step)


def _inspect_run(path: str | os.PathLike) -> RunInspection:
    found = RunInspection(str(path), list_checkpoints(path), [], retired_checkpoints(path))
    if found.newest is not None:
        found.branch = found.newest.lineage
    return found


def _inspect_one(path: str | os.PathLike, step: int | None) -> CheckpointInspection:
    """The folder meant, read again if a concurrent save prunes or re-saves it while it
    is read (that is not damage)."""
    # torch: only the detail reads tensors (the optimizer's `step` values).
    from ..format.tensor_reader import TensorReader
    from .coverage import optimizer_coverage

    for _ in range(MAX_RELISTS):
        folder = locate(path, step)
        seen = folder.identity()
        try:
            doc = manifest.read(folder)
            with TensorReader(folder, doc) as reader:
                coverage = optimizer_coverage(doc, read=reader.read)
        except CheckpointError:
            if not vanished(folder, seen):
                raise
            continue
        tensors = tensors_of(doc)
        return CheckpointInspection(
            path=str(folder),
            step=doc["step"],
            created_unix=doc.get("created_unix"),
            world_size=doc["world_size"],
            versions=dict(doc.get("versions", {})),
            lineage=list(doc["lineage"]),
            metrics=list(doc.get("metrics") or []),
            probe=doc.get("probe") is not None,
            components=components_of(doc, tensors),
            tensors=tensors,
            optimizer=coverage,
            fingerprint_format=manifest.fingerprint_algorithm(doc),
            fingerprint_note=weakness(manifest.fingerprint_algorithm(doc)),
            frozen=frozen_part(doc),
        )
    raise CheckpointError(f"{path} changed faster than it could be read")


def summarize(folder: Location) -> CheckpointSummary:
    """Summary of one step folder; an unreadable manifest is reported, not raised."""
    step, committed = folder_step(folder), is_step_folder(folder)
    try:
        size = _size(folder)
    except OSError as exc:  # no permission, or gone meanwhile
        error = f"{folder} cannot be read ({exc.strerror or exc})"
        return CheckpointSummary(step, str(folder), 0, error=error, committed=committed)
    try:
        doc = manifest.read(folder)
    except CheckpointError as exc:
        return CheckpointSummary(step, str(folder), size, error=str(exc), committed=committed)
    return CheckpointSummary(
        step=doc["step"],
        path=str(folder),
        size_bytes=size,
        created_unix=doc.get("created_unix"),
        world_size=doc["world_size"],
        versions=dict(doc.get("versions", {})),
        lineage=list(doc["lineage"]),
    )


def _size(folder: Location) -> int:
    files = folder.plain_files()
    if folder.saves_in_place:  # only its manifest and the files it lists (not other saves')
        try:
            listed = set(manifest.read(folder)["files"]) | {MANIFEST}
        except CheckpointError:
            listed = {MANIFEST}
        files = {name: f for name, f in files.items() if name in listed}
    return sum(f.size for f in files.values())


def list_checkpoints(path: str | os.PathLike | Location) -> list[CheckpointSummary]:
    """:func:`summarize` of every step folder under ``path`` (those without a manifest
    too). A folder that a concurrent save prunes or re-saves while it is read is no
    damage: the folders are listed again and summarized as they are now."""
    for _ in range(MAX_RELISTS):
        summaries = []
        for folder in step_folders(path, damaged=True):
            seen = folder.identity()
            summary = summarize(folder)
            if summary.error and vanished(folder, seen):
                break
            summaries.append(summary)
        else:
            return summaries
    raise CheckpointError(f"the checkpoints in {path} changed faster than they could be read")


def retired_checkpoints(path: str | os.PathLike | Location) -> list[CheckpointSummary]:
    """Checkpoints of abandoned branches kept aside in a run folder (``.retired-step_*``,
    never listed or restored; see :mod:`unbroken.core.branching`), by step."""
    path = location(path)
    if is_step_folder(path) and not path.name.startswith(RETIRED):
        return []
    return [summarize(folder) for _, folder in checkpoint_dir(path).retired()]


def tensors_of(doc: dict[str, Any]) -> list[TensorInfo]:
    """Every saved tensor, sorted by key, with its owning component."""
    owner = tensor_components(doc)
    return [
        TensorInfo(
            key=key,
            component=owner.get(key),
            shape=list(entry["shape"]),
            dtype=entry["dtype"],
            bytes=manifest.tensor_nbytes(entry),
            fingerprint=entry.get("fingerprint", ""),
            chunks=len(entry["chunks"]),
        )
        for key, entry in sorted(doc["tensors"].items())
    ]


def components_of(doc: dict[str, Any], tensors: list[TensorInfo]) -> list[ComponentInfo]:
    """Every saved component with the count and size of the tensors it references."""
    out = []
    for name, entry in doc["components"].items():
        mine = [t for t in tensors if t.component == name]
        out.append(
            ComponentInfo(
                name=name,
                kind=str(entry.get("kind", "")),
                per_rank=bool(entry.get("per_rank")),
                tensors=len(mine),
                bytes=sum(t.bytes for t in mine),
            )
        )
    return out
