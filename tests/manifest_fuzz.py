"""Hostile manifests for the fuzz tests: a real manifest mutated, to be re-sealed by
``tamper.write`` (the manifest's checksum has no key, so anyone who edits a manifest can
recompute it, as an attacker would).

Each mutation changes one to three places of the document: a value replaced by one of
another type, a number made huge, negative or ``1e999``, deep nesting, a long string, a
key removed or added, an element added or dropped, a state tag renamed or stripped.
"""

from __future__ import annotations

import copy
import random
from typing import Any

from tamper import INF, NEG_INF

DEEP = 300  # deeper than any manifest may nest; the JSON parser still reads it

# In this order (the fuzz tests' seeds pick by position).
_NUMBERS = [0, -1, 1, 7, 2**31, 2**62, 2**63, -(2**63), 10**30, 0.5, -2.5, 1e308, INF, NEG_INF]
_STRINGS = ["", "x", "cpu", "float32", "rank_00000.bin", "../outside.bin", "__ub__"]
_CONTAINERS = [[], [0], [[]], {}, {"__ub__": "tensor"}, {"__ub__": "no-such-tag"}]
_TAGGED = [
    {"__ub__": "tensor", "key": 5},
    {"__ub__": "dtype", "name": "__class__"},
    {"__ub__": "ndarray", "dtype": "<U99999", "shape": [2**20], "data": []},
]
_SCALARS = [None, True, False, *_NUMBERS, *_STRINGS, "x" * 100_000]
_VALUES: list[Any] = [*_SCALARS, *_CONTAINERS, *_TAGGED]
_TAG_NAMES = ["tensor", "float", "tuple", "dict", "counter", "ordereddict", "defaultdict"]
_TAG_NAMES += ["set", "frozenset", "dtype", "ndarray", "npscalar", "no-such-tag"]
_TAGS: list[Any] = [*_TAG_NAMES, 5, None]


def _deep(depth: int, leaf: Any = 0) -> Any:
    node = leaf
    for i in range(depth):
        node = [node] if i % 2 else {"a": node}
    return node


def paths(doc: Any) -> list[tuple]:
    """Every place in ``doc`` (long lists contribute their first two and last items)."""
    found: list[tuple] = []

    def walk(node: Any, at: tuple) -> None:
        if at:
            found.append(at)
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, (*at, k))
        elif isinstance(node, list):
            picks = range(len(node)) if len(node) <= 4 else [0, 1, len(node) - 1]
            for i in picks:
                walk(node[i], (*at, i))

    walk(doc, ())
    return found


def _parent(doc: Any, at: tuple) -> Any:
    node = doc
    for k in at[:-1]:
        node = node[k]
    return node


def _number(value: Any, rng: random.Random) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return rng.choice(_VALUES)
    changed = [value + 1, -value - 1, 0, value * 2**40, 2**62, 10**300, INF, NEG_INF]
    return rng.choice([*changed, float(value) + 0.5, str(value)])


def mutate_once(doc: dict, rng: random.Random) -> str:
    """Change one place of ``doc`` in place; return what was done."""
    at = rng.choice(paths(doc))
    parent, key = _parent(doc, at), at[-1]
    value = parent[key]
    where = "/".join(map(str, at))
    op = rng.choice(["replace", "replace", "number", "deep", "remove", "add", "tag", "retype"])
    if op == "number":
        parent[key] = _number(value, rng)
    elif op == "deep":
        parent[key] = _deep(DEEP, value if rng.random() < 0.5 else 0)
    elif op == "remove":
        if isinstance(parent, dict):
            del parent[key]
        else:
            parent.pop(key)
    elif op == "add":
        if isinstance(value, dict):
            value[rng.choice(["__ub__", "extra", "ranks", "state", "0", "1"])] = rng.choice(_VALUES)
        elif isinstance(value, list):
            value.append(copy.deepcopy(rng.choice(value)) if value else rng.choice(_VALUES))
        else:
            parent[key] = [value, value]
    elif op == "tag" and isinstance(value, dict):
        if "__ub__" in value and rng.random() < 0.6:
            value["__ub__"] = rng.choice(_TAGS)
        else:
            value.pop(rng.choice(sorted(value, key=str)), None) if value else None
    elif op == "retype":
        parent[key] = {"d": value} if not isinstance(value, dict) else list(value.values())
    else:
        parent[key] = copy.deepcopy(rng.choice(_VALUES))
    return f"{op} {where}"


def mutated(pristine: dict, rng: random.Random) -> tuple[str, dict]:
    """A copy of ``pristine`` (without its checksum) with one to three mutations."""
    doc = copy.deepcopy(pristine)
    done = [mutate_once(doc, rng) for _ in range(rng.choice([1, 1, 1, 2, 3]))]
    return "; ".join(done), doc
