"""Compare two committed checkpoints tensor by tensor, across any world sizes.

Logical tensors are compared, not shards, so a checkpoint saved on 2 ranks and the same
state saved from 1 process compare equal. Equal fingerprints (layout-independent) stand
for equal values unless ``full=True``; otherwise both tensors are read (checksums
verified) and compared bit for bit, with the largest absolute difference reported.
Per-rank components (rng, dataloader) are compared rank by rank when the world sizes
match and are skipped (and listed) when they do not; the RNG state is also summarized
one generator at a time (python random, numpy, torch CPU/CUDA: same or differs).
Non-tensor state (hyperparameters, scheduler counters) is compared too. Keys are sorted
naturally: ``layers.2`` before ``layers.10``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch

from ..format import manifest
from ..format.tensor_reader import TensorReader
from ..proof.generators import differing, label
from ..storage.locate import location
from .inspection import component_skeletons, tensor_components

Status = Literal["equal", "values", "dtype", "shape", "only_a", "only_b"]
_BLOCK = 1 << 20  # elements compared at once, to bound the float64 working copies
_TAG = "__ub__"


@dataclasses.dataclass
class TensorDiff:
    key: str
    component: str | None
    status: Status
    dtype_a: str | None = None
    dtype_b: str | None = None
    shape_a: list[int] | None = None
    shape_b: list[int] | None = None
    differing: int | None = None  # elements whose bits differ
    max_abs_diff: float | None = None  # nan if a NaN meets a number


@dataclasses.dataclass
class ComponentSummary:
    name: str
    status: Literal["identical", "different", "only_a", "only_b", "skipped"]
    equal: int = 0
    different: int = 0
    only_a: int = 0
    only_b: int = 0
    state_differences: list[str] = dataclasses.field(default_factory=list)
    note: str = ""


@dataclasses.dataclass
class GeneratorDiff:
    """One random number generator of the ``rng`` component, on one rank."""

    rank: int
    generator: str  # python, numpy, torch, cuda
    label: str  # "torch CPU", "numpy (rank 1)", ...
    status: Literal["same", "differs"]


@dataclasses.dataclass
class DiffReport:
    a: dict[str, Any]
    b: dict[str, Any]
    tensors: list[TensorDiff]
    components: list[ComponentSummary]
    rng: list[GeneratorDiff] = dataclasses.field(default_factory=list)  # when compared

    @property
    def identical(self) -> bool:
        return all(c.status in ("identical", "skipped") for c in self.components) and all(
            t.status == "equal" for t in self.tensors
        )


def _meta(folder: Path, doc: dict[str, Any]) -> dict[str, Any]:
    return {"path": str(folder), "step": doc["step"], "world_size": doc["world_size"]}


def diff(
    a: str | Path,
    b: str | Path,
    *,
    full: bool = False,
    ignore: frozenset[str] = frozenset(),
    on_tensor: Callable[[], None] | None = None,
) -> DiffReport:
    """Compare the committed checkpoints in step folders ``a`` and ``b``.

    Args:
        full: read and compare every tensor even where fingerprints agree.
        ignore: component names left out of the comparison.
        on_tensor: called once per tensor compared (progress).
    Raises:
        CorruptCheckpointError: a manifest or a chunk that must be read is damaged.
    """
    a, b = location(a), location(b)
    doc_a, doc_b = manifest.read(a), manifest.read(b)
    same_world = doc_a["world_size"] == doc_b["world_size"]
    owner_a, owner_b = tensor_components(doc_a), tensor_components(doc_b)
    names = list(dict.fromkeys([*doc_a["components"], *doc_b["components"]]))
    summaries: dict[str, ComponentSummary] = {}
    skip = set(ignore)
    for name in names:
        ca, cb = doc_a["components"].get(name), doc_b["components"].get(name)
        if name in ignore:
            summaries[name] = ComponentSummary(name, "skipped", note="ignored on request")
        elif ca is None or cb is None:
            summaries[name] = ComponentSummary(name, "only_a" if cb is None else "only_b")
        elif (ca.get("per_rank") or cb.get("per_rank")) and not same_world:
            skip.add(name)
            summaries[name] = ComponentSummary(
                name,
                "skipped",
                note=f"per-rank state of {doc_a['world_size']} vs {doc_b['world_size']} "
                "rank(s): not comparable",
            )
        else:
            summaries[name] = ComponentSummary(name, "identical")
            summaries[name].state_differences = _state_differences(
                component_skeletons(doc_a, name), component_skeletons(doc_b, name), name
            )
    rows: list[TensorDiff] = []
    # Equal fingerprints mean equal values only within one fingerprint format.
    same_format = manifest.fingerprint_algorithm(doc_a) == manifest.fingerprint_algorithm(doc_b)
    trust_prints = not full and same_format
    keys = sorted(set(doc_a["tensors"]) | set(doc_b["tensors"]), key=natural_key)
    with TensorReader(a, doc_a) as ra, TensorReader(b, doc_b) as rb:
        for key in keys:
            comp = owner_a.get(key) or owner_b.get(key)
            if comp in skip or (comp in summaries and summaries[comp].status == "skipped"):
                continue
            rows.append(_compare(key, comp, doc_a, doc_b, ra, rb, trust_prints))
            if on_tensor is not None:
                on_tensor()
    for row in rows:
        s = summaries.get(row.component or "")
        if s is None:
            continue
        if row.status == "equal":
            s.equal += 1
        elif row.status == "only_a":
            s.only_a += 1
        elif row.status == "only_b":
            s.only_b += 1
        else:
            s.different += 1
    for s in summaries.values():
        if s.status == "identical" and (s.different or s.only_a or s.only_b or s.state_differences):
            s.status = "different"
    rng = []
    if "rng" in summaries and summaries["rng"].status not in ("skipped", "only_a", "only_b"):
        ws = doc_b["world_size"]
        rng = [GeneratorDiff(r, g, label(r, g, ws), "differs" if d else "same")
               for (r, g), d in differing(doc_a, doc_b).items()]  # fmt: skip
    return DiffReport(_meta(a, doc_a), _meta(b, doc_b), rows, list(summaries.values()), rng)


def natural_key(text: str) -> list[Any]:
    """Sort key putting ``layers.2`` before ``layers.10`` (digit runs compare as numbers)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def _compare(key, comp, doc_a, doc_b, ra, rb, trust_prints) -> TensorDiff:
    ea, eb = doc_a["tensors"].get(key), doc_b["tensors"].get(key)
    if ea is None:
        return TensorDiff(key, comp, "only_b", dtype_b=eb["dtype"], shape_b=eb["shape"])
    if eb is None:
        return TensorDiff(key, comp, "only_a", dtype_a=ea["dtype"], shape_a=ea["shape"])
    row = TensorDiff(key, comp, "equal", ea["dtype"], eb["dtype"], ea["shape"], eb["shape"])
    if ea["shape"] != eb["shape"]:
        row.status = "shape"
        return row
    if ea["dtype"] != eb["dtype"]:
        row.status = "dtype"
        row.max_abs_diff = _max_abs_diff(ra.read(key), rb.read(key), None)
        return row
    fp_a = ea.get("fingerprint")
    if trust_prints and fp_a and fp_a == eb.get("fingerprint"):
        row.differing, row.max_abs_diff = 0, 0.0
        return row
    ta, tb = ra.read(key), rb.read(key)
    differs = _bits_differ(ta, tb)
    row.differing = int(differs.sum())
    row.max_abs_diff = _max_abs_diff(ta, tb, differs) if row.differing else 0.0
    if row.differing:
        row.status = "values"
    return row


def _bits_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per element: do the stored bits differ? (NaN == NaN when the bits are the same.)"""
    n, size = a.numel(), a.element_size()
    if n == 0:
        return torch.zeros(0, dtype=torch.bool)
    ba = a.reshape(-1).view(torch.uint8).view(n, size)
    bb = b.reshape(-1).view(torch.uint8).view(n, size)
    return (ba != bb).any(dim=1)


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None) -> float:
    fa, fb = a.reshape(-1), b.reshape(-1)
    worst = 0.0
    for start in range(0, fa.numel(), _BLOCK):
        xa, xb = _as_number(fa[start : start + _BLOCK]), _as_number(fb[start : start + _BLOCK])
        d = (xa - xb).abs()
        if mask is not None:
            d = d[mask[start : start + _BLOCK]]
        if d.numel():
            if torch.isnan(d).any():
                return math.nan
            worst = max(worst, float(d.max()))
    return worst


def _as_number(t: torch.Tensor) -> torch.Tensor:
    if t.is_complex():
        return t.to(torch.complex128)
    return t.to(torch.float64)


def _state_differences(a: list[Any], b: list[Any], name: str) -> list[str]:
    """Paths where the non-tensor state differs (tensor references count as equal)."""
    out: list[str] = []
    if len(a) != len(b):
        return [f"{name}: saved by {len(a)} vs {len(b)} rank(s)"]
    for i, (sa, sb) in enumerate(zip(a, b, strict=True)):
        _walk(sa, sb, name if len(a) == 1 else f"{name}/rank {i}", out)
    return out


def _walk(a: Any, b: Any, path: str, out: list[str]) -> None:
    if _is_ref(a) and _is_ref(b):
        return
    if isinstance(a, dict) and isinstance(b, dict) and not _is_ref(a) and not _is_ref(b):
        for k in list(dict.fromkeys([*a, *b])):
            if k not in a or k not in b:
                out.append(f"{path}/{k}: only in {'A' if k in a else 'B'}")
            else:
                _walk(a[k], b[k], f"{path}/{k}" if k != _TAG else path, out)
        return
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _walk(x, y, f"{path}/{i}", out)
        return
    if a != b:
        out.append(f"{path}: {_short(a)} vs {_short(b)}")


def _is_ref(x: Any) -> bool:
    return isinstance(x, dict) and x.get(_TAG) == "tensor"


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."
