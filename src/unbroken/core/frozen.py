"""Trainable-only checkpoints (``frozen="verify"``): the frozen base proven by fingerprint.

At a save, every frozen parameter (live/frozen.py says which count) is fingerprinted
where it lives, the same layout-independent fingerprint a saved tensor gets. The run's
first such save records each one's fingerprint as the base; a frozen parameter still
equal to its base is left out of the files and listed in the manifest's ``frozen``
record (``stored: false``). One that differs (an in-place edit, an EMA written into it)
is saved in full, at that save and every later one, with a warning at the save where the
change is first seen; one frozen since the base was recorded (progressive freezing:
trained before, its base value unknown) is saved in full without one.

At a restore, before a byte of the checkpoint is read, each left-out parameter of the
live model is checked against its record: dtype, shape, then fingerprint. Any difference
refuses the restore, on every rank alike, naming the parameters; nothing live changed.
While the restore runs, the model's captures leave those parameters out, so they keep
their live (verified) values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, NamedTuple

from torch.distributed.tensor import DTensor

from ..errors import CheckpointError, StateMismatchError
from ..format import fingerprint, manifest, tree
from ..live import frozen
from ..live.state import Component, ModelComponent, listing
from . import collective, verify

Record = dict[str, Any]  # dtype, shape, fingerprint (the manifest adds "stored")


class Share(NamedTuple):
    """This rank's part of one frozen parameter's fingerprint."""

    dtype: str
    shape: list[int]
    held: int | None  # the share of the values held here (a whole tensor's: all of them)
    instance: int | None  # a sharded tensor's mesh instance (verify.instance); whole: None
    counted: bool  # whether this rank's share counts in the fingerprint


def verifying(components: list[Component]) -> list[ModelComponent]:
    """The model components saved with ``frozen="verify"``."""
    return [c for c in components if isinstance(c, ModelComponent) and c.frozen_mode == "verify"]


def shares(
    c: ModelComponent, keys: set[str], algorithm: str, state: Any = None
) -> dict[str, Share]:
    """This rank's share of the fingerprint of each of ``c``'s tensors named in ``keys``
    (those it has; ``state``: a full capture, else a new one)."""
    out: dict[str, Share] = {}
    for key, t in c.frozen_tensors(keys, state).items():
        dtype, shape = manifest.dtype_name(t.dtype), list(t.shape)
        held = verify.held_partial(t, algorithm, key)
        if isinstance(t, DTensor):
            counted = held is not None and verify.counted_here(t, key)
            out[key] = Share(dtype, shape, held, verify.instance(t), counted)
        else:
            out[key] = Share(dtype, shape, held, None, True)
    return out


def fingerprints(
    per_rank: list[dict[str, Share]], *, strict: bool = True
) -> dict[str, Record | None]:
    """Each tensor's record (dtype, shape, fingerprint) from every rank's :func:`shares`:
    None for a whole tensor whose ranks hold different values, unless ``strict``.

    Raises:
        CheckpointError: ``strict`` and a whole (not sharded) frozen parameter holds
            different values on different ranks: no one value of it could be verified.
    """
    meta: dict[str, tuple[str, list[int]]] = {}
    whole: dict[str, dict[int, list[int]]] = {}  # key -> partial -> the ranks holding it
    sharded: list[dict[str, tuple[int, int | None]]] = []
    for r, mine in enumerate(per_rank):
        counted = {}
        for key, share in mine.items():
            meta.setdefault(key, (share.dtype, share.shape))
            if share.instance is None and share.held is not None:
                whole.setdefault(key, {}).setdefault(share.held, []).append(r)
            elif share.counted and share.held is not None:
                counted[key] = (share.held, share.instance)
        sharded.append(counted)
    differ = {key: seen for key, seen in whole.items() if len(seen) > 1}
    if differ and strict:
        shown = "; ".join(
            f"{key}: " + " vs ".join(f"ranks {ranks}" for ranks in seen.values())
            for key, seen in list(differ.items())[:5]
        )
        raise CheckpointError(
            f"{len(differ)} frozen parameter(s) hold different values on different ranks "
            f"({shown}): a replicated model's ranks must hold one base. Nothing was saved; "
            'load the same base on every rank (or save with frozen="save")'
        )
    fps: dict[str, str | None] = dict(verify.combine(sharded))
    for key, seen in whole.items():
        fps[key] = None if key in differ else fingerprint.combine([next(iter(seen))])
    out: dict[str, Record | None] = {}
    for key, (dtype, shape) in meta.items():
        fp = fps.get(key)
        out[key] = None if fp is None else {"dtype": dtype, "shape": shape, "fingerprint": fp}
    return out


# -- save ---------------------------------------------------------------------------------


def decide(c: ModelComponent, current: dict[str, Record]) -> tuple[set[str], dict, str]:
    """What this save leaves out of ``c`` (tensor keys), its manifest ``frozen`` records,
    and a warning ("" if none); updates ``c.base``. ``current``: the frozen parameters'
    records now (:func:`fingerprints`)."""
    base = c.base or frozen.Base(entries=dict(current), previous={})
    omit: set[str] = set()
    records: dict[str, Record] = {}
    changed = []
    for key, now in current.items():
        if key in base.previous and base.previous[key] != now["fingerprint"]:
            changed.append(key)
        first = base.entries.get(key)
        if first is None:  # trained before it was frozen: its base value is unknown
            continue
        stored = first != now
        records[key] = {**first, "stored": stored}
        if not stored:
            omit.add(key)
    c.base = frozen.Base(
        entries={key: base.entries[key] for key in records},
        previous={key: now["fingerprint"] for key, now in current.items()},
    )
    warning = ""
    if changed:
        warning = (
            f"{len(changed)} frozen parameter(s) changed since the previous save (an in-place "
            "edit, an EMA written into them, memory shared with a trainable one): "
            f"{listing(sorted(changed))}. They are saved in full in this checkpoint and every "
            "later one, since the base a resume loads no longer holds their values"
        )
    return omit, records, warning


def without(c: ModelComponent, state: Any, omit: set[str]) -> Any:
    """``c``'s captured ``state`` without the keys in ``omit``."""
    return frozen.without(state, omit, c.name, None not in c.models)


# -- restore ------------------------------------------------------------------------------


class BaseCheck(NamedTuple):
    """What :func:`check_base` found, for the rest of the restore."""

    omit: dict[ModelComponent, frozenset[str]]  # keys left out of captures meanwhile
    held: dict[str, int | None]  # this rank's share of each checked tensor (first step)
    before: dict[str, Record | None]  # the live frozen parameters' records before install


def _records(doc: dict[str, Any], c: Component) -> dict[str, Record]:
    prefix = tree.join_key(c.name) + "/"
    return {k: r for k, r in (doc.get("frozen") or {}).items() if k.startswith(prefix)}


def check_base(doc: dict[str, Any], active: list[Component], folder: object) -> BaseCheck:
    """Check the live frozen parameters the checkpoint left out against its records, and
    fingerprint the frozen parameters of ``frozen="verify"`` models (their base for the
    run's next saves), on every rank alike: one gathering round, only if there are any.

    Raises:
        StateMismatchError: a left-out parameter is missing, or its dtype, shape or
            values differ from the record; nothing live changed.
    """
    algorithm = manifest.fingerprint_algorithm(doc)
    left_out: dict[ModelComponent, dict[str, Record]] = {}
    wanted: dict[ModelComponent, set[str]] = {}
    for c in active:
        if isinstance(c, ModelComponent):
            left_out[c] = {k: r for k, r in _records(doc, c).items() if not r.get("stored")}
            mine = c.frozen_keys() if c.frozen_mode == "verify" and _same(algorithm) else set()
            if left_out[c] or mine:
                wanted[c] = set(left_out[c]) | mine
    if not wanted:
        return BaseCheck({}, {}, {})

    def local() -> dict[str, Share]:
        found: dict[str, Share] = {}
        for c, keys in wanted.items():
            found.update(shares(c, keys, algorithm))
        return found

    every = collective.agree_all(local)
    before = fingerprints(every, strict=False)
    problems = []
    for records in left_out.values():
        for key, record in records.items():
            problem = _differs(key, record, before.get(key), any(key in r for r in every))
            if problem is not None:
                problems.append(problem)
    if problems:
        count = sum(map(len, left_out.values()))
        raise StateMismatchError(
            f"the base model differs from the one this run was saved with: {folder} does "
            f"not store {count} frozen parameter(s) but proves them by fingerprint, and the "
            f"live model's differ: {listing(problems)}. Load the same base, revision and "
            "dtype (and freeze the same parameters) before restore(); nothing was changed"
        )
    mine = every[collective.rank()]
    held = {key: mine[key].held for rs in left_out.values() for key in rs if key in mine}
    omit = {c: frozenset(records) for c, records in left_out.items() if records}
    return BaseCheck(omit, held, before)


def _same(algorithm: str) -> bool:
    return algorithm == fingerprint.ALGORITHM


def _differs(key: str, record: Record, live: Record | None, held: bool) -> str | None:
    if live is None:
        if not held:
            return f"{key}: not a parameter of the live model"
        return f"{key}: its values differ between ranks"
    if live["dtype"] != record["dtype"]:
        return f"{key}: saved as {record['dtype']}, live {live['dtype']}"
    if live["shape"] != record["shape"]:
        return f"{key}: saved shape {tuple(record['shape'])}, live {tuple(live['shape'])}"
    if live["fingerprint"] != record["fingerprint"]:
        return f"{key}: its values differ"
    return None


@contextlib.contextmanager
def omitting(omit: dict[ModelComponent, frozenset[str]]) -> Iterator[None]:
    """Leave the given keys out of each model's captures while the block runs."""
    before = {c: c.omit for c in omit}
    for c, keys in omit.items():
        c.omit = keys
    try:
        yield
    finally:
        for c, keys in before.items():
            c.omit = keys


def adopt(doc: dict[str, Any], active: list[Component], check: BaseCheck) -> None:
    """After a restore, each ``frozen="verify"`` model's base for the run's next saves:
    a frozen parameter's base is the value the script loaded before ``restore()``
    (``check.before``) where that is the value the checkpoint proves or stores for it, or
    the checkpoint's record of its base; one trained before it was frozen has none (it is
    saved in full)."""
    for c in verifying(active):
        records = _records(doc, c) if _same(manifest.fingerprint_algorithm(doc)) else {}
        entries: dict[str, Record] = {}
        previous: dict[str, str] = {}
        for key in c.frozen_keys():
            record, saved = records.get(key), doc["tensors"].get(key)
            live = check.before.get(key)
            if record is not None and not record.get("stored"):
                now = record
            elif saved is not None:
                now = {f: saved[f] for f in ("dtype", "shape", "fingerprint")}
            else:
                continue
            previous[key] = now["fingerprint"]
            base = {f: v for f, v in record.items() if f != "stored"} if record else None
            if base is not None and (live == base or not record.get("stored")):
                entries[key] = base
            elif live is not None and live == now:
                entries[key] = now
        c.base = frozen.Base(entries=entries, previous=previous)
