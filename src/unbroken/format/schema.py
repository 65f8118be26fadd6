"""What a manifest may hold: every field the library reads, with its type and bounds.

The manifest's checksum has no key, so an edited manifest can be re-sealed: its content
is untrusted input until checked here. :func:`check_json` runs on the parsed JSON before
anything else (nesting depth, finite numbers: ``1e999`` parses as infinity);
:func:`validate` then checks every field any reader uses (types, bounds on sizes,
offsets, counts and string lengths, the world size against the ranks the manifest
describes, the state skeletons' tags) and raises :class:`CorruptCheckpointError` naming
the field. So a malformed manifest is damage like any other (``restore()`` falls back to
an older step, the tools report it), never a ``TypeError`` from deep inside a restore.
Fields are checked where present; unknown fields are ignored (newer writers may add some).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from ..errors import CorruptCheckpointError
from . import layout, tree

MAX_DEPTH = 200  # JSON nesting; a state nests at most tree.MAX_STATE_DEPTH (~3x in JSON)
MAX_WORLD_SIZE = 1 << 20
MAX_NAME = 4096  # tensor keys, component and metric names, FQNs
MAX_SHORT = 256  # kinds, dtypes, devices, versions, checksums, segments, events
MAX_DIMS = 64
MAX_INT = 2**62  # steps, sizes, offsets, shape dimensions
MAX_TIME = 1e11  # seconds since 1970 (the year 5138)
MAX_PROBE_VALUES = 65536
MAX_FILES_PER_RANK = 16  # a rank's shard is one file, or a few written side by side
MAX_SAVE_WARNINGS = 256  # warnings a save records (optional; one per optimizer at most)
MAX_GRADIENT_NAMES = 16  # FQNs the ``gradients`` record names (a save names 5)
SAFE_FILE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
# A run's identity (the lineage's ``run``, ``Checkpointer.run_id``): usable as is as a
# tracker's run id (W&B refuses some characters) and in paths.
RUN_ID = re.compile(r"[A-Za-z0-9]{1,64}")  # fullmatch: "$" would let a newline through
_DEVICE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
_NON_FINITE = ("nan", "inf", "-inf")
# Bytes per element of every dtype a checkpoint may hold, by the name the manifest records
# (torch's name without ``torch.``). A plain table: reading and checking a manifest needs
# no torch; ``manifest.DTYPES`` gives the torch dtypes (tests/unit/test_format_dtypes.py
# holds this table to torch's element sizes).
ITEMSIZES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "complex64": 8,
    "complex128": 16,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
}
# Device types saves record on common machines (a tensor's device when it was staged),
# accepted without asking torch; any other is checked with torch.device (imports torch).
COMMON_DEVICES = frozenset({"cpu", "cuda", "meta", "mps", "xpu", "hpu", "mtia", "xla"})


class _Bad(Exception):
    """A field that fails the schema: its path and why."""


def _fail(where: str, why: str) -> NoReturn:
    raise _Bad(f"{where}: {why}")


def check_json(path: Path, doc: Any) -> None:
    """Nesting depth and finite numbers, without recursion (run before anything else)."""
    stack = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, float) and not math.isfinite(node):
            raise CorruptCheckpointError(
                f"{path}: holds a number that is not a finite float (such as 1e999); a "
                "manifest never does, it is damaged"
            )
        if isinstance(node, dict | list):
            if depth > MAX_DEPTH:
                raise CorruptCheckpointError(
                    f"{path}: nested deeper than {MAX_DEPTH} levels, which no manifest is"
                )
            values = node.values() if isinstance(node, dict) else node
            stack.extend((v, depth + 1) for v in values)


def validate(path: Path, doc: dict[str, Any]) -> None:
    """Raise :class:`CorruptCheckpointError` naming the first field that fails the schema."""
    try:
        _validate(doc)
    except _Bad as exc:
        raise CorruptCheckpointError(f"{path}: {exc}; the manifest is damaged") from None


def _validate(doc: dict[str, Any]) -> None:
    _int(doc.get("format_version"), "format_version", 1)  # manifest.read refuses newer ones
    _int(doc.get("step"), "step")
    world = _int(doc.get("world_size"), "world_size", 1, MAX_WORLD_SIZE)
    if "created_unix" in doc:
        _number(doc["created_unix"], "created_unix", 0, MAX_TIME)
    if "versions" in doc:
        for k, v in _dict(doc["versions"], "versions").items():
            _str(k, "versions", MAX_SHORT)
            _str(v, f"versions/{k}", MAX_SHORT)
    for field in ("fingerprint_algorithm", "checksum_algorithm"):
        if field in doc:
            _str(doc[field], field, MAX_SHORT)
    if "byteorder" in doc and doc["byteorder"] not in ("little", "big"):
        _fail("byteorder", f"{doc['byteorder']!r} is neither 'little' nor 'big'")
    files = _files(doc.get("files"), world)
    tensors = _dict(doc.get("tensors"), "tensors")
    for key, entry in tensors.items():
        _tensor(_str(key, "tensors", MAX_NAME), entry, files)
    components = _dict(doc.get("components"), "components")
    for name, entry in components.items():
        _component(_str(name, "components", MAX_NAME), entry, world)
    for i, event in enumerate(_list(doc.get("lineage"), "lineage")):
        _event(event, f"lineage/{i}")
    if doc.get("metrics") is not None:
        for i, record in enumerate(_list(doc["metrics"], "metrics")):
            _metrics(record, f"metrics/{i}")
    if doc.get("probe") is not None:
        _probe(doc["probe"], world)
    if doc.get("save_warnings") is not None:  # optional: older manifests have none
        notes = _list(doc["save_warnings"], "save_warnings", lambda x, w: _str(x, w, MAX_NAME))
        if len(notes) > MAX_SAVE_WARNINGS:
            _fail("save_warnings", f"{len(notes)} entries, more than {MAX_SAVE_WARNINGS}")
    if doc.get("gradients") is not None:  # optional: parameters holding gradients at save
        _gradients(_dict(doc["gradients"], "gradients"))
    if doc.get("frozen") is not None:  # optional: frozen="verify" saves
        for key, entry in _dict(doc["frozen"], "frozen").items():
            _frozen(_str(key, "frozen", MAX_NAME), entry, tensors)
    if doc.get("peft") is not None:  # optional: a PEFT model's adapter configurations
        for name, config in _dict(doc["peft"], "peft").items():
            _dict(config, f"peft/{_str(name, 'peft', MAX_SHORT)}")


def _frozen(key: str, entry: Any, tensors: dict) -> None:
    where = f"frozen/{key}"
    entry = _dict(entry, where)
    _dtype_and_shape(entry, where)
    _str(entry.get("fingerprint"), f"{where}/fingerprint", MAX_SHORT)
    if not isinstance(entry.get("stored"), bool):
        _fail(f"{where}/stored", f"{_short(entry.get('stored'))} is not true or false")
    if not entry["stored"] and key in tensors:
        _fail(where, "recorded as not stored, yet listed among the stored tensors")


def _gradients(found: dict[str, Any]) -> None:
    _int(found.get("held"), "gradients/held", 1)
    if not isinstance(found.get("saved"), bool):
        _fail("gradients/saved", f"{_short(found.get('saved'))} is not true or false")
    names = _list(
        found.get("parameters"), "gradients/parameters", lambda x, w: _str(x, w, MAX_NAME)
    )
    if len(names) > MAX_GRADIENT_NAMES:
        _fail("gradients/parameters", f"{len(names)} entries, more than {MAX_GRADIENT_NAMES}")


def unreferenced(doc: dict[str, Any]) -> list[str]:
    """Listed tensors that no component's state references, sorted. A save never writes
    one, so a restore refuses them (a reference edited away would otherwise leave its
    place in the state holding whatever the edit put there); ``unbroken verify`` reports
    each."""
    referenced: set[str] = set()
    for entry in doc["components"].values():
        states = entry["ranks"].values() if entry.get("per_rank") else [entry["state"]]
        for state in states:
            referenced.update(tree.tensor_keys(state))
    return sorted(set(doc["tensors"]) - referenced)


# Types ------------------------------------------------------------------------------------


def _int(x: Any, where: str, low: int = 0, high: int = MAX_INT) -> int:
    if not isinstance(x, int) or isinstance(x, bool) or not low <= x <= high:
        _fail(where, f"{_short(x)} is not an integer in [{low}, {high}]")
    return x


def _number(x: Any, where: str, low: float, high: float) -> float:
    if not isinstance(x, int | float) or isinstance(x, bool) or not low <= x <= high:
        _fail(where, f"{_short(x)} is not a number in [{low}, {high}]")
    return x


def _str(x: Any, where: str, longest: int) -> str:
    if not isinstance(x, str) or len(x) > longest:
        _fail(where, f"{_short(x)} is not a string of at most {longest} characters")
    return x


def _dict(x: Any, where: str) -> dict:
    if not isinstance(x, dict):
        _fail(where, f"{_short(x)} is not an object")
    return x


def _list(x: Any, where: str, each: Callable[[Any, str], Any] | None = None) -> list:
    if not isinstance(x, list):
        _fail(where, f"{_short(x)} is not a list")
    if each is not None:
        for i, item in enumerate(x):
            each(item, f"{where}/{i}")
    return x


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."


# Files and tensors ------------------------------------------------------------------------


def _files(files: Any, world: int) -> dict:
    files = _dict(files, "files")
    for name, rec in files.items():
        if not SAFE_FILE.match(name) or name in (".", "..", "manifest.json"):
            _fail("files", f"unsafe file name {_short(name)}")
        _int(_dict(rec, f"files/{name}").get("size"), f"files/{name}/size")
        if "checksum" in rec:
            _str(rec["checksum"], f"files/{name}/checksum", MAX_SHORT)
    if len(files) > world * MAX_FILES_PER_RANK:
        _fail("files", f"{len(files)} files for a world size of {world}")
    return files


def _dtype_and_shape(entry: dict, where: str) -> list:
    if not isinstance(entry.get("dtype"), str) or entry["dtype"] not in ITEMSIZES:
        _fail(where, f"unknown dtype {_short(entry.get('dtype'))}")
    shape = _list(entry.get("shape"), f"{where}/shape")
    if len(shape) > MAX_DIMS:
        _fail(f"{where}/shape", f"{len(shape)} dimensions")
    for i, n in enumerate(shape):
        _int(n, f"{where}/shape/{i}")
    return shape


def _tensor(key: str, entry: Any, files: dict) -> None:
    where = f"tensors/{key}"
    entry = _dict(entry, where)
    shape = _dtype_and_shape(entry, where)
    if "device" in entry:
        _device(entry["device"], f"{where}/device")
    _str(entry.get("fingerprint"), f"{where}/fingerprint", MAX_SHORT)
    itemsize = ITEMSIZES[entry["dtype"]]
    covered, seen = 0, set()
    for i, chunk in enumerate(_list(entry.get("chunks"), f"{where}/chunks")):
        covered += _chunk(chunk, f"{where}/chunks/{i}", shape, itemsize, files, seen)
    if covered != math.prod(shape):
        _fail(where, f"chunks cover {covered} of {math.prod(shape)} elements")
    if "stride" in entry and not layout.valid_stride(shape, entry["stride"]):
        _fail(where, f"stride {_short(entry['stride'])} does not lay out shape {shape}")


def _chunk(c: Any, where: str, shape: list, itemsize: int, files: dict, seen: set) -> int:
    c = _dict(c, where)
    offsets, sizes = _list(c.get("offsets"), f"{where}/offsets"), _list(c.get("sizes"), where)
    if not len(offsets) == len(sizes) == len(shape):
        _fail(where, "malformed chunk: offsets and sizes do not match the shape")
    for o, s, dim in zip(offsets, sizes, shape, strict=True):
        if _int(o, f"{where}/offsets") + _int(s, f"{where}/sizes") > dim:
            _fail(where, f"a chunk lies outside shape {shape}")
    if tuple(offsets) in seen:
        _fail(where, f"two chunks start at {offsets}")
    seen.add(tuple(offsets))
    rec = files.get(c.get("file")) if isinstance(c.get("file"), str) else None
    if rec is None:
        _fail(where, f"chunk in unlisted file {_short(c.get('file'))}")
    length = math.prod(sizes) * itemsize
    if _int(c.get("length"), f"{where}/length") != length:  # an int: never 128.0 nor true
        _fail(where, "chunk length does not match its shape")
    if _int(c.get("offset"), f"{where}/offset") + length > rec["size"]:
        _fail(where, f"chunk lies beyond the end of {c['file']}")
    _str(c.get("checksum"), f"{where}/checksum", MAX_SHORT)
    return math.prod(sizes)


def _device(x: Any, where: str) -> None:
    """A device type (``cuda``, never ``cuda:99``: a restore places tensors on the live
    objects' devices, never on one the file names) that held the tensor's bytes: not
    ``meta``, which holds none, so no save records it."""
    if not isinstance(x, str) or not _DEVICE.match(x):
        _fail(where, f"{_short(x)} is not a device type")
    if x == "meta":
        _fail(where, "'meta' tensors hold no bytes; no save records them")
    if x not in COMMON_DEVICES and not _torch_knows_device(x):
        _fail(where, f"{x!r} is not a device type torch knows")


def _torch_knows_device(name: str) -> bool:
    import torch  # only for a device type no save on a common machine records

    try:
        return torch.device(name).type == name
    except RuntimeError:
        return False


# Components -------------------------------------------------------------------------------


def _component(name: str, entry: Any, world: int) -> None:
    where = f"components/{name}"
    entry = _dict(entry, where)
    _str(entry.get("kind", ""), f"{where}/kind", MAX_SHORT)
    per_rank = entry.get("per_rank", False)
    if not isinstance(per_rank, bool):
        _fail(f"{where}/per_rank", f"{_short(per_rank)} is not true or false")
    if "parameters" in entry:
        _list(entry["parameters"], f"{where}/parameters", lambda x, w: _str(x, w, MAX_NAME))
    if per_rank:
        ranks = _dict(entry.get("ranks"), f"{where}/ranks")
        if len(ranks) != world or set(ranks) != {str(r) for r in range(world)}:
            keys = _short(sorted(ranks)[:5])
            _fail(f"{where}/ranks", f"ranks {keys} for a world size of {world} (one per rank)")
        skeletons = [(ranks[str(r)], f"{where}/ranks/{r}") for r in range(world)]
    elif "state" not in entry:
        _fail(where, "no state")
    else:
        skeletons = [(entry["state"], f"{where}/state")]
    for skeleton, at in skeletons:
        try:
            tree.check_skeleton(skeleton, None)  # an unlisted tensor: restore and verify name it
        except tree.SkeletonError as exc:
            _fail(at, str(exc).removeprefix("/"))
        if name == "optimizer":
            _optimizers(skeleton, at)
        elif name == "model" and not (isinstance(skeleton, dict) and tree.TAG not in skeleton):
            _fail(at, "the model's state is not an object")


def _optimizers(skeleton: Any, where: str) -> None:
    """An optimizer's state as live/optimizer.py captures it (or a dict of them)."""
    if isinstance(skeleton, dict) and "param_groups" in skeleton:
        return _optimizer(skeleton, where)
    for name, one in _plain(skeleton, where).items():
        _optimizer(one, f"{where}/{name}")


def _optimizer(opt: Any, where: str) -> None:
    opt = _plain(opt, where)
    members: set[str] = set()
    for i, group in enumerate(_list(opt.get("param_groups"), f"{where}/param_groups")):
        at = f"{where}/param_groups/{i}"
        params = _list(_plain(group, at).get("params"), f"{at}/params")
        members.update(_str(fqn, f"{at}/params", MAX_NAME) for fqn in params)
    state = _plain(opt.get("state"), f"{where}/state")
    for fqn, entries in state.items():
        if fqn not in members:
            _fail(f"{where}/state", f"optimizer state for {fqn!r} belongs to no param group")
        if not isinstance(entries, dict) or entries.get(tree.TAG) not in (None, "dict"):
            _fail(f"{where}/state/{fqn}", f"{_short(entries)} is not a mapping")


def _plain(x: Any, where: str) -> dict:
    if not isinstance(x, dict) or tree.TAG in x:
        _fail(where, f"{_short(x)} is not an object")
    return x


# Lineage, metrics, probe ------------------------------------------------------------------


def _event(event: Any, where: str) -> None:
    event = _dict(event, where)
    _str(event.get("event"), f"{where}/event", MAX_SHORT)
    checks: dict[str, Callable[[Any, str], Any]] = {
        "from_step": _int,
        "run": _run_id,
        "world_size": lambda x, w: _int(x, w, 1, MAX_WORLD_SIZE),
        "time": lambda x, w: _number(x, w, 0, MAX_TIME),
        "segment": lambda x, w: _str(x, w, MAX_SHORT),
        "reset": lambda x, w: _list(x, w, lambda y, v: _str(y, v, MAX_NAME)),
        "skipped": lambda x, w: _list(x, w, lambda y, v: _str(y, v, MAX_NAME)),
        "retired": lambda x, w: _list(x, w, _int),
        "replay": _replay,
    }
    for field, check in checks.items():
        if event.get(field) is not None:
            check(event[field], f"{where}/{field}")


def _run_id(x: Any, where: str) -> None:
    if not isinstance(x, str) or not RUN_ID.fullmatch(x):
        _fail(where, f"{_short(x)} is not a run id (1 to 64 ASCII letters or digits)")


def _replay(x: Any, where: str) -> None:
    x = _dict(x, where)
    if "status" in x:
        _str(x["status"], f"{where}/status", MAX_SHORT)


def _metrics(record: Any, where: str) -> None:
    record = _dict(record, where)
    _int(record.get("step"), f"{where}/step")
    for name, value in record.items():
        _str(name, where, MAX_NAME)
        if name != "step" and not _metric_value(value):
            _fail(f"{where}/{name}", f"{_short(value)} is not a number")


def _metric_value(x: Any) -> bool:
    if isinstance(x, bool):
        return False
    return isinstance(x, int | float) or x in _NON_FINITE


def _probe(probe: Any, world: int) -> None:
    ranks = _list(_dict(probe, "probe").get("ranks"), "probe/ranks")
    if len(ranks) != world:
        _fail("probe/ranks", f"{len(ranks)} values for a world size of {world}")
    for r, value in enumerate(ranks):
        where = f"probe/ranks/{r}"
        value = _dict(value, where)
        _str(value.get("dtype"), f"{where}/dtype", MAX_SHORT)
        shape = _list(value.get("shape"), f"{where}/shape", _int)
        values = _list(value.get("values"), f"{where}/values")
        if (
            len(shape) > MAX_DIMS
            or len(values) > MAX_PROBE_VALUES
            or (len(values) != math.prod(shape))
        ):
            _fail(where, f"{len(values)} values for shape {_short(shape)}")
        for v in values:
            if not isinstance(v, int | float) and v not in _NON_FINITE:
                _fail(f"{where}/values", f"{_short(v)} is not a number")
