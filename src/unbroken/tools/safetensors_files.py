"""The ``.safetensors`` file format, both ways: write one file streaming, read one safely.

The format is simple: an 8-byte little-endian header length, a JSON header giving each
tensor's dtype, shape and byte range (``data_offsets``, relative to the end of the
header), then the raw bytes. Every byte range follows from the shapes and dtypes alone,
so :func:`write_file` writes the header first and then one tensor at a time: peak memory
is the largest tensor (plus its cast copy), whatever the file's size.

Reading, :func:`read_header` parses the header itself and checks it against the file
before anything hands the file to ``safetensors`` (whose own errors name neither the
file nor what to do): every range inside the file, none overlapping, none negative, each
exactly ``numel * itemsize`` bytes, every dtype one safetensors knows. A file that fails
is a :class:`~unbroken.CorruptCheckpointError` naming the file, the tensor and the fix.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError, CorruptCheckpointError
from ..format.shards import tensor_bytes

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
TORCH_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
_HEADER_LIMIT = 100_000_000  # safetensors' own limit on the JSON header


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor of a file: its name there, shape and dtype as written."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        numel = 1
        for s in self.shape:
            numel *= s
        return numel * torch.empty(0, dtype=self.dtype).element_size()


def encode_header(entries: Iterable[Entry], metadata: dict[str, str]) -> tuple[bytes, int]:
    """The encoded header (length prefix included) and the size of the data section."""
    head: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for e in entries:
        head[e.name] = {
            "dtype": SAFETENSORS_DTYPES[e.dtype],
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data section starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text, offset


def write_file(
    path: Path,
    entries: list[Entry],
    metadata: dict[str, str],
    value: Callable[[Entry], torch.Tensor],
) -> int:
    """Write ``entries`` to ``path`` in order, ``value(entry)`` giving each tensor (read,
    and verified, by the caller, one at a time); flushed to disk. Returns the data bytes.

    Raises:
        CheckpointError: a value comes back in another shape than its entry says, or
            the file comes out at the wrong size (an internal error).
    """
    head, data_size = encode_header(entries, metadata)
    with open(path, "wb") as f:
        f.write(head)
        for e in entries:
            t = value(e)
            if tuple(t.shape) != e.shape:
                raise CheckpointError(
                    f"internal error: {e.name} came as {tuple(t.shape)}, planned as {e.shape}"
                )
            f.write(tensor_bytes(t.to(e.dtype)))
            del t
        f.flush()
        os.fsync(f.fileno())
    if path.stat().st_size != len(head) + data_size:
        raise CheckpointError(f"internal error: {path} came out at the wrong size")
    return data_size


@dataclasses.dataclass
class FileHeader:
    """A checked safetensors header: ``tensors`` maps each name to (dtype, shape)."""

    path: Path
    metadata: dict[str, str]
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]


def read_header(path: Path) -> FileHeader:
    """Parse and check ``path``'s header against the file (see the module docstring).

    Raises:
        CorruptCheckpointError: the file is missing, short, or its header is malformed,
            names an unknown dtype, or a byte range that is outside the file, overlaps
            another, or does not fit its shape and dtype.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise _bad(path, f"it is {size} bytes long, too short for a header")
            (length,) = struct.unpack("<Q", prefix)
            if length > min(_HEADER_LIMIT, size - 8):
                raise _bad(path, f"its header claims {length} bytes; the file has {size}")
            raw = f.read(length)
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"{path} is missing: the folder names it but it is not there; copy the "
            "whole folder again"
        ) from None
    except OSError as exc:
        raise CorruptCheckpointError(f"{path} cannot be read: {exc}") from None
    try:
        head = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad(path, f"its header is not JSON ({exc})") from None
    if not isinstance(head, dict):
        raise _bad(path, "its header is not a JSON object")
    metadata = head.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise _bad(path, "its __metadata__ is not an object")
    data_size = size - 8 - length
    tensors, ranges = {}, []
    for name, info in head.items():
        dtype, shape, (begin, end) = _entry(path, name, info)
        if not 0 <= begin <= end <= data_size:
            raise _bad(
                path,
                f"tensor {name!r} claims bytes {begin}..{end} of a data section of "
                f"{data_size} bytes (the file is truncated or its header is wrong)",
            )
        expected = Entry(name, shape, dtype).nbytes
        if end - begin != expected:
            raise _bad(
                path,
                f"tensor {name!r} claims {end - begin} bytes, but {len(shape)}-d shape "
                f"{list(shape)} of {info['dtype']} needs {expected}",
            )
        tensors[name] = (dtype, shape)
        ranges.append((begin, end, name))
    ranges.sort()
    for (_, end, first), (begin, _, second) in itertools.pairwise(ranges):
        if begin < end:
            raise _bad(path, f"tensors {first!r} and {second!r} claim overlapping bytes")
    return FileHeader(path, {str(k): str(v) for k, v in metadata.items()}, tensors)


def load(header: FileHeader, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors ``names`` (default: all) of a file whose header :func:`read_header`
    checked, as CPU tensors."""
    from safetensors import safe_open

    wanted = list(header.tensors) if names is None else list(names)
    try:
        with safe_open(str(header.path), framework="pt", device="cpu") as f:
            return {name: f.get_tensor(name) for name in wanted}
    except Exception as exc:  # checked above: only an I/O failure or a race comes here
        raise CorruptCheckpointError(f"{header.path} cannot be read: {exc}") from None


def _entry(path: Path, name: str, info: Any) -> tuple[torch.dtype, tuple[int, ...], list[int]]:
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise _bad(path, f"tensor {name!r} has no dtype, shape and data_offsets")
    dtype = TORCH_DTYPES.get(info["dtype"])
    if dtype is None:
        raise _bad(
            path,
            f"tensor {name!r} has dtype {info['dtype']!r}, which safetensors does not "
            f"know (known: {', '.join(sorted(TORCH_DTYPES))})",
        )
    shape, offsets = info["shape"], info["data_offsets"]
    if not (isinstance(shape, list) and all(_natural(s) for s in shape)):
        raise _bad(path, f"tensor {name!r} has shape {shape!r}, not a list of sizes >= 0")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_natural, offsets))):
        raise _bad(path, f"tensor {name!r} has data_offsets {offsets!r}, not two offsets >= 0")
    return dtype, tuple(shape), offsets


def _natural(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _bad(path: Path, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{path} is not a sound safetensors file: {what}; it was damaged or written "
        "wrong: copy or export it again"
    )
