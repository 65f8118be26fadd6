"""The JSON manifest: the commit record of one checkpoint.

It describes everything needed to restore without unpickling anything: every tensor's
key, shape, dtype, device, fingerprint and chunk locations; every file's size and
checksum; each component's non-tensor state as JSON; the lineage of resumes and resets;
the probe value and recent tracked metrics. ``manifest_checksum`` covers the rest of it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import platform
import re
import sys
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import xxhash

from ..errors import CheckpointError, CorruptCheckpointError
from ..storage.interface import Location, TooLarge
from ..storage.locate import location
from ..storage.names import MANIFEST, folder_step, step_dir_name
from . import fingerprint, schema
from .schema import ITEMSIZES

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)
# A file that fails its checksum is read again this often before it counts as damage
# (a manifest here, a chunk in ``tensor_reader`` and a restore's ``shard_reader``): a
# disk or store may answer wrong bytes once.
REREADS = 2

FORMAT = "unbroken-checkpoint"
# The newest format this version reads. A checkpoint is written as version 1 unless it
# leaves out frozen parameters (version 2): older readers, which would find them missing,
# refuse it with "upgrade unbroken" instead.
FORMAT_VERSION = 2
MAX_MANIFEST_BYTES = 512 * 1024 * 1024
# Before it is parsed (which takes up to ~26x its size in memory), a manifest's size is
# judged against the checkpoint it describes: a base, a budget per shard file (per-rank
# state lives in the manifest) and per byte those files take on disk (tensor entries).
MANIFEST_BASE = 4 << 20
MANIFEST_PER_FILE = 4 << 20
MANIFEST_PER_BYTE = 64
# The files that justify a manifest's size: rank shards (``rank_00000.bin`` on a disk,
# ``rank_00000-<save>.bin`` on a store); any other object beside them raises nothing.
_SHARD_NAME = re.compile(r"^rank_\d{5}[^/]*\.bin$")


class _TorchDtypes(Mapping[str, "torch.dtype"]):
    """Name -> torch dtype, for every dtype a checkpoint may hold (those of
    ``schema.ITEMSIZES``). torch is imported at the first lookup, not before: reading and
    checking a manifest (``unbroken inspect``'s listing) needs no torch."""

    def __getitem__(self, name: str) -> torch.dtype:
        if name not in ITEMSIZES:
            raise KeyError(name)
        import torch

        return getattr(torch, name)

    def __iter__(self) -> Iterator[str]:
        return iter(ITEMSIZES)

    def __len__(self) -> int:
        return len(ITEMSIZES)


DTYPES: Mapping[str, torch.dtype] = _TorchDtypes()


def dtype_name(dtype: torch.dtype) -> str:
    """The name a manifest records for ``dtype`` (``torch.bfloat16`` -> ``"bfloat16"``).

    Raises:
        TypeError: a dtype no checkpoint can hold yet.
    """
    name = str(dtype).removeprefix("torch.")
    if name not in ITEMSIZES:
        raise TypeError(f"tensors of dtype {dtype} cannot be checkpointed yet")
    return name


def tensor_nbytes(entry: dict[str, Any]) -> int:
    """Bytes of a manifest tensor entry's logical tensor (from its shape and dtype)."""
    return math.prod(entry["shape"]) * ITEMSIZES[entry["dtype"]]


def tensor_entries(
    metadata: Any, prints: Mapping[str, str], info: Mapping[str, Mapping[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Every tensor's manifest entry: its shape, dtype, device, fingerprint and chunks
    (where each piece lies in which file), from the DCP ``metadata`` a save's writer
    produced, the tensors' combined ``prints`` and what was known at capture (``info``:
    device, and the stride where the layout is not row-major)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    tensors = {}
    for key, tmd in metadata.state_dict_metadata.items():
        chunks = []
        for c in tmd.chunks:
            where = metadata.storage_data[MetadataIndex(key, c.offsets)]
            chunks.append(
                {"offsets": list(c.offsets), "sizes": list(c.sizes), **dataclasses.asdict(where)}
            )
        tensors[key] = {
            "shape": list(tmd.size),
            "dtype": dtype_name(tmd.properties.dtype),
            "device": info[key]["device"],
            "fingerprint": prints[key],
            "chunks": chunks,
        }
        if "stride" in info[key]:
            tensors[key]["stride"] = info[key]["stride"]
    return tensors


def document(
    *,
    step: int,
    world_size: int,
    components: dict[str, Any],
    tensors: dict[str, Any],
    files: dict[str, Any],
    fingerprint_algorithm: str,
    lineage: list[dict[str, Any]],
    metrics: list[dict[str, Any]],
    probes: list[Any] | None,
    warnings: list[str],
    gradients: dict[str, Any] | None = None,
    frozen: dict[str, Any] | None = None,
    peft: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A checkpoint's manifest document, as :func:`encode` seals it and :func:`read`
    checks it (``schema.py`` says what each field may hold). ``gradients``: how many
    parameters held gradients at save and whether they were saved (live/gradients.py),
    left out when none did. ``frozen``: the frozen parameters' records (tensor key ->
    dtype, shape, fingerprint, stored; core/frozen.py), left out when there are none.
    ``peft``: a PEFT model's adapter configurations (live/adapters.py)."""
    import torch

    from .._version import __version__

    return {
        "step": step,
        "created_unix": time.time(),
        "world_size": world_size,
        "versions": {
            "unbroken": __version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "fingerprint_algorithm": fingerprint_algorithm,
        "checksum_algorithm": "xxh3-128",
        "byteorder": sys.byteorder,
        "components": components,
        "tensors": tensors,
        "files": files,
        "lineage": lineage,
        "metrics": metrics,
        "probe": {"ranks": probes} if probes is not None else None,
        **({"save_warnings": warnings} if warnings else {}),
        **({"gradients": gradients} if gradients else {}),
        **({"frozen": frozen} if frozen else {}),
        **({"peft": peft} if peft else {}),
    }


def version_of(body: dict[str, Any]) -> int:
    """The format version a manifest with this body is written as."""
    left_out = any(not r.get("stored") for r in (body.get("frozen") or {}).values())
    return 2 if left_out else 1


def _digest(body: dict[str, Any]) -> str:
    # Sorted throughout, as every version computed it: readers of any version agree on a
    # manifest's checksum. (It does not cover the member order of state skeletons.)
    data = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return xxhash.xxh3_128_hexdigest(data.encode())


def encode(directory: Location | str | os.PathLike, body: dict[str, Any]) -> bytes:
    """The bytes of ``manifest.json`` (with its own checksum) for the checkpoint being
    saved in ``directory``, which ``CheckpointDir.commit`` writes last.

    Raises:
        CheckpointError: the manifest is larger than :func:`read` accepts beside the
            shard files written with it (too much state that is not tensors), or it
            lists a tensor no component references: a checkpoint no restore could read
            is never committed.
    """
    directory = location(directory)
    lost = schema.unreferenced(body)
    if lost:  # a restore would call the checkpoint damaged: never commit it
        raise CheckpointError(
            f"{directory}: the save would list {len(lost)} tensor(s) that no component's "
            f"state references ({', '.join(lost[:5])}): the ranks' state did not merge into "
            "one manifest. Nothing was committed; please report this with how each rank "
            "builds its model and optimizers"
        )
    doc = dict(body, format=FORMAT, format_version=version_of(body))
    doc["manifest_checksum"] = _digest(doc)
    path = directory / MANIFEST
    data = json.dumps(_layout(doc), indent=1, allow_nan=False).encode()
    # Judged as a reader will judge it, by what the files take on the medium; only the
    # files this save wrote count (a store's prefix may hold other saves' objects too).
    count, held, _ = _shard_budget(directory, set(body.get("files", {})))
    if len(data) > _size_limit(count, held):
        tensors = body.get("tensors", {})
        chunks = sum(len(t.get("chunks", [])) for t in tensors.values())
        taken = len(json.dumps(tensors, indent=1).encode())
        if taken > len(data) // 2:  # many tensors, or many ranks each holding pieces
            why = (
                f"its table of {len(tensors)} tensors in {chunks} chunk entries (one per "
                f"piece of a tensor on a rank) takes {taken} bytes: shard each tensor over "
                "fewer ranks (HSDP's shard groups) or save fewer, larger tensors"
            )
        else:
            why = (
                "the state holds too much that is not tensors; return large values as "
                "tensors from state_dict()"
            )
        raise CheckpointError(
            f"{path} would be {len(data)} bytes, more than readers accept beside {count} "
            f"shard file(s) of {held} bytes ({_size_limit(count, held)}): {why}"
        )
    return data


def write(directory: Location | str | os.PathLike, body: dict[str, Any]) -> None:
    """Write ``manifest.json`` into ``directory``, durably (see :func:`encode`): how a
    manifest is sealed outside a save (an edited one, in tests and tools). A save writes
    it through ``CheckpointDir.commit`` instead, last."""
    directory = location(directory)
    data = encode(directory, body)
    with (directory / MANIFEST).create() as out:
        out.write(data)


def _size_limit(count: int, held: int) -> int:
    """The largest manifest read accepts beside ``count`` shard files taking ``held`` bytes."""
    return min(
        MAX_MANIFEST_BYTES, MANIFEST_BASE + MANIFEST_PER_FILE * count + MANIFEST_PER_BYTE * held
    )


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


def _shard_budget(directory: Location, only: set[str] | None = None) -> tuple[int, int, int | None]:
    """(rank shard files, bytes they take on the medium, the manifest's size or None) in
    ``directory``, of the files named ``only`` if given: what a manifest's size is judged
    against before it is read. Only shard-named files count (``_SHARD_NAME``), so a
    padding file or object beside them cannot raise the limit."""
    files = directory.plain_files()
    sizes = [
        f.held
        for name, f in files.items()
        if _SHARD_NAME.match(name) and (only is None or name in only)
    ]
    listed = files.get(MANIFEST)
    return len(sizes), sum(sizes), None if listed is None else listed.size


def read(directory: Location | str | os.PathLike, notes: list[str] | None = None) -> dict[str, Any]:
    """Read and validate a manifest (see :mod:`unbroken.format.schema`).

    Bytes that fail to parse or fail the checksum are read again (``REREADS`` times)
    before they count as damage: a disk or store may answer wrong bytes once. A manifest
    sound on a re-read is logged, and noted in ``notes`` when given.

    Raises:
        CorruptCheckpointError: missing, a symbolic link, larger than its checkpoint can
            need, unparsable, altered, of an unknown format, or failing the schema
            (unsafe files, impossible tensors, malformed fields).
    """
    directory = location(directory)
    path = directory / MANIFEST
    budget: list[tuple[int, int, int | None]] = []  # the size cap's listing: taken once
    seen = None
    for attempt in range(1 + REREADS):  # read again where the bytes came in wrong
        data = _read_file(path, directory, budget)
        try:
            doc = _parse(path, data)
        except _ReadWrong as exc:
            wrong = exc
            if exc.plain and data == seen:  # the same junk twice: no misread, no manifest
                raise NotAManifestError(
                    f"{path} {exc}, read twice alike: it is not an unbroken manifest; the "
                    "checkpoint is damaged (or the object is not one of ours)"
                ) from None
            seen = data
            continue
        if attempt:
            times = "once" if attempt == 1 else f"{attempt} times"
            note = f"the manifest {path} read wrong {times} ({wrong}), read again and sound"
            logger.warning("%s", note)
            if notes is not None:
                notes.append(note)
        break
    else:
        raise CorruptCheckpointError(
            f"{path} {wrong}, read {1 + REREADS} times: the manifest was altered or damaged"
        )
    schema.validate(path, doc)
    named = folder_step(directory)
    if named is not None and named != doc["step"]:
        raise CorruptCheckpointError(
            f"{directory} is named for step {named} but holds the checkpoint of step "
            f"{doc['step']}: step folders were renamed, swapped or copied. Rename it to "
            f"{step_dir_name(doc['step'])} if that is where it belongs, or use another step"
        )
    return doc


class NotAManifestError(CorruptCheckpointError):
    """A ``manifest.json`` whose bytes, read twice alike, are no unbroken manifest at all
    (not JSON, or not ours): junk, never a checkpoint read wrong once nor one that a save
    pruned meanwhile (a save never writes such bytes). Re-read no further."""


class _ReadWrong(Exception):
    """The manifest's bytes are not a sound manifest: read wrong once, or damaged.
    ``plain``: not a manifest at all (unparsable, or not ours), rather than one failing
    its checksum."""

    def __init__(self, message: str, *, plain: bool = True) -> None:
        super().__init__(message)
        self.plain = plain


def _read_file(path: Location, directory: Location, budget: list) -> bytes:
    try:
        if directory.is_link():
            raise CorruptCheckpointError(f"{directory} is a symbolic link; checkpoints never are")
        if not budget:
            budget.append(_shard_budget(directory))
        return _read_bounded(path, budget[0])
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"{path} is missing: {directory} is not a committed checkpoint (a step folder "
            "whose manifest was lost or deleted is damaged and never restored)"
        ) from None
    except CorruptCheckpointError:
        raise
    except OSError as exc:  # no permission, an I/O error: as unusable as a missing one
        raise CorruptCheckpointError(
            f"{exc.filename or path} cannot be read ({exc.strerror or exc})"
        ) from None


def _parse(path: Location, text: bytes) -> dict[str, Any]:
    """The manifest document in ``text``, its checksum checked. Raises ``_ReadWrong``
    for what bytes read wrong once also give (unparsable, not a manifest, failing the
    checksum) and ``CorruptCheckpointError`` for the rest."""
    try:
        doc = json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise _ReadWrong(f"is not valid JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise _ReadWrong("is not an unbroken manifest")
    schema.check_json(path, doc)  # depth and 1e999 first: the digest below recurses
    claimed = doc.pop("manifest_checksum", None)
    version = doc.get("format_version")
    newer = isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION
    if claimed != _digest(doc) and not newer:  # a newer format may digest otherwise
        raise _ReadWrong("fails its checksum", plain=False)
    if not isinstance(version, int) or isinstance(version, bool) or newer:
        raise CorruptCheckpointError(
            f"{path} has format_version {version!r}; this unbroken reads up to "
            f"{FORMAT_VERSION}: upgrade unbroken"
        )
    return doc


def _read_bounded(path: Location, budget: tuple[int, int, int | None]) -> bytes:
    """The manifest's bytes, if it is a plain file no larger than its checkpoint can
    need (judged before its bytes are read by ``budget``, the folder's
    :func:`_shard_budget`: see ``MANIFEST_PER_FILE``)."""
    count, held, listed = budget
    limit = _size_limit(count, held)
    try:
        if listed is not None and listed > limit:  # judged by the listing: nothing read
            raise TooLarge(str(path), listed)
        return path.read_capped(limit)
    except TooLarge as exc:
        if exc.size is None:
            raise CorruptCheckpointError(f"{path} grew while it was read; it is damaged") from None
        raise CorruptCheckpointError(
            f"{path} is {exc.size} bytes, more than a checkpoint of {count} shard "
            f"file(s) of {held} bytes can need ({limit}); it was not parsed: the "
            "checkpoint is damaged or hostile"
        ) from None


def require_native_byteorder(directory: Location, doc: dict[str, Any]) -> None:
    """Raise unless the checkpoint's tensor bytes are in this machine's byte order."""
    order = doc.get("byteorder", "little")
    if order != sys.byteorder:
        raise CheckpointError(
            f"{directory} holds {order}-endian tensor bytes (written on a {order}-endian "
            f"machine); this machine is {sys.byteorder}-endian and cannot read them as "
            "they are: restore it on a machine of that byte order"
        )


def fingerprint_algorithm(doc: dict[str, Any]) -> str:
    """The algorithm of a manifest's fingerprints (manifests that name none: v1)."""
    return doc.get("fingerprint_algorithm", fingerprint.V1)


def require_known_fingerprints(directory: Location, doc: dict[str, Any]) -> None:
    """Raise unless this version can recompute the checkpoint's fingerprints."""
    algorithm = fingerprint_algorithm(doc)
    if algorithm not in fingerprint.ALGORITHMS:
        raise CheckpointError(
            f"{directory}: its tensors are fingerprinted with {algorithm!r}, which this "
            "version of unbroken cannot recompute, so nothing read from it could be "
            "verified; upgrade unbroken to restore or export it"
        )


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")
