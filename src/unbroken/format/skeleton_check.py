"""Validation of a skeleton read from a manifest (untrusted) before it is decoded.

:func:`check` walks the JSON that :func:`unbroken.format.tree.decode` would turn into
state and refuses, naming the path, what decoding would choke on or misread.
"""

from __future__ import annotations

from collections.abc import Container
from typing import Any

from .tree import (
    FACTORIES,
    OPTIONAL_FIELDS,
    TAG,
    TAG_FIELDS,
    SkeletonError,
    decode,
    unknown_tag,
)


def check(node: Any, keys: Container[str] | None, where: str = "") -> None:
    """Raise :class:`SkeletonError` (naming the path) unless :func:`decode` succeeds on
    the skeleton ``node``: every tag known and well formed, every dict key and set member
    hashable, every tensor reference a string (one of ``keys`` unless None). Nothing is
    built but the small tagged leaves (floats, dtypes, numpy values)."""
    if isinstance(node, list):
        for i, v in enumerate(node):
            check(v, keys, f"{where}/{i}")
    elif isinstance(node, dict) and TAG not in node:
        for k, v in node.items():
            check(v, keys, f"{where}/{k}")
    elif isinstance(node, dict):
        _tagged(node, keys, where)


def _tagged(node: dict, keys: Container[str] | None, where: str) -> None:
    tag = node[TAG]
    fields = TAG_FIELDS.get(tag) if isinstance(tag, str) else None
    if fields is None:
        raise SkeletonError(f"{where or '/'}: {unknown_tag(tag)}")
    optional = OPTIONAL_FIELDS.get(tag, {})
    if not {TAG, *fields} <= set(node) <= {TAG, *fields, *optional}:
        allowed = f" (and optionally {sorted(optional)})" if optional else ""
        raise SkeletonError(f"{where}: a {tag!r} tag has the fields {sorted(fields)}"
                            f"{allowed}, not {sorted(node)}")  # fmt: skip
    for field, value in optional.items():
        if field in node and node[field] is not value:
            raise SkeletonError(f"{where}: a {tag!r} tag's {field!r} is {value!r} when "
                                f"present, not {repr(node[field])[:40]}")  # fmt: skip
    if tag == "tensor":
        if not isinstance(node["key"], str) or (keys is not None and node["key"] not in keys):
            raise SkeletonError(f"{where}: references tensor {repr(node['key'])[:80]}, "
                                "which the manifest does not list")  # fmt: skip
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
                check(item, keys, f"{where}/{i}")
            elif tag in ("set", "frozenset"):
                _key(item, f"{where}/{i}", "set member")
            elif isinstance(item, list) and len(item) == 2:
                _key(item[0], f"{where}/{i}", "dict key")
                check(item[1], keys, f"{where}/{i}")
            else:
                raise SkeletonError(f"{where}: the items of a {tag!r} are not pairs")


def _key(key: Any, where: str, what: str) -> None:
    """A dict key or set member that decodes to a hashable value."""
    if key is None or isinstance(key, str | int | float):
        return
    tag = key.get(TAG) if isinstance(key, dict) else None
    if tag in ("float", "npscalar"):
        return _tagged(key, (), where)
    items = key.get("items") if tag in ("tuple", "frozenset") and len(key) == 2 else None
    if isinstance(items, list):
        for i, k in enumerate(items):
            _key(k, f"{where}/{i}", what)
        return
    raise SkeletonError(f"{where}: a {what} must be a scalar or a tagged tuple, "
                        f"frozenset, float or numpy scalar, not {repr(key)[:80]}")  # fmt: skip
