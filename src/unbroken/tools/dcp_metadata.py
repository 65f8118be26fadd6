"""DCP's pickled ``.metadata``, read without running anything a crafted file names.

``torch.distributed.checkpoint`` writes its metadata with ``pickle``, and torch reads it
back with a plain ``pickle.load``, which calls whatever a crafted file tells it to (an
``os.system``, an ``exec``). Here it is read by an unpickler that resolves only the
classes DCP metadata is made of, as torch 2.x writes it (``Metadata``, ``StorageMeta``,
``TensorStorageMetadata``, ``BytesStorageMetadata``, ``ChunkStorageMetadata``,
``TensorProperties`` with its memory-format enum and torch's layout lookup,
``MetadataIndex``, ``_StorageInfo``, ``torch.Size``, torch dtypes, layouts and memory
formats, paths and builtin containers) and refuses any other, naming it. What it reads
is then checked to be DCP metadata: entries of known kinds, chunks within their tensors,
storage in plain files of the folder, tensors no larger than the folder's bytes (so a
crafted size cannot make the import allocate without bound).

``trust_pickle=True`` reads it with plain ``pickle`` instead: it may run code, and is
only for files from a source you trust (a custom planner that stores its own classes).
"""

from __future__ import annotations

import math
import os
import pathlib
import pickle
import re
import stat
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem
from torch.distributed.checkpoint import metadata as md

from ..errors import CorruptCheckpointError
from ..storage.locate import location

MAX_METADATA_BYTES = 256 << 20
_FILE = re.compile(r"^[A-Za-z0-9_.-]{1,255}$")
_CLASSES: dict[tuple[str, str], Any] = {
    **{
        (md.__name__, c.__name__): c
        for c in (
            md.Metadata,
            md.StorageMeta,
            md.TensorStorageMetadata,
            md.BytesStorageMetadata,
            md.ChunkStorageMetadata,
            md.TensorProperties,
            md.MetadataIndex,
            md._MEM_FORMAT_ENCODING,
        )
    },
    (filesystem.__name__, "_StorageInfo"): filesystem._StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    **{
        ("pathlib", c.__name__): c
        for c in (
            pathlib.Path,
            pathlib.PosixPath,
            pathlib.WindowsPath,
            pathlib.PurePosixPath,
            pathlib.PureWindowsPath,
        )
    },
    ("collections", "OrderedDict"): OrderedDict,
    **{("builtins", c.__name__): c for c in (set, frozenset, tuple, list, dict)},
    **{
        ("torch", n): v
        for n, v in vars(torch).items()
        if isinstance(v, torch.dtype | torch.layout | torch.memory_format)
    },
}
TRUST = (
    "Pass --trust-pickle (trust_pickle=True) only if you trust where it came from: it "
    "reads with plain pickle, which can run code"
)


class _Refused(pickle.UnpicklingError):
    def __init__(self, module: str, name: str) -> None:
        super().__init__(f"{module}.{name}")
        self.what = f"{module}.{name}"


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the classes of DCP metadata, from a fixed table (nothing imported)."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _CLASSES[(module, name)]
        except KeyError:
            raise _Refused(module, name) from None

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("DCP metadata holds no persistent references")


def read(folder: Path, *, trust_pickle: bool = False) -> md.Metadata:
    """Read and check ``folder/.metadata``.

    Raises:
        CorruptCheckpointError: the file names a class DCP metadata never holds (a
            possible payload: nothing it names was called), cannot be unpickled, or is
            not sane DCP metadata; the message names the file.
    """
    path = folder / ".metadata"
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_METADATA_BYTES:
        raise CorruptCheckpointError(f"{path} is not a plain file of at most 256 MiB")
    try:
        with open(path, "rb") as f:
            found = pickle.load(f) if trust_pickle else _MetadataUnpickler(f).load()
    except _Refused as exc:
        raise CorruptCheckpointError(
            f"{path} refers to {exc.what}, which DCP metadata never holds: it may be a "
            f"payload that runs code when unpickled, and nothing was loaded. {TRUST}"
        ) from None
    except Exception as exc:  # a damaged pickle fails in any number of ways
        raise CorruptCheckpointError(
            f"{path} cannot be read as DCP metadata ({type(exc).__name__}: {exc})"
        ) from None
    try:
        _check(found, folder)
    except _NotMetadata as exc:
        raise CorruptCheckpointError(f"{path} is not DCP metadata: {exc}") from None
    return found


class _NotMetadata(Exception):
    pass


def _require(ok: bool, why: str) -> None:
    if not ok:
        raise _NotMetadata(why)


def _sizes(x: Any, what: str) -> torch.Size:
    _require(isinstance(x, torch.Size) and all(n >= 0 for n in x), f"{what} is {x!r}")
    return x


def _check(found: Any, folder: Path) -> None:
    _require(isinstance(found, md.Metadata), f"it holds a {type(found).__name__}")
    entries = found.state_dict_metadata
    _require(isinstance(entries, dict), "state_dict_metadata is not a dict")
    total = 0
    for key, meta in entries.items():
        _require(isinstance(key, str), f"entry {key!r} is not named by a string")
        if isinstance(meta, md.BytesStorageMetadata):
            continue
        _require(isinstance(meta, md.TensorStorageMetadata), f"{key!r} is a {type(meta)}")
        props = meta.properties
        dtype = props.dtype if isinstance(props, md.TensorProperties) else None
        _require(isinstance(dtype, torch.dtype), f"{key!r} has no dtype")
        size = _sizes(meta.size, f"the size of {key!r}")
        _require(isinstance(meta.chunks, list), f"the chunks of {key!r} are not a list")
        for c in meta.chunks:
            _require(isinstance(c, md.ChunkStorageMetadata), f"a chunk of {key!r} is {c!r}")
            offsets, sizes = _sizes(c.offsets, "an offset"), _sizes(c.sizes, "a chunk size")
            _require(
                len(offsets) == len(sizes) == len(size)
                and all(o + s <= n for o, s, n in zip(offsets, sizes, size, strict=True)),
                f"a chunk of {key!r} lies outside its size {tuple(size)}",
            )
        total += math.prod(size) * torch.empty(0, dtype=dtype).element_size()
    planned = found.planner_data
    _require(planned is None or isinstance(planned, dict), "planner_data is not a dict")
    for key, where in (planned or {}).items():
        _require(
            isinstance(where, tuple | list) and all(isinstance(p, str | int) for p in where),
            f"planner_data of {key!r} is {where!r}",
        )
    storage = found.storage_data
    _require(isinstance(storage, dict), "storage_data is not a dict")
    for index, info in storage.items():
        _require(isinstance(index, md.MetadataIndex), f"a storage key is {index!r}")
        _require(isinstance(info, filesystem._StorageInfo), f"storage of {index.fqn!r}")
        name = info.relative_path
        _require(
            isinstance(name, str) and bool(_FILE.match(name)) and name not in (".", ".."),
            f"{index.fqn!r} is stored at {name!r}, which is not a file of the folder",
        )
        _require(
            all(isinstance(n, int) and n >= 0 for n in (info.offset, info.length)),
            f"{index.fqn!r} has storage offset {info.offset!r}, length {info.length!r}",
        )
    held = sum(f.held for f in location(folder).plain_files().values())
    compressed = any(getattr(i, "transform_descriptors", None) for i in storage.values())
    _require(
        total <= held * (64 if compressed else 1),
        f"its tensors take {total} bytes, more than the folder's files hold ({held})",
    )


class SafeReader(dcp.FileSystemReader):
    """torch's file-system reader, with the metadata already read by :func:`read`
    (``dcp.load`` asks the reader for it again: never with plain pickle)."""

    def __init__(self, folder: Path, metadata: md.Metadata) -> None:
        super().__init__(str(folder))
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> md.Metadata:
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = md.StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata
