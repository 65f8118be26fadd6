"""Offline verification of committed checkpoints: is every byte what the manifest says?

:func:`verify_checkpoint` (``unbroken verify``) checks, for each step folder, in order,
without live objects and without writing anything: the manifest (its own checksum and
structure), every listed file present at its recorded size and no unlisted file, each
file's record consistent with its chunk list, every tensor the components reference
listed (and every listed tensor referenced), every chunk's checksum (all bytes are
read), every tensor's fingerprint recomputed from its assembled value, and the
optimizer state covering the model. All failures are collected, each naming its file or
tensor, rather than stopping at the first.

A folder that a concurrent save prunes, retires or re-saves while it is verified is not
damaged: its report says ``vanished``, and the folders are listed again.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import xxhash

from ..errors import CheckpointError
from ..format import fingerprint, manifest, tree
from ..format.state_compare import skeletons
from ..format.tensor_reader import TensorReader
from ..storage.interface import Location, vanished
from ..storage.locate import location
from ..storage.names import MANIFEST, folder_step
from .coverage import optimizer_coverage
from .folders import is_step_folder, locate, step_folders
from .inspection import frozen_part
from .reporting import JsonResult, Progress, ProgressCount

MAX_RELISTS = 100  # how often verification may start over because a save changed the folder


@dataclasses.dataclass
class Failure:
    """One failed check."""

    where: str  # a file name, a tensor key, ``manifest.json`` or ``optimizer``
    message: str  # what was expected, what was found


@dataclasses.dataclass
class CheckpointVerification(JsonResult):
    """The verification of one step folder (:func:`verify_folder`)."""

    JSON_PROPERTIES = ("ok",)

    path: str  # the step folder
    step: int | None = None  # the manifest's (the folder name's if it cannot be read)
    failures: list[Failure] = dataclasses.field(default_factory=list)  # every failed check
    warnings: list[str] = dataclasses.field(default_factory=list)  # notes that do not fail
    files_checked: int = 0  # shard files the manifest lists
    tensors_checked: int = 0  # tensors read whole, checksums (and fingerprints) checked
    bytes_read: int = 0  # tensor bytes read
    # A concurrent save removed or replaced the folder while it was read: the failures
    # say nothing about damage; list the steps again.
    vanished: bool = False

    @property
    def ok(self) -> bool:
        """Every check held."""
        return not self.failures

    def fail(self, where: str, message: str) -> None:
        self.failures.append(Failure(where, message))


@dataclasses.dataclass
class VerifyReport(JsonResult):
    """What :func:`verify_checkpoint` returns (``unbroken verify --json``)."""

    JSON_PROPERTIES = ("ok",)

    checkpoints: list[CheckpointVerification]  # one per step folder verified, by step

    @property
    def ok(self) -> bool:
        """Every checkpoint verified passed every check (the command exits 0)."""
        return all(c.ok for c in self.checkpoints)


def verify_checkpoint(
    path: str | os.PathLike,
    *,
    step: int | None = None,
    all: bool = False,  # the command's --all (shadows the builtin in here only)
    progress: Progress | None = None,
) -> VerifyReport:
    """Verify committed checkpoints completely, reading every byte (``unbroken verify``).

    A damaged checkpoint is reported (``ok`` False, each failure naming its file or
    tensor), not raised. One that a concurrent save prunes or re-saves while it is read
    is not damaged: the folders are listed again and verified as they are now (a step
    that is gone is no longer asked for; one asked for by ``step`` is then missing).

    Args:
        path: a run folder or one step folder; local, or an fsspec URL.
        step: the committed step to verify (default: the latest).
        all: verify every committed step.
        progress: called with (bytes read, bytes to read) as tensors are read.

    Returns:
        :class:`VerifyReport`: one :class:`CheckpointVerification` per step folder
        verified, by step. Without ``step``, every step folder of the run that lost its
        ``manifest.json`` is among them too (it fails).

    Raises:
        ValueError: both ``step`` and ``all`` given.
        CheckpointNotFoundError: ``path`` holds no committed checkpoint, or ``step`` is
            not a committed step.
        CorruptCheckpointError: ``step`` names a step folder that lost its manifest.
        CheckpointError: the folder changed faster than it could be verified.

    Example::

        report = ub.verify_checkpoint("ckpts/run1", all=True)
        if not report.ok:
            for c in report.checkpoints:
                print(c.step, [f.message for f in c.failures])
    """
    if all and step is not None:
        raise ValueError("step and all exclude each other: verify one step, or all of them")
    done: dict[Location, CheckpointVerification] = {}
    for _ in range(MAX_RELISTS):
        folders = _folders(path, step, all)
        todo = [f for f in folders if f not in done]
        count = ProgressCount(progress, sum(total_bytes(f) for f in todo))
        for f in todo:
            done[f] = verify_folder(f, on_bytes=count)
        if not any(done[f].vanished for f in folders):
            return VerifyReport([done[f] for f in folders])
        done = {f: r for f, r in done.items() if not r.vanished}
    raise CheckpointError(f"the checkpoints in {path} changed faster than they could be verified")


def _folders(path: str | os.PathLike, step: int | None, every: bool) -> list[Location]:
    """The folders to verify: the step asked for; else the latest (or every) committed
    one and every step folder without manifest.json (damaged: its verification fails)."""
    if step is not None:
        return [locate(path, step)]
    for _attempt in range(MAX_RELISTS):
        folders = step_folders(path, damaged=True)
        if every:
            return folders
        committed = [f for f in folders if is_step_folder(f)]
        if committed:
            return [f for f in folders if f == committed[-1] or not is_step_folder(f)]
        # Every step listed was pruned before it was looked at: a save committed a newer
        # one first, which a new listing finds.
    raise CheckpointError(f"the checkpoints in {path} changed faster than they could be listed")


def total_bytes(folder: Location) -> int:
    """Bytes :func:`verify_folder` will read; 0 if the manifest is unreadable."""
    try:
        doc = manifest.read(folder)
    except CheckpointError:
        return 0
    return sum(c["length"] for e in doc["tensors"].values() for c in e["chunks"])


def verify_folder(
    folder: str | os.PathLike | Location, *, on_bytes: Callable[[int], None] | None = None
) -> CheckpointVerification:
    """Verify one committed step folder completely; never raises for a damaged one.

    Args:
        folder: the step folder.
        on_bytes: called with the byte count of each chunk read (progress).
    """
    folder = location(folder)
    report = CheckpointVerification(path=str(folder), step=folder_step(folder))
    seen = folder.identity()
    _verify(folder, report, on_bytes)
    report.vanished = bool(report.failures) and vanished(folder, seen)
    return report


def _verify(
    folder: Location, report: CheckpointVerification, on_bytes: Callable[[int], None] | None
) -> None:
    try:
        doc = manifest.read(folder)
    except CheckpointError as exc:
        report.fail(MANIFEST, str(exc))
        return
    report.step = doc["step"]
    # What the save itself found (e.g. an optimizer holding no state while the model it
    # covers trained): notes, not failures, since every byte may still be sound.
    report.warnings.extend(f"at save: {w}" for w in doc.get("save_warnings") or [])
    try:
        manifest.require_native_byteorder(folder, doc)
    except CheckpointError as exc:
        report.fail(MANIFEST, str(exc))
        return
    base = frozen_part(doc)
    if base is not None and base.tensors:
        report.warnings.append(
            f"the frozen base ({base.tensors} tensor(s), {base.bytes} bytes) is not stored "
            '(saved with frozen="verify"): a restore verifies the live base against its '
            "fingerprints, so this checkpoint cannot be verified alone for it; export needs "
            "--base"
        )
    absent = _check_files(folder, doc, report)
    _check_chunk_records(doc, report)
    _check_references(doc, report)
    algorithm = manifest.fingerprint_algorithm(doc)
    check_prints = algorithm in fingerprint.ALGORITHMS
    weak = fingerprint.weakness(algorithm)
    if weak:
        report.warnings.append(weak)
    if not check_prints:
        report.warnings.append(
            f"fingerprints use {algorithm!r}, which this unbroken cannot recompute; only "
            "checksums were checked"
        )

    def count(n: int) -> None:
        report.bytes_read += n
        if on_bytes is not None:
            on_bytes(n)

    try:
        reader = TensorReader(folder, doc, on_bytes=count)
    except CheckpointError as exc:
        report.fail(MANIFEST, str(exc))
        return
    scalars = {}  # kept for the coverage report (the optimizer's ``step`` values)
    with reader:
        for key, entry in sorted(doc["tensors"].items()):
            missing = sorted({c["file"] for c in entry["chunks"]} & absent)
            if missing:  # already reported once per file
                if on_bytes is not None:
                    on_bytes(sum(c["length"] for c in entry["chunks"]))
                continue
            try:
                t = reader.read(key)
            except CheckpointError as exc:
                report.fail(key, str(exc))
                continue
            report.tensors_checked += 1
            if t.numel() == 1:
                scalars[key] = t
            if not check_prints:
                continue
            stored = fingerprint.fingerprint(t, algorithm)
            if stored != entry.get("fingerprint"):
                report.fail(
                    key,
                    f"fingerprint {stored} of the stored value differs from the manifest's "
                    f"{entry.get('fingerprint')}: the checkpoint is inconsistent",
                )
        _check_coverage(doc, report, scalars.__getitem__)


def _check_files(folder: Location, doc: dict[str, Any], report: CheckpointVerification) -> set[str]:
    """The rules restore applies (``Location.problems``); returns the files not to read."""
    report.files_checked += len(doc["files"])
    unread = set()
    local = isinstance(doc.get("tier"), dict) and doc["tier"].get("tier") == "local"
    for name, message in folder.problems(doc["files"]):
        unread.add(name)
        if local and not (folder / name).exists():  # another node's: not damage here
            report.warnings.append(
                f"{name} is not on this node (a local tier step holds this node's shards "
                "and the replicas it keeps): the tensors in it were not read"
            )
            continue
        report.fail(name, message)
    return unread


def _check_chunk_records(doc: dict[str, Any], report: CheckpointVerification) -> None:
    """Each file's record must match its chunks: contiguous, and the same checksum."""
    per_file: dict[str, list[dict[str, Any]]] = {name: [] for name in doc["files"]}
    for entry in doc["tensors"].values():
        for c in entry["chunks"]:
            per_file.setdefault(c["file"], []).append(c)
    for name, chunks in sorted(per_file.items()):
        chunks.sort(key=lambda c: (c["offset"], c["length"]))
        end = 0
        for c in chunks:
            if c["offset"] != end:
                report.fail(
                    MANIFEST,
                    f"chunks of {name} leave a gap or overlap at byte {min(end, c['offset'])}",
                )
                break
            end += c["length"]
        rec = doc["files"][name]
        if end != rec["size"]:
            report.fail(MANIFEST, f"chunks of {name} cover {end} bytes, its record {rec['size']}")
        combined = xxhash.xxh3_128_hexdigest("".join(c["checksum"] for c in chunks).encode())
        if "checksum" in rec and combined != rec["checksum"]:
            report.fail(MANIFEST, f"the file checksum of {name} does not match its chunk list")


def _check_references(doc: dict[str, Any], report: CheckpointVerification) -> None:
    referenced: set[str] = set()
    for name, entry in doc["components"].items():
        if entry.get("per_rank"):
            ranks = sorted(entry.get("ranks", {}), key=lambda r: int(r) if r.isdigit() else -1)
            if ranks != [str(r) for r in range(doc["world_size"])]:
                report.fail(
                    MANIFEST,
                    f"per-rank component {name!r} has ranks {ranks}, expected one per rank "
                    f"of world size {doc['world_size']}",
                )
        for skeleton in skeletons(doc, name):
            try:
                tree.decode(skeleton, _AnyTensor())
            except (ValueError, TypeError, KeyError) as exc:
                report.fail(MANIFEST, f"component {name!r}: undecodable state ({exc})")
            keys = tree.tensor_keys(skeleton)
            referenced.update(keys)
            for key in keys:
                if key not in doc["tensors"]:
                    report.fail(key, f"component {name!r} references it; the manifest lacks it")
    for key in sorted(set(doc["tensors"]) - referenced):
        report.fail(key, "listed in the manifest but referenced by no component")


class _AnyTensor(dict):
    def __missing__(self, key: str) -> None:
        return None


def _check_coverage(doc: dict[str, Any], report: CheckpointVerification, read) -> None:
    try:
        cov = optimizer_coverage(doc, read=read)
    except CheckpointError as exc:
        report.fail("optimizer", str(exc))
        return
    if cov is None:
        return
    for message in cov.failures:
        report.fail("optimizer", message)
    report.warnings.extend(cov.warnings)
