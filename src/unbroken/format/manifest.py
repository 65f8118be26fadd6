"""The JSON manifest: the commit record of one checkpoint.

It describes everything needed to restore without unpickling anything: every tensor's
key, shape, dtype, device, fingerprint and chunk locations; every file's size and
checksum; each component's non-tensor state as JSON; the lineage of resumes and resets;
the probe value and recent tracked metrics. ``manifest_checksum`` covers the rest of it.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

import torch
import xxhash

from ..errors import CheckpointError, CorruptCheckpointError
from . import files, layout
from .storage import folder_step, step_dir_name

FORMAT = "unbroken-checkpoint"
FORMAT_VERSION = 1
MAX_MANIFEST_BYTES = 512 * 1024 * 1024
_SAFE_FILE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64, torch.complex128,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
        torch.uint16, torch.uint32, torch.uint64,
    )
}  # fmt: skip


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise TypeError(f"tensors of dtype {dtype} cannot be checkpointed yet")
    return name


def _digest(body: dict[str, Any]) -> str:
    # Sorted throughout, as every version computed it: readers of any version agree on a
    # manifest's checksum. (It does not cover the member order of state skeletons.)
    data = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return xxhash.xxh3_128_hexdigest(data.encode())


def write(directory: Path, body: dict[str, Any]) -> None:
    """Write ``manifest.json`` (with its own checksum) and fsync it."""
    doc = dict(body, format=FORMAT, format_version=FORMAT_VERSION)
    doc["manifest_checksum"] = _digest(doc)
    path = directory / "manifest.json"
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_layout(doc), f, indent=1, allow_nan=False)
        f.flush()
        os.fsync(f.fileno())


def _layout(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with every object's keys sorted, as earlier versions wrote it, except inside
    components' state skeletons: there the member order is the order of the state's
    keys, which a restore gives back."""
    out = _sorted({k: v for k, v in doc.items() if k != "components"})
    out["components"] = {n: _component(doc["components"][n]) for n in sorted(doc["components"])}
    return {k: out[k] for k in sorted(out)}


def _component(entry: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for field in sorted(entry):
        if field == "state":
            out[field] = entry[field]
        elif field == "ranks":
            out[field] = {r: entry[field][r] for r in sorted(entry[field])}
        else:
            out[field] = _sorted(entry[field])
    return out


def _sorted(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _sorted(node[k]) for k in sorted(node)}
    if isinstance(node, list):
        return [_sorted(v) for v in node]
    return node


def read(directory: Path) -> dict[str, Any]:
    """Read and validate a manifest.

    Raises:
        CorruptCheckpointError: missing, a symbolic link, oversized, unparsable,
            altered, of an unknown format, or describing unsafe files or impossible
            tensors.
    """
    path = directory / "manifest.json"
    files.refuse_links(directory)
    if path.is_symlink():
        raise CorruptCheckpointError(f"{path} is a symbolic link; checkpoints never are")
    try:
        size = path.stat().st_size
        if size > MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError(f"{path} is {size} bytes, larger than any manifest")
        with open(path, encoding="utf-8") as f:
            doc = json.load(f, parse_constant=_refuse_constant)
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"{path} is missing: {directory} is not a committed checkpoint (a step folder "
            "whose manifest was lost or deleted is damaged and never restored)"
        ) from None
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{path} is not valid JSON ({exc}); it is damaged") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CorruptCheckpointError(f"{path} is not an unbroken manifest")
    version = doc.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CorruptCheckpointError(
            f"{path} has format_version {version!r}; this unbroken reads up to "
            f"{FORMAT_VERSION}: upgrade unbroken"
        )
    claimed = doc.pop("manifest_checksum", None)
    if claimed != _digest(doc):
        raise CorruptCheckpointError(f"{path} fails its checksum: the manifest was altered")
    _validate(path, doc)
    named = folder_step(directory)
    if named is not None and named != doc["step"]:
        raise CorruptCheckpointError(
            f"{directory} is named for step {named} but holds the checkpoint of step "
            f"{doc['step']}: step folders were renamed, swapped or copied. Rename it to "
            f"{step_dir_name(doc['step'])} if that is where it belongs, or use another step"
        )
    return doc


def require_native_byteorder(directory: Path, doc: dict[str, Any]) -> None:
    """Raise unless the checkpoint's tensor bytes are in this machine's byte order."""
    order = doc.get("byteorder", "little")
    if order != sys.byteorder:
        raise CheckpointError(
            f"{directory} holds {order}-endian tensor bytes (written on a {order}-endian "
            f"machine); this machine is {sys.byteorder}-endian and cannot read them as "
            "they are: restore it on a machine of that byte order"
        )


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _validate(path: Path, doc: dict[str, Any]) -> None:
    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{path}: {why}")

    for field, kind in (("step", int), ("world_size", int), ("tensors", dict), ("files", dict),
                        ("components", dict), ("lineage", list)):  # fmt: skip
        if not isinstance(doc.get(field), kind):
            raise bad(f"field {field!r} is missing or not a {kind.__name__}")
    if doc["step"] < 0 or doc["world_size"] < 1:
        raise bad("step or world_size out of range")
    files = doc["files"]
    for name, rec in files.items():
        if not _SAFE_FILE.match(name) or name in (".", "..") or name == "manifest.json":
            raise bad(f"unsafe file name {name!r}")
        if not isinstance(rec, dict) or not _nonneg_int(rec.get("size")):
            raise bad(f"file record of {name!r} is malformed")
    for key, entry in doc["tensors"].items():
        _validate_tensor(key, entry, files, bad)


def _nonneg_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _validate_tensor(key: str, entry: Any, files: dict, bad) -> None:
    if not isinstance(entry, dict) or entry.get("dtype") not in DTYPES:
        raise bad(f"tensor {key!r}: unknown dtype")
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(_nonneg_int(s) for s in shape):
        raise bad(f"tensor {key!r}: malformed shape {shape!r}")
    itemsize = torch.empty(0, dtype=DTYPES[entry["dtype"]]).element_size()
    covered = 0
    for c in entry.get("chunks", []):
        offsets, sizes = c.get("offsets"), c.get("sizes")
        if not (isinstance(offsets, list) and isinstance(sizes, list)) or not (
            len(offsets) == len(sizes) == len(shape)
        ):
            raise bad(f"tensor {key!r}: malformed chunk")
        if not all(_nonneg_int(v) for v in offsets + sizes) or any(
            o + s > dim for o, s, dim in zip(offsets, sizes, shape, strict=True)
        ):
            raise bad(f"tensor {key!r}: a chunk lies outside shape {shape}")
        length = math.prod(sizes) * itemsize
        rec = files.get(c.get("file"))
        if rec is None:
            raise bad(f"tensor {key!r}: chunk in unlisted file {c.get('file')!r}")
        if c.get("length") != length or not _nonneg_int(c.get("offset")):
            raise bad(f"tensor {key!r}: chunk length does not match its shape")
        if c["offset"] + length > rec["size"]:
            raise bad(f"tensor {key!r}: chunk lies beyond the end of {c['file']}")
        covered += math.prod(sizes)
    if covered != math.prod(shape):
        raise bad(f"tensor {key!r}: chunks cover {covered} of {math.prod(shape)} elements")
    if "stride" in entry and not layout.valid_stride(shape, entry["stride"]):
        raise bad(f"tensor {key!r}: stride {entry['stride']!r} does not lay out shape {shape}")
