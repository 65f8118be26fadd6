"""Offline verification of a committed checkpoint: is every byte what the manifest says?

Checks, in order, without live objects and without writing anything: the manifest (its
own checksum and structure), every listed file present at its recorded size and no
unlisted file, each file's record consistent with its chunk list, every tensor the
components reference listed (and every listed tensor referenced), every chunk's
checksum (all bytes are read), every tensor's fingerprint recomputed from its assembled
value, and the optimizer state covering the model. All failures are collected, each
naming its file or tensor, rather than stopping at the first.

A folder that a concurrent save prunes, retires or re-saves while it is audited is not
damaged: its report says ``vanished`` instead, and the caller lists the steps again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import xxhash

from ..errors import CheckpointError
from ..format import fingerprint, manifest, tree
from ..format.tensor_reader import TensorReader
from ..storage.interface import vanished
from ..storage.locate import location
from ..storage.names import MANIFEST, folder_step
from .coverage import optimizer_coverage
from .inspection import component_skeletons


@dataclasses.dataclass
class Failure:
    """One failed check: ``where`` is a file name, a tensor key or ``optimizer``."""

    where: str
    message: str


@dataclasses.dataclass
class AuditReport:
    """The outcome of :func:`audit` for one step folder."""

    path: str
    step: int | None = None
    failures: list[Failure] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)
    files_checked: int = 0
    tensors_checked: int = 0
    bytes_read: int = 0
    # A concurrent save removed or replaced the folder while it was read: the failures
    # say nothing about damage; list the steps again.
    vanished: bool = False

    @property
    def ok(self) -> bool:
        return not self.failures

    def fail(self, where: str, message: str) -> None:
        self.failures.append(Failure(where, message))


def total_bytes(folder: Path) -> int:
    """Bytes :func:`audit` will read (for a progress bar); 0 if the manifest is unreadable."""
    try:
        doc = manifest.read(folder)
    except CheckpointError:
        return 0
    return sum(c["length"] for e in doc["tensors"].values() for c in e["chunks"])


def audit(folder: str | Path, *, on_bytes: Callable[[int], None] | None = None) -> AuditReport:
    """Verify one committed checkpoint completely; never raises for a damaged one.

    Args:
        folder: the step folder.
        on_bytes: called with the byte count of each chunk read (progress).
    """
    folder = location(folder)
    report = AuditReport(path=str(folder), step=folder_step(folder))
    seen = folder.identity()
    _audit(folder, report, on_bytes)
    report.vanished = bool(report.failures) and vanished(folder, seen)
    return report


def _audit(folder: Path, report: AuditReport, on_bytes: Callable[[int], None] | None) -> None:
    try:
        doc = manifest.read(folder)
    except CheckpointError as exc:
        report.fail(MANIFEST, str(exc))
        return
    report.step = doc["step"]
    try:
        manifest.require_native_byteorder(folder, doc)
    except CheckpointError as exc:
        report.fail(MANIFEST, str(exc))
        return report
    absent = _check_files(folder, doc, report)
    _check_chunk_records(doc, report)
    _check_references(doc, report)
    algorithm = manifest.fingerprint_algorithm(doc)
    check_prints = algorithm in fingerprint.ALGORITHMS
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


def _check_files(folder: Path, doc: dict[str, Any], report: AuditReport) -> set[str]:
    """The rules restore applies (``Location.problems``); returns the files not to read."""
    report.files_checked += len(doc["files"])
    unread = set()
    for name, message in folder.problems(doc["files"]):
        report.fail(name, message)
        unread.add(name)
    return unread


def _check_chunk_records(doc: dict[str, Any], report: AuditReport) -> None:
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


def _check_references(doc: dict[str, Any], report: AuditReport) -> None:
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
        for skeleton in component_skeletons(doc, name):
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


def _check_coverage(doc: dict[str, Any], report: AuditReport, read) -> None:
    try:
        cov = optimizer_coverage(doc, read=read)
    except CheckpointError as exc:
        report.fail("optimizer", str(exc))
        return
    if cov is None:
        return
    for message in cov.failures():
        report.fail("optimizer", message)
    report.warnings.extend(cov.warnings())
