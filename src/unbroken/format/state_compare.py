"""Two manifests' saved state compared: one comparison for ``unbroken diff`` (non-tensor
state) and the resume test (the whole final state, and checkpoints of the same step); and
:func:`difference`, where a restored component's live skeleton first differs from the
saved one (the check after a restore).

A component's state is its JSON skeleton (format/tree.py): containers, scalars and
references to tensors. Two skeletons are walked side by side and every leaf compares by
the one "same value" rule of format/bitwise.py:

- a float (a JSON number, or a tagged ``{"__ub__": "float", "repr": "nan"}`` for a
  non-finite one) by its IEEE-754 bits (:func:`bitwise.same_float`): -0.0 is not 0.0,
  and any NaN is any NaN (JSON keeps no NaN payload);
- any other leaf by its JSON type and value: ``1`` is neither ``1.0`` nor ``true``;
- a tensor reference by its own fields (``requires_grad``) and by its manifest entry
  (dtype, shape, layout-independent fingerprint of its bits) when the caller passes both
  manifests' tensor tables; without them the values are not compared (``unbroken diff``
  reads and compares the tensors itself).

Dict members compare by key, whatever their order (manifests written before the
container tags sorted them). Per-rank components (rng, dataloader) compare rank by rank;
across world sizes they cannot, and :func:`compare_state` leaves them out and says so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from . import bitwise
from .tree import TAG, tensor_keys

Tables = tuple[dict[str, Any], dict[str, Any]]  # the two manifests' "tensors"


@dataclasses.dataclass
class StateComparison:
    """What :func:`compare_state` found."""

    differences: dict[str, list[str]]  # component -> its differences; only those differing
    compared_tensors: int  # tensor references compared (left-out components aside)
    left_out: list[str]  # per-rank components not comparable across world sizes
    values_only: int = 0  # differences that are tensors' values alone (their fingerprints)

    @property
    def beyond_values(self) -> bool:
        """Whether something other than tensor values differs: a non-tensor value, a
        structure, a tensor's dtype or shape (never expected of another layout)."""
        return sum(map(len, self.differences.values())) > self.values_only

    @property
    def lines(self) -> list[str]:
        """Every difference, the components in manifest order."""
        return [line for found in self.differences.values() for line in found]


def skeletons(doc: dict[str, Any], name: str) -> list[Any]:
    """The JSON skeleton(s) of component ``name``: one, or one per rank (rank order)."""
    entry = doc["components"][name]
    if entry.get("per_rank"):
        ranks = entry.get("ranks") or {}
        return [ranks[r] for r in sorted(ranks, key=int)]
    return [entry.get("state")]


def compare_state(
    a: dict[str, Any],
    b: dict[str, Any],
    *,
    exclude: Iterable[str] = (),
    names: tuple[str, str] = ("A", "B"),
) -> StateComparison:
    """Compare the saved state of manifests ``a`` and ``b``: every component's skeleton,
    tensors by their entries. Equal fingerprints stand for equal bits only within one
    fingerprint format (the caller checks ``fingerprint_algorithm``).

    Args:
        a: a manifest (format/manifest.read).
        b: another.
        exclude: components to leave out (the resume test reports ``rng`` on its own).
        names: what to call ``a`` and ``b`` where something is only in one of them.

    Example::

        found = compare_state(doc_a, doc_b, names=("straight", "resumed"))
        found.lines  # ["scheduler/last_epoch: 80 vs 128", ...]
    """
    skip = set(exclude)
    same_world = a["world_size"] == b["world_size"]
    tables = (a["tensors"], b["tensors"])
    out: dict[str, list[str]] = {}
    left_out: list[str] = []
    count = 0
    for name in dict.fromkeys([*a["components"], *b["components"]]):
        if name in skip:
            continue
        ca, cb = a["components"].get(name), b["components"].get(name)
        if ca is None or cb is None:
            out[name] = [f"{name}: only in the {names[0] if cb is None else names[1]} run"]
            continue
        if (ca.get("per_rank") or cb.get("per_rank")) and not same_world:
            left_out.append(name)
            continue
        sa, sb = skeletons(a, name), skeletons(b, name)
        count += sum(len(tensor_keys(s)) for s in sa)
        found = skeleton_differences(sa, sb, name, tables=tables, names=names)
        if found:
            out[name] = found
    values = sum(1 for lines in out.values() for line in lines if _VALUES_ONLY in line)
    return StateComparison(out, count, left_out, values)


def skeleton_differences(
    a: list[Any],
    b: list[Any],
    name: str,
    *,
    tables: Tables | None = None,
    names: tuple[str, str] = ("A", "B"),
) -> list[str]:
    """Paths where a component's saved state differs, each with both values.

    ``a`` and ``b`` are the component's skeletons (one, or one per rank). With ``tables``
    (the two manifests' ``tensors``), tensor references compare by dtype, shape and
    fingerprint; without, they count as equal.
    """
    if len(a) != len(b):
        return [f"{name}: saved by {len(a)} vs {len(b)} rank(s)"]
    out: list[str] = []
    for i, (sa, sb) in enumerate(zip(a, b, strict=True)):
        path = name if len(a) == 1 else f"{name}/rank {i}"
        _walk(sa, sb, path, out, tables, names)
    return out


def same_leaf(a: Any, b: Any) -> bool:
    """Whether two skeleton leaves (JSON scalars, or tagged non-finite floats) are the
    same value: floats by their bits, everything else by JSON type and value."""
    fa, fb = _as_float(a), _as_float(b)
    if fa is not None or fb is not None:
        return fa is not None and fb is not None and bitwise.same_float(fa, fb)
    return _kind(a) is _kind(b) and a == b


def _walk(
    a: Any, b: Any, path: str, out: list[str], tables: Tables | None, names: tuple[str, str]
) -> None:
    if _is_ref(a) or _is_ref(b):
        if _is_ref(a) and _is_ref(b):
            for field in dict.fromkeys([*a, *b]):  # besides the key: requires_grad
                if field not in (TAG, "key") and not same_leaf(a.get(field), b.get(field)):
                    out.append(f"{path}: {field} {a.get(field)} vs {b.get(field)}")
            if tables is not None:
                found = _tensor_difference(a["key"], b["key"], tables)
                if found:
                    out.append(f"{path}: {found}")
            return
        out.append(f"{path}: {_short(a)} vs {_short(b)}")
        return
    if _is_container(a) and _is_container(b) and type(a) is type(b):
        if isinstance(a, dict):
            for k in dict.fromkeys([*a, *b]):
                if k not in a or k not in b:
                    out.append(f"{path}/{k}: only in {names[0] if k in a else names[1]}")
                else:
                    _walk(a[k], b[k], f"{path}/{k}" if k != TAG else path, out, tables, names)
            return
        if len(a) == len(b):
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                _walk(x, y, f"{path}/{i}", out, tables, names)
            return
        out.append(f"{path}: {len(a)} vs {len(b)} items")
        return
    if not same_leaf(a, b):
        out.append(f"{path}: {_short(a)} vs {_short(b)}")


def _tensor_difference(key_a: str, key_b: str, tables: Tables) -> str | None:
    ea, eb = tables[0].get(key_a), tables[1].get(key_b)
    if ea is None or eb is None:
        return f"a reference to an unlisted tensor ({key_a if ea is None else key_b})"
    for field in ("dtype", "shape", "fingerprint"):
        # Strings and lists of ints: equality is the bits' equality.
        if ea.get(field) != eb.get(field):
            what = _VALUES_ONLY if field == "fingerprint" else f"differs ({field}"
            return f"{what} {ea.get(field)} vs {eb.get(field)})"
    return None


_VALUES_ONLY = "differs (fingerprint"  # how a difference of a tensor's values alone reads


def _as_float(x: Any) -> float | None:
    """A float leaf as a float (a tagged non-finite one too); None for anything else."""
    if isinstance(x, float):
        return x
    if isinstance(x, dict) and x.get(TAG) == "float" and isinstance(x.get("repr"), str):
        try:
            return float(x["repr"])
        except ValueError:
            return None
    return None


def _kind(x: Any) -> type:
    for kind in (bool, int, float, str):  # bool before int: True is not 1
        if isinstance(x, kind):
            return kind
    return type(x)


def _is_container(x: Any) -> bool:
    return isinstance(x, dict | list) and _as_float(x) is None


def _is_ref(x: Any) -> bool:
    return isinstance(x, dict) and x.get(TAG) == "tensor"


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."


def difference(saved: Any, live: Any, path: str) -> str | None:
    """Where two skeletons first differ (``path/...`` with both values), or None.

    Exact where JSON is: ``bool``, ``int``, ``float`` and ``str`` are told apart, floats
    compare by the one rule of ``bitwise.same_float`` (``0.0`` is not ``-0.0``),
    lists (and with them the items of every tagged container) compare in order. The member order of a JSON object is not
    compared: manifests written before the container tags sorted it. Tensor references
    compare by key and requires_grad (the values are compared elsewhere, by bits).
    """
    if _json_kind(saved) is not _json_kind(live):
        return f"{path} (saved {saved!r}, live {live!r})"
    if isinstance(saved, dict):
        grad = _requires_grad(saved), _requires_grad(live)
        if grad[0] != grad[1]:
            return f"{path} (saved requires_grad={grad[0]}, live requires_grad={grad[1]})"
        if set(saved) != set(live):
            return f"{path} (saved keys {sorted(saved, key=str)}, live {sorted(live, key=str)})"
        for k in saved:
            found = difference(saved[k], live[k], f"{path}/{k}")
            if found is not None:
                return found
        return None
    if isinstance(saved, list):
        if len(saved) != len(live):
            return f"{path} (saved {len(saved)} items, live {len(live)})"
        for i, (x, y) in enumerate(zip(saved, live, strict=True)):
            found = difference(x, y, f"{path}/{i}")
            if found is not None:
                return found
        return None
    same = bitwise.same_float(saved, live) if isinstance(saved, float) else saved == live
    return None if same else f"{path} (saved {saved!r}, live {live!r})"


def _requires_grad(node: dict) -> bool | None:
    """A tensor reference's requires_grad (None for any other node)."""
    return node.get("requires_grad") is True if node.get(TAG) == "tensor" else None


def _json_kind(value: Any) -> type:
    for kind in (bool, int, float, str, dict, list):
        if isinstance(value, kind):
            return kind
    return type(value)
