"""Export a checkpoint's model weights for other tools: one consolidated ``.safetensors``
file, a Hugging Face model folder, or a PEFT adapter folder (``hf_export.py``).

``safetensors.torch.save_file`` needs every tensor in memory at once. Every byte range
of a safetensors file follows from the manifest's shapes and dtypes alone, so the header
is written first and then one tensor at a time (``safetensors_files.py``): peak memory
is the largest tensor (plus its cast copy), whatever the model size. Each tensor's
checksums and fingerprint are verified before it is written (``export_source.py``).
The file (or folder) is written beside the target and renamed into place when complete.

A tied weight (``lm_head.weight`` that *is* ``wte.weight``) is written once, as Hugging
Face's ``save_pretrained`` does: under the name ``named_parameters()`` gives it (the
first one module traversal meets, usually the embedding), the other name recorded in the
metadata (``tied_weights``: JSON ``{alias: name written}``). ``safetensors.torch.
load_model(model, file)`` and ``from_pretrained`` accept such a file for the tied model;
``load_state_dict(..., strict=False)`` reports the alias as the only missing key, and it
needs no value: it is the same parameter. See ``tying.py`` for how ties are found.
"""

from __future__ import annotations

import dataclasses
import json
import os
import uuid
from pathlib import Path
from typing import Any

import torch

from .._version import __version__
from ..errors import CheckpointError
from ..format import tree
from ..storage.interface import Location
from ..storage.locate import checkpoint_dir
from ..storage.names import folder_step
from . import hf_export
from .export_source import ExportSource
from .reporting import JsonResult, Progress
from .safetensors_files import write_file

EXPORT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FORMATS = ("safetensors", "hf", "peft")


@dataclasses.dataclass
class ExportResult(JsonResult):
    """What :func:`export_checkpoint` returns (``unbroken export --json``)."""

    path: str  # the .safetensors file written (format "safetensors"), or the folder
    step: int  # the checkpoint's step
    tensors: int  # tensors written (a tied weight once)
    bytes: int  # of tensor data written (the files add their headers)
    metadata: dict[str, str]  # each model file's ``__metadata__``: format, step, source,
    # unbroken_version, world_size, and tied_weights (JSON) if a weight is tied
    skipped: list[str]  # model state entries that are not tensors
    tied: dict[str, str] = dataclasses.field(default_factory=dict)  # alias -> name written
    format: str = "safetensors"  # "safetensors" | "hf" | "peft"
    files: list[str] = dataclasses.field(default_factory=list)  # names written in ``path``
    # (format "hf" or "peft"; the file itself for "safetensors")
    from_base: list[str] = dataclasses.field(default_factory=list)  # frozen tensors taken
    # from ``base`` (a checkpoint saved with frozen="verify"), checked by fingerprint


def export_checkpoint(
    path: str | os.PathLike,
    to: str | os.PathLike,
    *,
    format: str = "safetensors",
    max_shard_size: int | str = hf_export.DEFAULT_SHARD_SIZE,
    dtype: torch.dtype | str | None = None,
    step: int | None = None,
    config: str | os.PathLike | None = None,
    base: str | os.PathLike | None = None,
    adapter: str = "default",
    progress: Progress | None = None,
) -> ExportResult:
    """Write a checkpoint's model weights for other tools (``unbroken export``).

    ``format="safetensors"``: one ``.safetensors`` file. ``"hf"``: a folder that
    ``transformers`` loads (``from_pretrained``): shards split at ``max_shard_size``,
    ``model.safetensors.index.json`` when there are several, ``config.json`` copied from
    ``config``. ``"peft"``: a PEFT LoRA adapter folder (``adapter_model.safetensors``,
    ``adapter_config.json``) that ``PeftModel.from_pretrained`` loads.

    Keys are the model's FQNs (``<name>.<fqn>`` for a dict of models; PEFT's own names
    for ``"peft"``); shards of any world size are assembled into whole tensors; a tied
    weight is written once. Memory stays bounded by the largest tensor: each is read,
    verified (checksums and fingerprint) and written in turn. Nothing appears at ``to``
    until all of it is written (a partial file or folder beside it, renamed at the end,
    removed on failure). Model files' metadata: ``format`` (``pt``), ``step``,
    ``source``, ``unbroken_version``, ``world_size``, and ``tied_weights`` (JSON
    ``{alias: name written}``) if any weight is tied.

    Args:
        path: a run folder (its latest step unless ``step``) or a step folder (or URL).
        to: the file (``"safetensors"``) or the folder to write (local); a folder must
            not exist or be empty.
        format: ``"safetensors"``, ``"hf"`` or ``"peft"``.
        max_shard_size: ``"hf"``: bytes per shard at most (a tensor larger than that
            gets a shard of its own), an int or a string like ``"5GB"``, ``"500MB"``;
            transformers' default, ``"50GB"``.
        dtype: cast floating-point tensors to this (a floating-point torch dtype, or
            ``"bf16"``, ``"fp16"``, ``"fp32"``); integer and bool buffers keep theirs.
        step: a committed step of the run folder.
        config: ``"hf"``: a ``config.json`` (or a folder holding one) copied beside the
            weights. ``"peft"``: an ``adapter_config.json`` (or its folder); default: the
            config the checkpoint's manifest records for ``adapter``.
        base: a checkpoint saved with ``frozen="verify"`` stores no frozen parameter;
            ``"safetensors"`` and ``"hf"`` read them from this base model (an HF folder,
            a ``.safetensors`` file, or a folder of them), each checked against the
            fingerprint recorded at save. ``"peft"`` never needs it.
        adapter: ``"peft"``: the adapter to export.
        progress: called with (bytes read, bytes to read) as tensors are read.

    Returns:
        :class:`ExportResult`.

    Raises:
        ValueError: an unknown ``format``, a ``dtype`` that is not a floating-point
            dtype or one of the names, a malformed ``max_shard_size`` or ``config``.
        CheckpointNotFoundError: ``path`` holds no committed checkpoint, or no ``step``.
        CorruptCheckpointError: a chunk fails its checksum; a base file is damaged.
        StateMismatchError: a tensor fails its fingerprint (from the base: the base
            differs from the one the run was saved with), a dtype safetensors cannot
            hold, or an adapter that cannot be exported.
        IncompleteCheckpointError: the checkpoint has no model; frozen parameters are
            not stored and no ``base`` was given; no config for the adapter.
        CheckpointError: ``to`` lies inside the run folder (the folder holding the step
            folders; the step folder itself if it is not in one), links resolved; or a
            destination folder that exists and is not empty.

    Example::

        ub.export_checkpoint("ckpts/run1", "model.safetensors", dtype="bf16")
        ub.export_checkpoint("ckpts/run1", "hf_out", format="hf", config="base/config.json")
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    target = _export_dtype(dtype)
    shard_size = hf_export.parse_shard_size(max_shard_size)
    to = Path(to)
    config_path = Path(config) if config is not None else None
    if config_path is not None and not config_path.exists():
        raise ValueError(f"config {config_path} does not exist")
    with ExportSource(path, step, base=base, needs_frozen=format != "peft") as source:
        _refuse_inside(_run_folder(source.folder), to)
        metadata = _metadata(source)
        if format == "safetensors":
            files, count, size = _write_single(source, to, target, metadata, progress)
        else:
            options = hf_export.FolderOptions(
                dtype=target,
                max_shard_size=shard_size,
                config=config_path,
                adapter=adapter,
                metadata=metadata,
                progress=progress,
            )
            write = (
                hf_export.write_model_folder if format == "hf" else hf_export.write_adapter_folder
            )
            with hf_export.partial_folder(to) as folder:
                files, count, size = write(source, folder, options)
        skipped = _non_tensor_model_state(source.doc)
        return ExportResult(
            str(to),
            source.doc["step"],
            count,
            size,
            metadata,
            skipped,
            source.ties if format != "peft" else {},
            format,
            files,
            sorted(source.frozen) if format != "peft" else [],
        )


def _metadata(source: ExportSource) -> dict[str, str]:
    doc = source.doc
    metadata = {
        "format": "pt",
        "step": str(doc["step"]),
        "source": str(source.folder.resolve())
        if isinstance(source.folder, Path)
        else str(source.folder),
        "unbroken_version": __version__,
        "world_size": str(doc["world_size"]),
    }
    if source.ties:
        metadata["tied_weights"] = json.dumps(source.ties, sort_keys=True)
    return metadata


def _write_single(
    source: ExportSource,
    to: Path,
    dtype: torch.dtype | None,
    metadata: dict[str, str],
    progress: Progress | None,
) -> tuple[list[str], int, int]:
    """One ``.safetensors`` file, written beside ``to`` and renamed into place."""
    fqns = source.model_tensors()
    entries = [source.entry(fqn, fqn, dtype) for fqn in fqns]
    source.count_progress(progress, fqns)
    partial = to.with_name(f".{to.name}.partial-{uuid.uuid4().hex[:8]}")
    to.parent.mkdir(parents=True, exist_ok=True)
    try:
        size = write_file(partial, entries, metadata, lambda e: source.read(e.name))
        os.replace(partial, to)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return [to.name], len(entries), size


def _run_folder(folder: Location) -> Path | None:
    """The local folder no export may write into: the run folder holding the step folder
    exported (its other steps, its metrics and lock too), or the step folder itself if
    it is not one of a run's. None for a store (a URL source holds no local file)."""
    if not isinstance(folder, Path):
        return None
    parent = folder.parent
    if folder_step(folder) is not None and checkpoint_dir(parent).steps():
        return Path(parent)
    return Path(folder)


def _refuse_inside(root: Path | None, to: Path) -> None:
    if root is None:
        return
    root, where = root.resolve(), to.resolve()  # links followed on both sides
    if where.is_relative_to(root):
        raise CheckpointError(
            f"refusing to write {to}: it is inside the checkpoint run folder {root} "
            f"(resolved: {where}), and a file written there could damage its committed "
            f"checkpoints; write the export outside it, e.g. to {root.parent / to.name}"
        )


def _export_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if isinstance(dtype, str) and dtype in EXPORT_DTYPES:
        return EXPORT_DTYPES[dtype]
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        return dtype
    raise ValueError(
        f"dtype must be a floating-point torch dtype or one of {', '.join(EXPORT_DTYPES)}, "
        f"got {dtype!r}"
    )


def _non_tensor_model_state(doc: dict[str, Any]) -> list[str]:
    """Model state entries that are not tensors (safetensors holds only tensors)."""
    skeleton = doc["components"]["model"].get("state")
    found: list[str] = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict) and tree.TAG not in node:
            for k, v in node.items():
                walk(v, f"{path}.{k}" if path else k)
        elif not tree.tensor_keys(node):
            found.append(path)

    walk(skeleton, "")
    return found
