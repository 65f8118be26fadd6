"""Look inside committed checkpoints without live training objects.

Finds checkpoints on disk (a run folder or one step folder), summarizes them, and maps
every saved tensor to its component and parameter FQN, from the JSON manifest alone.
Nothing here writes to a checkpoint folder or unpickles anything.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ..format import manifest, tree
from ..format.tensor_reader import tensor_nbytes
from ..storage.interface import CheckpointDir, Location, vanished
from ..storage.locate import checkpoint_dir, location
from ..storage.names import MANIFEST, RETIRED, folder_step

MAX_RELISTS = 100  # how often a listing may be redone because a save changed the folder


def is_step_folder(path: str | os.PathLike | Location) -> bool:
    """Whether ``path`` is a committed step folder (it holds a manifest; one that cannot
    be told is taken for one, so that reading it names what is unreadable)."""
    return location(path).has_file(MANIFEST) is not False


def locate(path: str | os.PathLike | Location, step: int | None = None) -> Location:
    """The step folder meant by ``path`` (a run folder or a step folder) and ``step``.

    A run folder means its latest committed step unless ``step`` is given.

    Raises:
        CheckpointNotFoundError: no such path, not a checkpoint, or no such step.
    """
    path = location(path)
    if not path.exists():
        raise CheckpointNotFoundError(f"{path} does not exist")
    if not path.is_dir():
        raise CheckpointNotFoundError(
            f"{path} is a file, not a checkpoint folder; pass a run folder (holding step_* "
            "folders) or one step folder"
        )
    if path.name.startswith((".partial-", ".trash-")):
        raise CheckpointNotFoundError(
            f"{path} is a save in progress or a checkpoint being deleted, not a committed one"
        )
    if is_step_folder(path):
        if step is not None:
            saved = folder_step(path)
            if saved is not None and saved != step:
                raise CheckpointNotFoundError(
                    f"{path} is the checkpoint of step {saved}, not step {step}; pass the "
                    "run folder to choose among steps"
                )
        return path
    if folder_step(path) is not None:
        raise CheckpointNotFoundError(
            f"{path} has no {MANIFEST}: it is not a committed checkpoint (a save never "
            "leaves one: its manifest was lost or deleted, and the checkpoint is damaged)"
        )
    ckdir = checkpoint_dir(path)
    steps, lost = ckdir.steps(), ckdir.steps_without_manifest()
    if not steps:
        damaged = f"; damaged: {_lost_text(ckdir, lost)}" if lost else ""
        raise CheckpointNotFoundError(
            f"{path} holds no committed unbroken checkpoint (no step_*/{MANIFEST}){damaged}; "
            "checkpoints of other tools can be brought in with `unbroken import`"
        )
    if step is None:
        step = steps[-1]
    elif step in lost:
        raise CorruptCheckpointError(f"{_lost_text(ckdir, [step])}; committed steps: {steps}")
    elif step not in steps:
        raise CheckpointNotFoundError(
            f"step {step} is not a committed checkpoint in {path}; committed steps: {steps}"
        )
    return ckdir.step_path(step)


def _lost_text(ckdir: CheckpointDir, steps: list[int]) -> str:
    names = ", ".join(ckdir.step_path(s).name for s in steps)
    return (
        f"{names} in {ckdir.root} {'has' if len(steps) == 1 else 'have'} no {MANIFEST} (the "
        "manifest was lost or deleted: such a checkpoint is damaged and never restored)"
    )


def step_folders(path: str | os.PathLike | Location, *, damaged: bool = False) -> list[Location]:
    """Every committed step folder under ``path`` (itself, if it is a step folder), by
    step; with ``damaged``, also the step folders that lost their manifest.json."""
    path = location(path)
    locate(path)  # raises a clear error for anything that is not a checkpoint
    if is_step_folder(path):
        return [path]
    ckdir = checkpoint_dir(path)
    steps = ckdir.steps() + (ckdir.steps_without_manifest() if damaged else [])
    return [ckdir.step_path(s) for s in sorted(steps)]


@dataclasses.dataclass
class CheckpointSummary:
    """One step folder, as listed by ``unbroken inspect DIR``."""

    step: int | None
    path: str
    size_bytes: int
    created_unix: float | None = None
    world_size: int | None = None
    versions: dict[str, str] = dataclasses.field(default_factory=dict)
    lineage: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    error: str | None = None  # the manifest could not be read
    committed: bool = True  # False: a step folder without manifest.json (damaged)


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
    if folder.remote:  # a store's: its manifest and the files it lists (not other saves')
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


def component_skeletons(doc: dict[str, Any], name: str) -> list[Any]:
    """The JSON skeleton(s) of a component: one, or one per rank for per-rank state."""
    entry = doc["components"][name]
    if entry.get("per_rank"):
        return [entry["ranks"][r] for r in sorted(entry.get("ranks", {}), key=int)]
    return [entry.get("state")]


def tensor_components(doc: dict[str, Any]) -> dict[str, str]:
    """Tensor key -> name of the component whose state references it."""
    owner: dict[str, str] = {}
    for name in doc["components"]:
        for skeleton in component_skeletons(doc, name):
            for key in tree.tensor_keys(skeleton):
                owner.setdefault(key, name)
    return owner


def unescape(segment: str) -> str:
    return segment.replace("%2F", "/").replace("%25", "%")


def model_fqns(doc: dict[str, Any]) -> dict[str, str]:
    """Normalized model FQN -> tensor key (``<name>.<fqn>`` for a dict of models)."""
    if "model" not in doc["components"]:
        return {}
    keys = tree.tensor_keys(doc["components"]["model"].get("state"))
    # A reference to an unlisted tensor is damage that `unbroken verify` names.
    listed = [key for key in keys if key in doc["tensors"]]
    return {".".join(unescape(s) for s in key.split("/")[1:]): key for key in listed}


@dataclasses.dataclass
class TensorInfo:
    key: str
    component: str | None
    shape: list[int]
    dtype: str
    bytes: int
    fingerprint: str
    chunks: int


@dataclasses.dataclass
class ComponentInfo:
    name: str
    kind: str
    per_rank: bool
    tensors: int
    bytes: int


def tensors_of(doc: dict[str, Any]) -> list[TensorInfo]:
    """Every saved tensor, sorted by key, with its owning component."""
    owner = tensor_components(doc)
    return [
        TensorInfo(
            key=key,
            component=owner.get(key),
            shape=list(entry["shape"]),
            dtype=entry["dtype"],
            bytes=tensor_nbytes(entry),
            fingerprint=entry.get("fingerprint", ""),
            chunks=len(entry["chunks"]),
        )
        for key, entry in sorted(doc["tensors"].items())
    ]


def components_of(doc: dict[str, Any], tensors: list[TensorInfo]) -> list[ComponentInfo]:
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
