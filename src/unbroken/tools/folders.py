"""Which committed step folders a path means: a run folder (its latest step, or a given
one, or all of them) or one step folder, local or an fsspec URL.

Errors name what was found instead and what to pass: a file, a save in progress, a step
folder that lost its manifest (damaged), a folder with no checkpoint, a missing step.
"""

from __future__ import annotations

import os

from ..errors import CheckpointNotFoundError, CorruptCheckpointError
from ..storage.interface import CheckpointDir, Location
from ..storage.locate import checkpoint_dir, location
from ..storage.names import MANIFEST, folder_step


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
    copies = ckdir.step_copies()
    steps, lost = sorted(copies), ckdir.steps_without_manifest()
    if not steps:
        runs = _local_tier_runs(path, ckdir)
        if runs:
            raise CheckpointNotFoundError(
                f"{path} is a local tier folder (LocalTier's path): the local steps are in "
                f"its jobs' folders, {', '.join(str(path / r) for r in runs)}; pass one of "
                "those"
            )
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
    return ckdir.root / copies[step][0]


def _local_tier_runs(path: Location, ckdir: CheckpointDir) -> list[str]:
    """The job folders of a local tier folder (one that holds ``.in-use``), else []."""
    names = ckdir.listdir()
    if ".in-use" not in names:
        return []
    return sorted(n for n in names if not n.startswith(".") and checkpoint_dir(path / n).steps())


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
    folders = {s: ckdir.root / name for s, (name, _) in ckdir.step_copies().items()}
    for s in ckdir.steps_without_manifest() if damaged else []:
        folders.setdefault(s, ckdir.step_path(s))
    return [folders[s] for s in sorted(folders)]
