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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .._version import __version__
from ..errors import CheckpointError, IncompleteCheckpointError, StateMismatchError
from ..format import fingerprint, manifest, tree
from ..format.manifest import DTYPES
from ..format.shards import tensor_bytes
from ..format.tensor_reader import TensorReader
from ..storage.locate import location
from .inspection import model_fqns
from .tying import confirm, tied_weights

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.complex64: "C64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint64: "U64", torch.uint32: "U32", torch.uint16: "U16", torch.uint8: "U8",
    torch.bool: "BOOL",
}  # fmt: skip
EXPORT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_CASTABLE = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


@dataclasses.dataclass
class ExportResult:
    path: str
    step: int
    tensors: int
    bytes: int
    metadata: dict[str, str]
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


def export_safetensors(
    folder: str | Path,
    to: str | Path,
    *,
    dtype: torch.dtype | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> ExportResult:
    """Write the model weights of the checkpoint in ``folder`` to ``to`` (safetensors).

    Keys are the model's FQNs (``<name>.<fqn>`` for a dict of models); floating-point
    tensors are cast to ``dtype`` if given; a tied weight is written once. Metadata:
    ``step``, ``source``, ``unbroken_version``, ``world_size``, ``format`` (``pt``), and
    ``tied_weights`` (JSON ``{alias: name written}``) if any weight is tied.

    Raises:
        CorruptCheckpointError: a chunk fails its checksum or a tensor its fingerprint.
        IncompleteCheckpointError: the checkpoint has no model.
        CheckpointError: ``to`` lies inside the checkpoint folder.
    """
    folder, to = location(folder), Path(to)
    if isinstance(folder, Path) and to.resolve().is_relative_to(folder.resolve()):
        raise CheckpointError(f"refusing to write {to} inside the checkpoint folder {folder}")
    doc = manifest.read(folder)
    manifest.require_known_fingerprints(folder, doc)
    algorithm = manifest.fingerprint_algorithm(doc)
    if "model" not in doc["components"]:
        raise IncompleteCheckpointError("the checkpoint has no 'model' component to export")
    ties = tied_weights(doc)
    if ties:  # confirmed on the bytes: equal values alone do not make a tie
        with TensorReader(folder, doc) as reader:
            ties = confirm(doc, ties, reader.read)
    items = plan(doc, dtype, leave_out=frozenset(ties))
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
            for _name, key, target in items:
                t = reader.read(key)
                if fingerprint.fingerprint(t, algorithm) != doc["tensors"][key].get("fingerprint"):
                    raise StateMismatchError(
                        f"{key}: its stored value does not match the manifest's fingerprint; "
                        f"run `unbroken verify {folder}`"
                    )
                f.write(tensor_bytes(t.to(target)))
                del t
            if on_bytes is not None:  # aliases are not read: count them as done
                fqns = model_fqns(doc)
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


def _non_tensor_model_state(doc: dict[str, Any]) -> list[str]:
    """Model state entries that are not tensors (safetensors holds only tensors)."""
    skeleton = doc["components"]["model"].get("state")
    found: list[str] = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict) and "__ub__" not in node:
            for k, v in node.items():
                walk(v, f"{path}.{k}" if path else k)
        elif not tree.tensor_keys(node):
            found.append(path)

    walk(skeleton, "")
    return found
