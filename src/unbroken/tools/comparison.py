"""Compare two committed checkpoints tensor by tensor, across any world sizes.

Logical tensors are compared, not shards, so a checkpoint saved on 2 ranks and the same
state saved from 1 process compare equal. Equal fingerprints (layout-independent) stand
for equal values unless ``full=True``; otherwise both tensors are read (checksums
verified) and compared bit for bit, with the largest absolute difference reported.
Per-rank components (rng, dataloader) are compared rank by rank when the world sizes
match and are skipped (and listed) when they do not; the RNG state is also summarized
one generator at a time (python random, numpy, torch CPU/CUDA: same or differs).
Non-tensor state (hyperparameters, scheduler counters) is compared too, by the same
rule as the resume test's (format/state_compare.py: floats by their bits). Keys are sorted
naturally: ``layers.2`` before ``layers.10``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import re
from collections.abc import Iterable
from typing import Any, Literal
from urllib.parse import unquote

import torch

from ..format import bitwise, fingerprint, manifest, tree
from ..format.state_compare import skeleton_differences, skeletons
from ..format.tensor_reader import TensorReader
from ..proof.generators import differing, label
from ..storage.interface import Location
from ..storage.locate import location
from .contents import tensor_components
from .folders import locate
from .reporting import JsonResult, Progress, ProgressCount

Status = Literal["equal", "values", "dtype", "shape", "only_a", "only_b"]
_BLOCK = 1 << 20  # elements compared at once, to bound the float64 working copies


@dataclasses.dataclass
class TensorDiff:
    """One tensor key of either checkpoint, compared."""

    key: str  # the tensor's key, e.g. ``model/inp.weight``
    component: str | None  # the component whose state references it
    status: Status  # equal; values, dtype or shape differ; only in A; only in B
    dtype_a: str | None = None  # None where the tensor is absent
    dtype_b: str | None = None
    shape_a: list[int] | None = None
    shape_b: list[int] | None = None
    differing: int | None = None  # elements whose bits differ
    max_abs_diff: float | None = None  # nan if a NaN meets a number


@dataclasses.dataclass
class ComponentSummary:
    """One component of either checkpoint, compared."""

    name: str
    status: Literal["identical", "different", "only_a", "only_b", "skipped"]
    equal: int = 0  # tensors equal
    different: int = 0  # tensors whose values, dtype or shape differ
    only_a: int = 0  # tensors only in A
    only_b: int = 0  # tensors only in B
    state_differences: list[str] = dataclasses.field(default_factory=list)  # non-tensor
    note: str = ""  # why it was skipped


@dataclasses.dataclass
class GeneratorDiff:
    """One random number generator of the ``rng`` component, on one rank."""

    rank: int
    generator: str  # python, numpy, torch, cuda
    label: str  # "torch CPU", "numpy (rank 1)", ...
    status: Literal["same", "differs"]


@dataclasses.dataclass
class DiffReport(JsonResult):
    """What :func:`diff_checkpoints` returns (``unbroken diff --json``)."""

    JSON_PROPERTIES = ("identical",)

    a: dict[str, Any]  # checkpoint A: its ``path``, ``step`` and ``world_size``
    b: dict[str, Any]  # checkpoint B, the same
    tensors: list[TensorDiff]  # every tensor key compared, sorted naturally
    components: list[ComponentSummary]  # every component of either, A's order first
    rng: list[GeneratorDiff] = dataclasses.field(default_factory=list)  # when compared

    @property
    def identical(self) -> bool:
        """Nothing differs (components skipped aside): the command exits 0."""
        return all(c.status in ("identical", "skipped") for c in self.components) and all(
            t.status == "equal" for t in self.tensors
        )


def _meta(folder: Location, doc: dict[str, Any]) -> dict[str, Any]:
    return {"path": str(folder), "step": doc["step"], "world_size": doc["world_size"]}


def diff_checkpoints(
    a: str | os.PathLike,
    b: str | os.PathLike,
    *,
    full: bool = False,
    ignore: Iterable[str] = (),
    progress: Progress | None = None,
) -> DiffReport:
    """Compare two checkpoints tensor by tensor, across any world sizes (``unbroken diff``).

    Logical tensors are compared, not shards: a checkpoint saved on 2 ranks equals the
    same state saved from 1 process. Equal fingerprints count as equal values unless
    ``full``; otherwise both tensors are read (checksums verified) and compared bit for
    bit. Per-rank components (rng, dataloader) are compared rank by rank when the world
    sizes match, else skipped (and listed). Non-tensor state is compared too.

    Args:
        a: a step folder, or a run folder meaning its latest step (local or a URL).
        b: the same, for the other checkpoint.
        full: read and compare every tensor even where fingerprints agree.
        ignore: component names to leave out (e.g. ``{"rng"}``).
        progress: called with (tensors compared, tensors to compare).

    Returns:
        :class:`DiffReport`; ``identical`` says whether anything differs.

    Raises:
        CheckpointNotFoundError: ``a`` or ``b`` holds no committed checkpoint.
        CorruptCheckpointError: a manifest, or a chunk that must be read, is damaged.

    Example::

        report = ub.diff_checkpoints("ckpts/run1", "ckpts/run2", ignore={"rng"})
        print(report.identical, [t.key for t in report.tensors if t.status != "equal"])
    """
    return diff(locate(a), locate(b), full=full, ignore=ignore, progress=progress)


def diff(
    a: str | os.PathLike | Location,
    b: str | os.PathLike | Location,
    *,
    full: bool = False,
    ignore: Iterable[str] = (),
    progress: Progress | None = None,
) -> DiffReport:
    """Compare the committed checkpoints in step folders ``a`` and ``b`` (see
    :func:`diff_checkpoints`, which also takes run folders).

    Raises:
        CorruptCheckpointError: a manifest or a chunk that must be read is damaged.
    """
    a, b, ignore = location(a), location(b), frozenset(ignore)
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
            summaries[name].state_differences = skeleton_differences(
                _with_frozen(doc_a, name), _with_frozen(doc_b, name), name
            )
    # Equal fingerprints mean equal values only within one fingerprint format.
    same_format = manifest.fingerprint_algorithm(doc_a) == manifest.fingerprint_algorithm(doc_b)
    trust_prints = not full and same_format
    keys = []
    every = {*doc_a["tensors"], *doc_b["tensors"], *_left_out(doc_a), *_left_out(doc_b)}
    for key in sorted(every, key=natural_key):
        comp = owner_a.get(key) or owner_b.get(key) or key.split("/", 1)[0]
        if comp not in skip and not (comp in summaries and summaries[comp].status == "skipped"):
            keys.append((key, comp))
    count = ProgressCount(progress, len(keys))
    rows: list[TensorDiff] = []
    with TensorReader(a, doc_a) as ra, TensorReader(b, doc_b) as rb:
        for key, comp in keys:
            rows.append(_compare(key, comp, doc_a, doc_b, ra, rb, trust_prints))
            count()
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
        rng = [
            GeneratorDiff(r, g, label(r, g, ws), "differs" if d else "same")
            for (r, g), d in differing(doc_a, doc_b).items()
        ]
    return DiffReport(_meta(a, doc_a), _meta(b, doc_b), rows, list(summaries.values()), rng)


def natural_key(text: str) -> list[Any]:
    """Sort key putting ``layers.2`` before ``layers.10`` (digit runs compare as numbers)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def _left_out(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The frozen parameters a checkpoint proves by fingerprint instead of storing."""
    return {k: r for k, r in (doc.get("frozen") or {}).items() if not r.get("stored")}


def _with_frozen(doc: dict[str, Any], name: str) -> list[Any]:
    """Component ``name``'s skeletons, with a reference for each frozen parameter left
    out of the files (the live model holds it; a full save would list it there)."""
    found = skeletons(doc, name)
    prefix = tree.join_key(name) + "/"
    missing = [k for k in _left_out(doc) if k.startswith(prefix)]
    if not missing or len(found) != 1 or not isinstance(found[0], dict):
        return found
    state = copy.deepcopy(found[0])
    for key in missing:
        *models, fqn = [unquote(part) for part in key[len(prefix) :].split("/")]
        place = state
        for model in models:
            place = place.setdefault(model, {})
        place[fqn] = {tree.TAG: "tensor", "key": key}
    return [state]


def _compare(key, comp, doc_a, doc_b, ra, rb, trust_prints) -> TensorDiff:
    stored_a, stored_b = doc_a["tensors"].get(key), doc_b["tensors"].get(key)
    ea = stored_a or _left_out(doc_a).get(key)
    eb = stored_b or _left_out(doc_b).get(key)
    if ea is None:
        return TensorDiff(key, comp, "only_b", dtype_b=eb["dtype"], shape_b=eb["shape"])
    if eb is None:
        return TensorDiff(key, comp, "only_a", dtype_a=ea["dtype"], shape_a=ea["shape"])
    row = TensorDiff(key, comp, "equal", ea["dtype"], eb["dtype"], ea["shape"], eb["shape"])
    proven = stored_a is None or stored_b is None  # a frozen base proven, not stored
    if ea["shape"] != eb["shape"]:
        row.status = "shape"
        return row
    if ea["dtype"] != eb["dtype"]:
        row.status = "dtype"
        if not proven:
            row.max_abs_diff = _max_abs_diff(ra.read(key), rb.read(key), None)
        return row
    if proven:
        if _proven_fingerprints(key, doc_a, doc_b, ra, rb):
            row.differing, row.max_abs_diff = 0, 0.0
        else:
            row.status = "values"  # how many elements differ is not known
        return row
    fp_a = ea.get("fingerprint")
    if trust_prints and fp_a and fp_a == eb.get("fingerprint"):
        row.differing, row.max_abs_diff = 0, 0.0
        return row
    ta, tb = ra.read(key), rb.read(key)
    differs = bitwise.differing(ta, tb)
    row.differing = int(differs.sum())
    row.max_abs_diff = _max_abs_diff(ta, tb, differs) if row.differing else 0.0
    if row.differing:
        row.status = "values"
    return row


def _proven_fingerprints(key, doc_a, doc_b, ra, rb) -> bool:
    """Whether a tensor that one checkpoint (or both) proves by fingerprint instead of
    storing has the same fingerprint in both, in the prover's format (a stored side is
    fingerprinted again where its own manifest's format is another)."""
    prover, other, read = (doc_a, doc_b, ra) if key not in doc_a["tensors"] else (doc_b, doc_a, rb)
    algorithm = manifest.fingerprint_algorithm(prover)
    proved = prover["frozen"][key]["fingerprint"]
    entry = other["tensors"].get(key) or other["frozen"][key]
    if manifest.fingerprint_algorithm(other) == algorithm:
        return entry["fingerprint"] == proved
    if key not in other["tensors"]:
        return False  # both proven, in two formats: nothing to compare them by
    return fingerprint.fingerprint(read.read(key), algorithm) == proved


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
