"""Split nested state (dicts, lists, tuples, scalars, tensors) into JSON and tensors.

A component's ``state_dict()`` is encoded as a JSON *skeleton* in which every tensor is
replaced by a reference to a flat key; the tensors go to sharded storage. Decoding puts
them back. Nothing is ever pickled: values that are neither JSON-representable nor
tensors are refused with the path where they were found.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

_TAG = "__ub__"


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


def _encode(value: Any, path: list, tensors: dict, key_for: Callable | None) -> Any:
    if isinstance(value, torch.Tensor):
        key = key_for(path) if key_for is not None else join_key(*path)
        if key in tensors:
            raise ValueError(f"two tensors map to the same checkpoint key {key!r}")
        tensors[key] = value
        return {_TAG: "tensor", "key": key}
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return {_TAG: "float", "repr": repr(value)}
    if isinstance(value, Mapping):
        if all(isinstance(k, str) for k in value) and _TAG not in value:
            return {k: _encode(v, [*path, k], tensors, key_for) for k, v in value.items()}
        items = []
        for k, v in value.items():
            if not isinstance(k, str | int | float | bool) and k is not None:
                raise TypeError(
                    f"cannot save {'/'.join(map(str, path))}: dict key {k!r} of type "
                    f"{type(k).__name__} is not a str, int, float or bool"
                )
            items.append([k, _encode(v, [*path, k], tensors, key_for)])
        return {_TAG: "dict", "items": items}
    if isinstance(value, list):
        return [_encode(v, [*path, i], tensors, key_for) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        items = [_encode(v, [*path, i], tensors, key_for) for i, v in enumerate(value)]
        return {_TAG: "tuple", "items": items}
    if isinstance(value, torch.dtype):
        return {_TAG: "dtype", "name": str(value).removeprefix("torch.")}
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            raise TypeError(f"cannot save {'/'.join(map(str, path))}: object arrays need pickle")
        return {
            _TAG: "ndarray",
            "dtype": value.dtype.str,
            "shape": list(value.shape),
            "data": _encode(value.ravel().tolist(), path, tensors, key_for),
        }
    if isinstance(value, np.generic):
        return {_TAG: "npscalar", "dtype": value.dtype.str, "value": value.item()}
    raise TypeError(
        f"cannot save {'/'.join(map(str, path))}: a value of type {type(value).__qualname__} "
        "is neither a tensor nor JSON-representable; return tensors, numbers, strings, "
        "lists or dicts from state_dict()"
    )


def decode(skeleton: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Inverse of :func:`encode`: rebuild the value with tensors looked up by key."""
    if isinstance(skeleton, list):
        return [decode(v, tensors) for v in skeleton]
    if not isinstance(skeleton, dict):
        return skeleton
    tag = skeleton.get(_TAG)
    if tag is None:
        return {k: decode(v, tensors) for k, v in skeleton.items()}
    if tag == "tensor":
        return tensors[skeleton["key"]]
    if tag == "float":
        return float(skeleton["repr"])
    if tag == "dict":
        return {k: decode(v, tensors) for k, v in skeleton["items"]}
    if tag == "tuple":
        return tuple(decode(v, tensors) for v in skeleton["items"])
    if tag == "dtype":
        dtype = getattr(torch, skeleton["name"], None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {skeleton['name']!r}")
        return dtype
    if tag == "ndarray":
        data = decode(skeleton["data"], tensors)
        return np.asarray(data, dtype=np.dtype(skeleton["dtype"])).reshape(skeleton["shape"])
    if tag == "npscalar":
        return np.dtype(skeleton["dtype"]).type(skeleton["value"])
    raise ValueError(f"unknown tag {tag!r} in checkpoint metadata")


def tensor_keys(skeleton: Any) -> list[str]:
    """Every tensor key referenced by a skeleton, in order."""
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for v in node:
                walk(v)
        elif isinstance(node, dict):
            if node.get(_TAG) == "tensor":
                found.append(node["key"])
            else:
                for v in node.values():
                    walk(v)

    walk(skeleton)
    return found
