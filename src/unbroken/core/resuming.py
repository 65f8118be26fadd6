"""Which checkpoint a restore loads: the newest sound one, an explicit step, or none.

The steps are tried newest first (:class:`Candidates`) and listed again when a
concurrent save prunes, retires or re-saves the one being read: a training job saving
into the folder (with ``keep_last``) while another process restores from it is normal
use, and a step that vanishes under a reader is no damage (docs/reliability.md).

A damaged checkpoint is detected before any live object changes, so an older one is
tried (and named in the report). A fresh start says where it looked and what it found
there, so a typo in the path or a folder written by another tool is visible; with
``require`` (or ``UNBROKEN_REQUIRE_CHECKPOINT=1``) it is an error instead.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Iterator
from typing import Any

from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ..format.folder_check import check_folder
from ..format.manifest import NotAManifestError
from ..live import probe
from ..live.state import Component
from ..report import RestoreReport
from ..storage.interface import CheckpointDir, Location
from ..storage.names import LOCK, MANIFEST, RUN_LOCK, folder_step
from . import collective, restoring

logger = logging.getLogger(__name__)

REQUIRE_ENV = "UNBROKEN_REQUIRE_CHECKPOINT"
_OURS = {LOCK, RUN_LOCK, "metrics.jsonl", "metrics"}  # metrics/: the record on a store
_SHOWN = 5
MAX_RELISTS = 100  # how often checkpoints may vanish while one restore() reads them
_HEAD = 64  # bytes of a manifest read to tell garbage from a manifest


@dataclasses.dataclass
class Resumed:
    """What :func:`resume` did: the report, and the manifest and step it loaded (None on
    a fresh start)."""

    report: RestoreReport
    doc: dict[str, Any] | None = None
    step: int | None = None
    installed: dict[str, int | None] | None = None  # restoring.Restored's, when loaded
    algorithm: str | None = None


def require_from_env(require: bool | None) -> bool:
    """``require`` as given, else from ``UNBROKEN_REQUIRE_CHECKPOINT`` (1/true/yes)."""
    if require is not None:
        return bool(require)
    raw = os.environ.get(REQUIRE_ENV, "").strip().lower()
    if raw in ("", "0", "false", "no"):
        return False
    if raw in ("1", "true", "yes"):
        return True
    raise ValueError(f"{REQUIRE_ENV}={raw!r}: use 1 (a checkpoint is required) or 0")


def resume(
    ckdir: CheckpointDir,
    components: list[Component],
    *,
    step: int | None,
    reset: set[str],
    skip: set[str],
    require: bool,
    ignore: bool,
    probe_fn: probe.Probe | None,
    model: Any,
) -> Resumed:
    """Restore the newest sound checkpoint (or ``step``) into ``components``; collective.

    ``ignore``: the committed checkpoints belong to a run being replaced (a fresh start).

    Raises:
        ValueError: ``reset`` names a component that was not passed, or ``skip`` one
            that was (before anything is read).
    """
    names = check_names(components, reset, skip)
    world = collective.world_size()
    candidates = [] if ignore else Candidates(ckdir, step)  # re-listed
    skipped = lost_manifests(ckdir)  # damaged folders, named in the report
    if not candidates:
        found, foreign = collective.on_rank0(lambda: _look(ckdir))
        if ignore:
            found = f"{found}; its committed checkpoints are ignored (overwrite=True)"
        if require:
            raise CheckpointNotFoundError(
                f"a checkpoint is required ({REQUIRE_ENV} or restore(require=True)) but "
                f"there is none to restore: {found}. Check the path"
            )
        if foreign:
            skipped.append(f"fresh start although {found}")
        report = RestoreReport(
            world_size=world,
            components={n: "absent" for n in names},
            warnings=skipped,
            searched=str(ckdir.root),
            found=found,
        )
        return Resumed(report)
    request = restoring.RestoreRequest(reset, skip, probe_fn, model)
    damaged: list[tuple[int, str]] = []  # (step, why), newest first
    for chosen in candidates:
        folder = candidates.folder(chosen)
        garbage: str | None = None
        try:
            garbage = collective.on_rank0(functools.partial(not_a_manifest, folder))
            if garbage:
                raise CorruptCheckpointError(garbage)
            doc, notes = read_manifest(folder)
            restored = restoring.restore(folder, doc, components, request)
            report = restored.report
        except CorruptCheckpointError as exc:
            junk = bool(garbage) or isinstance(exc, NotAManifestError)
            if candidates.relisted(garbage=junk):  # pruned or re-saved meanwhile
                continue
            # Damage is found before any live object is touched, so an older checkpoint
            # can be tried. An explicitly requested step never falls back.
            if step is not None:
                raise
            damaged.append((chosen, str(exc)))
            if not candidates:
                raise CorruptCheckpointError(
                    f"no committed checkpoint in {ckdir.root} is sound: "
                    + "; ".join(skipped + skipped_text(damaged, ckdir.root))
                ) from exc
            if len(damaged) <= _SHOWN:  # the rest in one line, once one is sound
                logger.warning("checkpoint of step %d is damaged, trying an older one", chosen)
            continue
        if len(damaged) > _SHOWN:
            logger.warning("%s", skipped_text(damaged, ckdir.root)[-1])
        report.warnings[:0] = skipped + skipped_text(damaged, ckdir.root) + notes
        report.warnings.extend(  # what its save found (run/idle_optimizers.py)
            f"the checkpoint of step {chosen} was saved with a warning: {w}"
            for w in doc.get("save_warnings") or []
        )
        report = dataclasses.replace(report, searched=str(ckdir.root), source="persistent")
        return Resumed(report, doc, chosen, restored.installed, restored.algorithm)
    raise AssertionError("unreachable")


def check_names(components: list[Component], reset: set[str], skip: set[str]) -> list[str]:
    """The components' names, once ``reset`` and ``skip`` are found to make sense.

    Raises:
        ValueError: ``reset`` names a component that was not passed, or ``skip`` one
            that was.
    """
    names = [c.name for c in components]
    unknown = sorted(reset - set(names))
    if unknown:
        raise ValueError(f"reset names unknown component(s) {unknown}; known: {names}")
    passed = sorted(skip & set(names))
    if passed:
        raise ValueError(
            f"skip names {passed}, which were passed to the Checkpointer: use reset= to "
            "start them fresh"
        )
    return names


def skipped_text(damaged: list[tuple[int, str]], root: Location) -> list[str]:
    """The report's lines for the damaged checkpoints a restore skipped, (step, why) newest
    first: each of the first few, then one line for the rest (a prefix holding 1,000 junk
    newer ``step_*`` folders gives six lines, not a thousand)."""
    lines = [f"skipped the damaged checkpoint of step {s}: {why}" for s, why in damaged[:_SHOWN]]
    rest = damaged[_SHOWN:]
    if rest:
        junk = sum("is not an unbroken manifest" in why for _, why in rest)
        steps = sorted(s for s, _ in rest)
        lines.append(
            f"skipped {len(rest)} more damaged checkpoint(s), steps {steps[0]} to "
            f"{steps[-1]} ({junk} of them hold no unbroken manifest at all): `unbroken "
            f"inspect {root}` lists each with its reason; remove the ones that are junk"
        )
    return lines


def read_manifest(folder: Location) -> tuple[dict[str, Any], list[str]]:
    """Rank 0 checks the folder (``format.folder_check``); every rank gets the manifest
    and the notes of its reading (a manifest read wrong once, then sound)."""

    def check() -> tuple[dict[str, Any], list[str]]:
        notes: list[str] = []
        return check_folder(folder, notes), notes

    return collective.on_rank0(check)


def not_a_manifest(folder: Location) -> str | None:
    """Why ``folder``'s manifest is garbage, judged by its first bytes (one small read:
    every manifest is a JSON object of more than ``_HEAD`` bytes), or None (it may be
    one: read it whole). So junk ``step_*/manifest.json`` keys that do not begin like a
    manifest cost one request each, however large they are."""
    path = folder / MANIFEST
    try:
        reader = path.open_chunks()
        try:
            head = bytearray(_HEAD)
            got = reader.read_into(0, memoryview(head))
        finally:
            reader.close()
    except (OSError, CheckpointError):
        return None  # missing or unreadable: the whole check says which
    start = bytes(head[:got]).lstrip(b" \t\r\n")
    if start and not start.startswith(b"{"):
        return f"{path} is not an unbroken manifest (it is not a JSON object); it is damaged"
    if start and got < _HEAD:  # every manifest names its format and checksum: far more
        return f"{path} is not an unbroken manifest ({got} bytes: too short); it is damaged"
    return None


def candidate_steps(ckdir: CheckpointDir, step: int | None) -> list[int]:
    """Steps to try, newest first (just ``step`` if given); the same on every rank."""

    def find() -> list[int]:
        ckdir.check_not_foreign()
        ckdir.clean_leftovers_if_idle()
        steps = ckdir.steps()
        if step is None:
            return steps[::-1]
        if step not in steps and step in ckdir.steps_without_manifest():
            raise CorruptCheckpointError(
                f"{ckdir.step_path(step)} has no manifest.json: the checkpoint of step {step} "
                f"is damaged (its manifest was lost or deleted); committed steps: {steps or 'none'}"
            )
        if step not in steps:
            raise CheckpointNotFoundError(
                f"step {step} is not a committed checkpoint in {ckdir.root}; committed steps: "
                f"{steps or 'none'}"
            )
        return [step]

    return collective.on_rank0(find)


class Candidates:
    """The steps ``restore()`` tries, newest first (just ``step`` if given), the same on
    every rank; false while none is left to try.

    A step that a concurrent save pruned, retired or re-saved while it was being read is
    no damage: when reading the step just yielded failed, call :meth:`relisted` first.
    Collective, like the reads.

    Cost on a store, however many steps there are (1,000 junk ``step_*/manifest.json``
    keys, docs/reliability.md): the folder is listed a bounded number of times, each
    step's mark (``CheckpointDir.step_marks``) is taken from that listing, and a step
    whose read failed costs one more request (``step_mark``: did it vanish?).

    Args:
        ckdir: the run folder.
        step: the step asked for, or None (the newest sound one).

    Example::

        for chosen in (candidates := Candidates(ckdir, None)):
            try:
                ...  # read_manifest, restore
                break
            except CorruptCheckpointError:
                if candidates.relisted():
                    continue
                ...  # the damage: skip it, or raise
    """

    def __init__(self, ckdir: CheckpointDir, step: int | None) -> None:
        self._ckdir, self._step = ckdir, step
        self._pending = candidate_steps(ckdir, step)
        self._marks, self._names = self._list_copies()
        self._current: int | None = None
        self._damaged: set[int] = set()
        self._relists = 0

    def __bool__(self) -> bool:
        return bool(self._pending)

    def __iter__(self) -> Iterator[int]:
        while self._pending:
            self._current = self._pending.pop(0)
            yield self._current

    def relisted(self, *, garbage: bool = False) -> bool:
        """After reading the step just yielded failed: True if it vanished while being read
        (the steps were listed again, less those found damaged, and iteration goes on
        with them); False if it is still there, so the failure is damage.

        ``garbage``: what was read is no checkpoint's at all (not one that vanished: a
        save never writes such bytes), so it is damage without asking the store.

        Raises:
            CheckpointNotFoundError: nothing is left (all removed while being read).
            CheckpointError: checkpoints vanished more than ``MAX_RELISTS`` times.
        """
        assert self._current is not None
        if garbage or not self._vanished(self._current):
            self._damaged.add(self._current)
            return False
        if self._relists >= MAX_RELISTS:
            raise CheckpointError(
                f"the checkpoints in {self._ckdir.root} were pruned or replaced "
                f"{self._relists} times while being read: keep more of them (keep_last) "
                "while other processes restore"
            )
        self._relists += 1
        listed = candidate_steps(self._ckdir, self._step)
        self._pending = [s for s in listed if s not in self._damaged]
        self._marks, self._names = self._list_copies()
        if not self._pending:
            raise CheckpointNotFoundError(
                f"the checkpoints in {self._ckdir.root} were removed while being read"
                + (f"; damaged: steps {sorted(self._damaged)}" if self._damaged else "")
            )
        logger.info("step %d vanished while being read; steps listed again", self._current)
        return True

    def folder(self, step: int) -> Location:
        """Where the checkpoint of ``step`` is read: its step folder, or the copy a
        re-save that died set aside (``CheckpointDir.step_copies``)."""
        name = self._names.get(step)
        return self._ckdir.step_path(step) if name is None else self._ckdir.root / name

    def _list_copies(self) -> tuple[dict[int, str], dict[int, str]]:
        """Rank 0's marks of the committed steps and the names of the folders they are
        read from, from one listing; collective."""
        if not self._pending:
            return {}, {}
        copies = collective.on_rank0(self._ckdir.step_copies) or {}
        return {s: c[1] for s, c in copies.items()}, {s: c[0] for s, c in copies.items()}

    def _vanished(self, step: int) -> bool:
        """Whether ``step`` stopped being the checkpoint listed before it was read
        (pruned, retired or re-saved meanwhile): its read errors are then no damage.
        Rank 0 decides for all."""
        seen = self._marks.get(step)
        return collective.on_rank0(lambda: seen is None or self._ckdir.step_mark(step) != seen)


def lost_manifests(ckdir: CheckpointDir) -> list[str]:
    """Warnings naming step folders without manifest.json (damaged, never restored);
    the same on every rank, logged by rank 0."""

    def find() -> list[str]:
        found = [
            f"{ckdir.step_path(s)} has no {MANIFEST}: the checkpoint of step {s} is "
            "damaged (its manifest was lost or deleted) and was not considered"
            for s in ckdir.steps_without_manifest()
        ]
        for warning in found:
            logger.warning("%s", warning)
        return found

    return collective.on_rank0(find)


def _entries(ckdir: CheckpointDir) -> list[str] | None:
    try:
        return ckdir.listdir()  # none there (on a store: no object): FileNotFoundError
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        return ["(not a directory)"]


def _foreign_entries(entries: list[str]) -> list[str]:
    ours = (".partial-", ".retired-")
    return [
        e for e in entries if e not in _OURS and not e.startswith(ours) and folder_step(e) is None
    ]


def _look(ckdir: CheckpointDir) -> tuple[str, bool]:
    """For a fresh start: (where the restore looked and what it found there, whether
    another tool's files are there). Lists the folder once."""
    root = ckdir.root
    entries = _entries(ckdir)
    if entries is None:
        return f"{root} does not exist", False
    if entries == ["(not a directory)"]:
        return f"{root} is a file, not a folder", False
    foreign = _foreign_entries(entries)
    if not foreign:
        ours = [e for e in entries if e not in (LOCK, RUN_LOCK)]  # made by looking, tracking
        if not ours:
            return f"{root} is empty", False
        return f"{root} holds no committed checkpoint (only {', '.join(ours)})", False
    shown = [e + ("/" if ckdir.is_folder(e) else "") for e in foreign[:_SHOWN]]
    more = f" and {len(foreign) - _SHOWN} more" if len(foreign) > _SHOWN else ""
    return (
        f"{root} holds no committed unbroken checkpoint but {', '.join(shown)}{more} "
        "(another tool's layout? unbroken commits step_NNNNNNNN/ folders holding a "
        f"{MANIFEST})",
        True,
    )
