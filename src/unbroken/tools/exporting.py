"""Export a checkpoint's model weights as one consolidated ``.safetensors`` file.

``safetensors.torch.save_file`` needs every tensor in memory at once. The format is
simple (an 8-byte little-endian header length, a JSON header giving each tensor's dtype,
shape and byte range, then the raw bytes), and every byte range follows from the
manifest's shapes and dtypes alone, so we write the header first and then stream one
tensor at a time: peak memory is the largest tensor (plus its cast copy), whatever the
model size. The file is written beside the target and renamed into place when complete.
Each tensor's checksums and fingerprint are verified before it is written.

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
import struct
import uuid
from pathlib import Path
from typing import Any

import torch

from .._version import __version__
from ..errors import CheckpointError, IncompleteCheckpointError, StateMismatchError
from ..format import fingerprint, manifest, tree
from ..format.manifest import DTYPES
from ..format.shards import tensor_bytes
from ..format.tensor_reader import TensorReader
from ..storage.interface import Location
from ..storage.locate import checkpoint_dir
from ..storage.names import folder_step
from .contents import model_fqns
from .folders import locate
from .reporting import JsonResult, Progress, ProgressCount
from .tying import confirm, tied_weights

SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint64: "U64",
    torch.uint32: "U32",
    torch.uint16: "U16",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
EXPORT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_CASTABLE = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


@dataclasses.dataclass
class ExportResult(JsonResult):
    """What :func:`export_checkpoint` returns (``unbroken export --json``)."""

    path: str  # the .safetensors file written
    step: int  # the checkpoint's step
    tensors: int  # tensors written (a tied weight once)
    bytes: int  # of tensor data written (the file adds its header)
    metadata: dict[str, str]  # the file's ``__metadata__``: format, step, source,
    # unbroken_version, world_size, and tied_weights (JSON) if a weight is tied
    skipped: list[str]  # model state entries that are not tensors
    tied: dict[str, str] = dataclasses.field(default_factory=dict)  # alias -> name written


def _target_dtype(saved: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """Floating-point weights take ``dtype``; integer and bool buffers keep theirs."""
    return dtype if dtype is not None and saved in _CASTABLE else saved


def plan(
    doc: dict[str, Any], dtype: torch.dtype | None, *, leave_out: frozenset[str] = frozenset()
) -> list[tuple[str, str, torch.dtype]]:
    """(safetensors name, manifest key, output dtype) for every model tensor written
    (all but the FQNs in ``leave_out``: aliases of tied weights)."""
    if "model" not in doc["components"]:
        raise IncompleteCheckpointError("the checkpoint has no 'model' component to export")
    out = []
    for name, key in sorted(model_fqns(doc).items()):
        if name in leave_out:
            continue
        target = _target_dtype(DTYPES[doc["tensors"][key]["dtype"]], dtype)
        if target not in SAFETENSORS_DTYPES:
            raise StateMismatchError(f"{name}: dtype {target} cannot be stored in safetensors")
        out.append((name, key, target))
    return out


def header(
    doc: dict[str, Any], items: list[tuple[str, str, torch.dtype]], metadata: dict[str, str]
) -> tuple[bytes, int]:
    """The encoded header (length prefix included) and the size of the data section."""
    head: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, key, dtype in items:
        shape = doc["tensors"][key]["shape"]
        numel = 1
        for s in shape:
            numel *= s
        size = numel * torch.empty(0, dtype=dtype).element_size()
        head[name] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": shape,
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data section starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text, offset


def export_checkpoint(
    path: str | os.PathLike,
    to: str | os.PathLike,
    *,
    dtype: torch.dtype | str | None = None,
    step: int | None = None,
    progress: Progress | None = None,
) -> ExportResult:
    """Write a checkpoint's model weights as one ``.safetensors`` file (``unbroken export``).

    Keys are the model's FQNs (``<name>.<fqn>`` for a dict of models); shards of any
    world size are assembled into whole tensors; a tied weight is written once. Memory
    stays bounded by the largest tensor: each is read, verified (checksums and
    fingerprint) and written in turn. The file appears only when complete. Its metadata:
    ``format`` (``pt``), ``step``, ``source``, ``unbroken_version``, ``world_size``, and
    ``tied_weights`` (JSON ``{alias: name written}``) if any weight is tied.

    Args:
        path: a run folder (its latest step unless ``step``) or a step folder (or URL).
        to: the file to write (local).
        dtype: cast floating-point tensors to this (a floating-point torch dtype, or
            ``"bf16"``, ``"fp16"``, ``"fp32"``); integer and bool buffers keep theirs.
        step: a committed step of the run folder.
        progress: called with (bytes read, bytes to read) as tensors are read.

    Returns:
        :class:`ExportResult`.

    Raises:
        ValueError: ``dtype`` is not a floating-point dtype or one of the names.
        CheckpointNotFoundError: ``path`` holds no committed checkpoint, or no ``step``.
        CorruptCheckpointError: a chunk fails its checksum.
        StateMismatchError: a tensor fails its fingerprint, or a dtype safetensors
            cannot hold.
        IncompleteCheckpointError: the checkpoint has no model.
        CheckpointError: ``to`` lies inside the run folder (the folder holding the step
            folders; the step folder itself if it is not in one), links resolved.

    Example::

        ub.export_checkpoint("ckpts/run1", "model.safetensors", dtype="bf16")
    """
    target = _export_dtype(dtype)
    folder, to = locate(path, step), Path(to)
    _refuse_inside(_run_folder(folder), to)
    doc = manifest.read(folder)
    manifest.require_known_fingerprints(folder, doc)
    algorithm = manifest.fingerprint_algorithm(doc)
    if "model" not in doc["components"]:
        raise IncompleteCheckpointError("the checkpoint has no 'model' component to export")
    fqns = model_fqns(doc)
    on_bytes = ProgressCount(
        progress, sum(c["length"] for key in fqns.values() for c in doc["tensors"][key]["chunks"])
    )
    ties = tied_weights(doc)
    if ties:  # confirmed on the bytes: equal values alone do not make a tie
        with TensorReader(folder, doc) as reader:
            ties = confirm(doc, ties, reader.read)
    items = plan(doc, target, leave_out=frozenset(ties))
    metadata = {
        "format": "pt",
        "step": str(doc["step"]),
        "source": str(folder.resolve()),
        "unbroken_version": __version__,
        "world_size": str(doc["world_size"]),
    }
    if ties:
        metadata["tied_weights"] = json.dumps(ties, sort_keys=True)
    head, data_size = header(doc, items, metadata)
    partial = to.with_name(f".{to.name}.partial-{uuid.uuid4().hex[:8]}")
    to.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(partial, "wb") as f, TensorReader(folder, doc, on_bytes=on_bytes) as reader:
            f.write(head)
            for _name, key, written_as in items:
                t = reader.read(key)
                if fingerprint.fingerprint(t, algorithm) != doc["tensors"][key].get("fingerprint"):
                    raise StateMismatchError(
                        f"{key}: its stored value does not match the manifest's fingerprint; "
                        f"run `unbroken verify {folder}`"
                    )
                f.write(tensor_bytes(t.to(written_as)))
                del t
            # Aliases are not read: counted as done.
            on_bytes(sum(c["length"] for a in ties for c in doc["tensors"][fqns[a]]["chunks"]))
            f.flush()
            os.fsync(f.fileno())
        if partial.stat().st_size != len(head) + data_size:
            raise CheckpointError(f"internal error: {to} came out at the wrong size")
        os.replace(partial, to)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    skipped = _non_tensor_model_state(doc)
    return ExportResult(str(to), doc["step"], len(items), data_size, metadata, skipped, ties)


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
