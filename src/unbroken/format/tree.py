"""Split nested state (containers, scalars, tensors) into JSON and tensors, and back.

A component's ``state_dict()`` is encoded as a JSON *skeleton* in which every tensor is
replaced by a reference to a flat key; the tensors go to sharded storage. Decoding puts
them back. Nothing is ever pickled: values that are neither JSON-representable nor
tensors are refused with the path where they were found.

Decoding is the exact inverse of encoding: the same container types (``dict``,
``Counter``, ``OrderedDict``, ``defaultdict`` with a builtin factory, ``list``, ``tuple``,
``set``, ``frozenset``), the same scalar types (``bool``, ``int``, ``float``, numpy
scalars) and the same key order. A plain dict with string keys is a JSON object (the
manifest keeps its member order); everything else that JSON cannot say carries an
``{"__ub__": TAG, ...}`` tag. Tags are never redefined: skeletons written by older
versions decode as they always did.

A tensor's reference keeps what the flat tensor cannot: ``"requires_grad": true`` for a
tensor that requires grad (an extra's learnable scalar), so it comes back as a leaf that
requires grad. The field is written only then, so older skeletons (which never have it)
decode as before.

A skeleton read from a manifest is untrusted: :func:`check_skeleton` walks it before it
is decoded and refuses, naming the path, what decoding would choke on or misread.
"""

from __future__ import annotations

import math
import re
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable, Container, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

# The key that marks a tagged value in a skeleton: the one definition (every reader of
# skeletons imports it). This module imports torch only to encode, or to decode a dtype:
# reading a manifest's skeletons (tensor_keys, skeleton checks) needs none.
TAG = "__ub__"
# A defaultdict's factory is saved by name, and only these: anything else needs pickle.
FACTORIES: dict[str, type] = {
    t.__name__: t for t in (int, float, bool, str, list, dict, tuple, set, frozenset)
}
_MAPPING_TAGS: dict[type, str] = {
    Counter: "counter",
    OrderedDict: "ordereddict",
    defaultdict: "defaultdict",
}
_MAPPING_TYPES = {tag: kind for kind, tag in _MAPPING_TAGS.items()}
_SET_TAGS: dict[type, str] = {set: "set", frozenset: "frozenset"}
# Each tag's fields, exactly (a field this version does not know could change the meaning):
# what format/schema.py checks before anything is decoded.
TAG_FIELDS: dict[str, set[str]] = {
    **{t: {"items"} for t in ("tuple", "dict", "counter", "ordereddict", "set", "frozenset")},
    "tensor": {"key"},
    "float": {"repr"},
    "defaultdict": {"factory", "items"},
    "dtype": {"name"},
    "ndarray": {"dtype", "shape", "data"},
    "npscalar": {"dtype", "value"},
}
# Fields a tag may have besides those, each with the one value it may take when present.
OPTIONAL_FIELDS: dict[str, dict[str, Any]] = {"tensor": {"requires_grad": True}}
_NON_FINITE = ("nan", "inf", "-inf")
_NP_DTYPE = re.compile(r"^[<>|=]([biuf]\d{1,2}|U\d{1,6}|[mM]8(\[\d*[a-zA-Z]{1,2}\])?)$")
_MAX_NDIM = 64
_NDARRAY_SLACK = 1 << 20  # bytes an ndarray may take beyond 64 per element of its data
MAX_STATE_DEPTH = 60  # containers within containers; a manifest nests at most ~3x as deep


def _escape(segment: str) -> str:
    return segment.replace("%", "%25").replace("/", "%2F")


def join_key(*segments: object) -> str:
    """Join path segments into a flat tensor key (``/``-separated, segments escaped)."""
    return "/".join(s if isinstance(s, _Raw) else _escape(str(s)) for s in segments)


def encode(
    value: Any, prefix: str, tensors: dict[str, torch.Tensor], *, key_for: Callable | None = None
) -> Any:
    """Return the JSON skeleton of ``value``; put its tensors into ``tensors``.

    Tensor keys are ``prefix/<path>``. ``key_for(path)`` may override a tensor's key.
    Raises:
        TypeError: a value cannot be saved without pickling; the message names its path.
    """
    # The prefix is ours (``component`` or ``component/rank_00001``): not escaped.
    return _encode(value, [_Raw(prefix)], tensors, key_for)


class _Raw(str):
    """A path segment joined as is."""


def _where(path: list) -> str:
    return "/".join(map(str, path))


def _encode(value: Any, path: list, tensors: dict, key_for: Callable | None) -> Any:
    import torch  # here, not at the top: reading skeletons needs no torch

    if len(path) > MAX_STATE_DEPTH:  # deeper would be refused at restore (format/schema.py)
        raise TypeError(
            f"cannot save {_where(path[:4])}/...: state nested deeper than "
            f"{MAX_STATE_DEPTH} levels; flatten it in state_dict()"
        )
    if isinstance(value, torch.Tensor):
        key = key_for(path) if key_for is not None else join_key(*path)
        if key in tensors:
            raise ValueError(f"two tensors map to the same checkpoint key {key!r}")
        tensors[key] = value
        if value.requires_grad:
            return {TAG: "tensor", "key": key, "requires_grad": True}
        return {TAG: "tensor", "key": key}
    if isinstance(value, np.generic):  # before float and str: np.float64 and np.str_ are both
        return _encode_npscalar(value, path)
    _refuse_subclass(value, path)
    if value is None or isinstance(value, bool | str | int):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return {TAG: "float", "repr": repr(value)}
    if isinstance(value, Mapping):
        return _encode_mapping(value, path, tensors, key_for)
    if isinstance(value, list):
        if _plain_scalars(value):
            return list(value)
        return [_encode(v, [*path, i], tensors, key_for) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        if _plain_scalars(value):
            return {TAG: "tuple", "items": list(value)}
        items = [_encode(v, [*path, i], tensors, key_for) for i, v in enumerate(value)]
        return {TAG: "tuple", "items": items}
    if type(value) in _SET_TAGS:
        return {TAG: _SET_TAGS[type(value)], "items": [_encode_key(m, path) for m in value]}
    if isinstance(value, torch.dtype):
        return {TAG: "dtype", "name": str(value).removeprefix("torch.")}
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            raise TypeError(f"cannot save {_where(path)}: object arrays need pickle")
        return {
            TAG: "ndarray",
            "dtype": value.dtype.str,
            "shape": list(value.shape),
            "data": _encode(value.ravel().tolist(), path, tensors, key_for),
        }
    raise TypeError(
        f"cannot save {_where(path)}: a value of type {type(value).__qualname__} "
        "is neither a tensor nor JSON-representable; return tensors, numbers, strings, "
        "lists or dicts from state_dict()"
    )


_PLAIN = (bool, int, float, str, dict, list, tuple)


def _refuse_subclass(value: Any, path: list) -> None:
    """Refuse a subclass of a plain type (an ``IntEnum``, a ``namedtuple``, a dict
    subclass): it would come back as the plain type (a class named for a restore to
    import is what pickle does)."""
    kind = type(value)
    if kind in _PLAIN or kind in _MAPPING_TAGS or value is None:
        return
    mapping = dict if isinstance(value, Mapping) else None
    base = next((b for b in _PLAIN if isinstance(value, b)), mapping)
    if base is not None:
        raise TypeError(
            f"cannot save {_where(path) or '/'}: a {kind.__qualname__} (a subclass of "
            f"{base.__name__}) would come back as a plain {base.__name__}; return a plain "
            f"{base.__name__} from state_dict() ({base.__name__}(x), or x._asdict() for a "
            "namedtuple) and rebuild it in load_state_dict()"
        )


def _plain_scalars(items: list | tuple) -> bool:
    """Whether every item encodes as itself (a string, an int, a bool, None or a finite
    float, of exactly these types): long runs of them (a generator's state, a
    parameter group's indices) are then copied as they are, in one pass."""
    for v in items:
        kind = type(v)
        if kind is float:
            if not math.isfinite(v):
                return False
        elif kind is not int and kind is not str and kind is not bool and v is not None:
            return False
    return True


def _encode_npscalar(value: np.generic, path: list) -> dict[str, Any]:
    item = value.item()
    if isinstance(item, np.generic):  # longdouble and friends have no exact Python value
        raise TypeError(f"cannot save {_where(path)}: numpy {value.dtype} has no JSON form")
    return {TAG: "npscalar", "dtype": value.dtype.str, "value": _encode(item, path, {}, None)}


def _encode_mapping(value: Mapping, path: list, tensors: dict, key_for: Callable | None) -> Any:
    tag = _MAPPING_TAGS.get(type(value), "dict")
    if tag == "dict" and TAG not in value and all(isinstance(k, str) for k in value):
        return {k: _encode(v, [*path, k], tensors, key_for) for k, v in value.items()}
    out: dict[str, Any] = {TAG: tag}
    if tag == "defaultdict":
        out["factory"] = _factory_name(value.default_factory, path)  # type: ignore[attr-defined]
    out["items"] = [
        [_encode_key(k, path), _encode(v, [*path, k], tensors, key_for)] for k, v in value.items()
    ]
    return out


def _factory_name(factory: Any, path: list) -> str | None:
    if factory is None:
        return None
    for name, kind in FACTORIES.items():
        if factory is kind:
            return name
    raise TypeError(
        f"cannot save {_where(path)}: a defaultdict whose default_factory is {factory!r} "
        f"(only None, {', '.join(FACTORIES)} can be saved; anything else would need "
        "pickle). Return a plain dict from state_dict() (dict(d)) and rebuild the "
        "defaultdict in load_state_dict()"
    )


def _encode_key(key: Any, path: list) -> Any:
    """A dict key or set member: a scalar, a numpy scalar, or a tuple or frozenset of
    them (hashable values only, so that the decoded value can be a key again)."""
    if not isinstance(key, np.generic):
        _refuse_subclass(key, path)
    if isinstance(key, tuple):
        return {TAG: "tuple", "items": [_encode_key(k, path) for k in key]}
    if type(key) is frozenset:
        return {TAG: "frozenset", "items": [_encode_key(k, path) for k in key]}
    if isinstance(key, np.generic | float):
        return _encode(key, path, {}, None)
    if key is None or isinstance(key, str | int):
        return key
    raise TypeError(
        f"cannot save {_where(path)}: dict key or set member {key!r} of type "
        f"{type(key).__qualname__} is not a str, int, float, bool, None, numpy scalar, or a "
        "tuple or frozenset of them"
    )


class SkeletonError(ValueError):
    """A state skeleton that does not decode: damaged, hostile, or written by a newer
    unbroken (a tag this version does not know). ``format.schema`` finds every one of them
    in a manifest before anything is decoded."""


def decode(skeleton: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Inverse of :func:`encode`: rebuild the value with tensors looked up by key.

    Raises:
        SkeletonError: a tag this version does not know, or a malformed tagged value.
    """
    if isinstance(skeleton, list):
        return [decode(v, tensors) for v in skeleton]
    if not isinstance(skeleton, dict):
        return skeleton
    tag = skeleton.get(TAG)
    if tag is None:
        return {k: decode(v, tensors) for k, v in skeleton.items()}
    if tag == "tensor":
        return _decode_tensor(skeleton, tensors)
    if tag == "float":
        if skeleton["repr"] not in _NON_FINITE:
            raise SkeletonError(f"a tagged float must be one of {_NON_FINITE}")
        return float(skeleton["repr"])
    if tag == "dict" or tag in _MAPPING_TYPES:
        return _decode_mapping(skeleton, tag, tensors)
    if tag == "tuple":
        return tuple(decode(v, tensors) for v in skeleton["items"])
    if tag in ("set", "frozenset"):
        members = (decode(m, {}) for m in skeleton["items"])
        return set(members) if tag == "set" else frozenset(members)
    if tag == "dtype":
        dtype = _torch_dtypes().get(skeleton["name"])
        if dtype is None:
            raise SkeletonError(f"unknown dtype {skeleton['name']!r}")
        return dtype
    if tag == "ndarray":
        return _decode_ndarray(skeleton)
    if tag == "npscalar":
        return _np_dtype(skeleton["dtype"]).type(decode(skeleton["value"], {}))
    raise SkeletonError(unknown_tag(tag))


def _decode_tensor(skeleton: dict, tensors: Mapping[str, torch.Tensor]) -> Any:
    value = tensors[skeleton["key"]]
    if skeleton.get("requires_grad") is not True or not hasattr(value, "requires_grad_"):
        return value  # (a reader that needs no values maps keys to placeholders)
    if not (value.is_floating_point() or value.is_complex()):
        raise SkeletonError(
            f"tensor {skeleton['key']!r} is marked requires_grad but is {value.dtype}, "
            "which cannot require grad: the checkpoint is damaged; use an older step"
        )
    # A new leaf on the same memory: the loaded tensor itself stays as it was read.
    return value.detach().requires_grad_(True)


def unknown_tag(tag: Any) -> str:
    """Why a tag this version does not know cannot be decoded."""
    return (
        f"unknown tag {tag!r}: the checkpoint may come from a newer unbroken (upgrade to "
        "read it), or it is damaged"
    )


def _torch_dtypes() -> dict[str, torch.dtype]:
    import torch

    # vars(), not getattr(): torch's module __getattr__ would import submodules by name.
    return {n: v for n, v in vars(torch).items() if isinstance(v, torch.dtype)}


def _np_dtype(text: Any) -> np.dtype:
    """A numpy dtype as :func:`encode` writes it (``dtype.str``), and only such: other
    strings (sub-arrays, structures, objects) could allocate without bound or need pickle."""
    if not isinstance(text, str) or not _NP_DTYPE.match(text):
        raise SkeletonError(f"numpy dtype {text!r} is not one a checkpoint holds")
    return np.dtype(text)


def _decode_ndarray(skeleton: dict) -> np.ndarray:
    dtype, shape, data = _np_dtype(skeleton["dtype"]), skeleton["shape"], skeleton["data"]
    if not (
        isinstance(shape, list)
        and len(shape) <= _MAX_NDIM
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)
        and isinstance(data, list)
        and math.prod(shape) == len(data)
    ):
        raise SkeletonError(f"ndarray of shape {shape!r} does not hold its data")
    if len(data) * dtype.itemsize > _NDARRAY_SLACK + 64 * len(data):
        raise SkeletonError(f"ndarray of {len(data)} x {dtype} is far larger than its data")
    return np.asarray(decode(data, {}), dtype=dtype).reshape(shape)


def _decode_mapping(skeleton: dict, tag: str, tensors: Mapping[str, torch.Tensor]) -> Any:
    if tag == "defaultdict":
        name = skeleton["factory"]
        if name is not None and name not in FACTORIES:
            raise SkeletonError(f"unknown defaultdict factory {name!r} in checkpoint metadata")
        out: Any = defaultdict(None if name is None else FACTORIES[name])
    else:
        out = _MAPPING_TYPES.get(tag, dict)()
    for key, value in skeleton["items"]:
        # Keys are plain JSON scalars, or tagged tuples/floats/numpy scalars (never tensors).
        out[decode(key, {}) if isinstance(key, dict) else key] = decode(value, tensors)
    return out


def tensor_keys(skeleton: Any) -> list[str]:
    """Every tensor key referenced by a skeleton, in order."""
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for v in node:
                walk(v)
        elif isinstance(node, dict):
            if node.get(TAG) == "tensor":
                found.append(node["key"])
            else:
                for v in node.values():
                    walk(v)

    walk(skeleton)
    return found


# -- a skeleton read from a manifest (untrusted), checked before it is decoded -------------


def check_skeleton(node: Any, keys: Container[str] | None, where: str = "") -> None:
    """Raise :class:`SkeletonError` (naming the path) unless :func:`decode` succeeds on
    the skeleton ``node``: every tag known and well formed, every dict key and set member
    hashable, every tensor reference a string (one of ``keys`` unless None). Nothing is
    built but the small tagged leaves (floats, dtypes, numpy values)."""
    if isinstance(node, list):
        for i, v in enumerate(node):
            check_skeleton(v, keys, f"{where}/{i}")
    elif isinstance(node, dict) and TAG not in node:
        for k, v in node.items():
            check_skeleton(v, keys, f"{where}/{k}")
    elif isinstance(node, dict):
        _check_tagged(node, keys, where)


def _check_tagged(node: dict, keys: Container[str] | None, where: str) -> None:
    tag = node[TAG]
    fields = TAG_FIELDS.get(tag) if isinstance(tag, str) else None
    if fields is None:
        raise SkeletonError(f"{where or '/'}: {unknown_tag(tag)}")
    optional = OPTIONAL_FIELDS.get(tag, {})
    if not {TAG, *fields} <= set(node) <= {TAG, *fields, *optional}:
        allowed = f" (and optionally {sorted(optional)})" if optional else ""
        raise SkeletonError(
            f"{where}: a {tag!r} tag has the fields {sorted(fields)}{allowed}, not {sorted(node)}"
        )
    for field, value in optional.items():
        if field in node and node[field] is not value:
            raise SkeletonError(
                f"{where}: a {tag!r} tag's {field!r} is {value!r} when "
                f"present, not {repr(node[field])[:40]}"
            )
    if tag == "tensor":
        if not isinstance(node["key"], str) or (keys is not None and node["key"] not in keys):
            raise SkeletonError(
                f"{where}: references tensor {repr(node['key'])[:80]}, "
                "which the manifest does not list"
            )
    elif tag in ("float", "dtype", "ndarray", "npscalar"):  # small leaves: decoded for real
        try:
            decode(node, {})
        except (ValueError, TypeError, OverflowError, KeyError) as exc:
            raise SkeletonError(f"{where}: malformed {tag!r} ({exc})") from None
    elif not isinstance(node["items"], list):
        raise SkeletonError(f"{where}: the items of a {tag!r} are not a list")
    elif tag == "defaultdict" and node["factory"] not in (None, *FACTORIES):
        raise SkeletonError(f"{where}: unknown defaultdict factory {node['factory']!r}")
    else:
        for i, item in enumerate(node["items"]):
            if tag == "tuple":
                check_skeleton(item, keys, f"{where}/{i}")
            elif tag in ("set", "frozenset"):
                _check_key(item, f"{where}/{i}", "set member")
            elif isinstance(item, list) and len(item) == 2:
                _check_key(item[0], f"{where}/{i}", "dict key")
                check_skeleton(item[1], keys, f"{where}/{i}")
            else:
                raise SkeletonError(f"{where}: the items of a {tag!r} are not pairs")


def _check_key(key: Any, where: str, what: str) -> None:
    """A dict key or set member that decodes to a hashable value."""
    if key is None or isinstance(key, str | int | float):
        return
    tag = key.get(TAG) if isinstance(key, dict) else None
    if tag in ("float", "npscalar"):
        return _check_tagged(key, (), where)
    items = key.get("items") if tag in ("tuple", "frozenset") and len(key) == 2 else None
    if isinstance(items, list):
        for i, k in enumerate(items):
            _check_key(k, f"{where}/{i}", what)
        return
    raise SkeletonError(
        f"{where}: a {what} must be a scalar or a tagged tuple, "
        f"frozenset, float or numpy scalar, not {repr(key)[:80]}"
    )
