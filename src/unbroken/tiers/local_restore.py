"""Restoring from the local tier: the newest local step that is complete across the
surviving nodes, verified like any restore, or nothing (the persistent tier then).

One round lists every node's local steps newer than the newest persistent one. For the
newest candidate, each file of the step needs a copy on some node (one save's copies:
the same manifest bytes), else the step is unusable (named). Each node gathers a restore
folder: its own copies linked, the manifest, and the files its ranks read received from
a node that holds them. The restore reads that folder (resharding onto this world size
where it differs), checksumming every chunk as it reads and verifying every tensor.
Damage found there changes nothing live: then every copy of the step is checked, the
copies that fail are dropped (named) and the step is tried again if a sound copy of each
file is left; else the next older step. Never a mix of steps or tiers: one step's files,
one manifest.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor

from ..core import collective, restoring, resuming
from ..errors import CorruptCheckpointError
from ..format import manifest as manifest_file
from ..format.folder_check import check_folder
from ..storage.locate import location
from .node_folder import MANIFEST, unsound
from .transfer import exchange

if TYPE_CHECKING:
    from pathlib import Path

    from ..live.state import Component
    from .store import LocalStore


def restore(
    store: LocalStore,
    newer_than: int | None,
    components: list[Component],
    request: restoring.RestoreRequest,
) -> tuple[resuming.Resumed | None, list[str]]:
    """The resume from the newest usable local step newer than ``newer_than`` (None:
    none is), and the warnings naming every local step or copy skipped. Collective."""
    store.wait()  # the replication thread lets go of the tier's group
    rank, nodes, folder = collective.rank(), store.nodes, store.folder
    leader = nodes.is_leader(rank)

    def listing() -> tuple[dict[int, Any], str | None]:
        found: dict[int, Any] = {}
        if not leader:
            return found, None
        try:
            steps = folder.steps()
        except OSError as exc:  # never raised here alone: the others wait in the round
            return found, f"node {nodes.node_of(rank)}'s local folder cannot be listed ({exc})"
        for step in steps:
            if newer_than is not None and step <= newer_than:
                continue
            try:
                doc, ident = folder.manifest(step)
                sizes = {n: r["size"] for n, r in doc["files"].items()}
                sizes[MANIFEST] = folder.step_path(step).joinpath(MANIFEST).stat().st_size
                held = [MANIFEST, *folder.present(step, doc["files"])]
            except Exception as exc:  # a damaged manifest: that copy is skipped
                found[step] = {"error": str(exc)}
                continue
            found[step] = {"id": ident, "files": sizes, "held": held}
        return found, None

    every = collective.gather_all(listing())
    listed = {nodes.node_of(r): v for r, (v, _) in enumerate(every) if nodes.is_leader(r)}
    warnings: list[str] = [why for _, why in every if why]
    for step in sorted({s for v in listed.values() for s in v}, reverse=True):
        copies, notes = _copies(step, listed)
        warnings += notes
        holders = _holders(copies)
        files = next(iter(copies.values()))["files"] if copies else {}
        lost = sorted(n for n in files if not holders.get(n))
        if not copies or lost:
            warnings.append(_unusable(step, lost, "no surviving node holds"))
            continue
        done = _restore_step(store, step, files, holders, components, request, warnings)
        if isinstance(done, resuming.Resumed):
            return done, warnings
        # Damage found while reading (every chunk is checksummed as it is read, nothing
        # live changed): each copy is checked now, and the step tried again without
        # the copies that fail, if a sound copy of every file is left.
        bad = _check_copies(store, step, copies)
        if not bad:
            warnings.append(
                f"local step {step} failed its checks while restoring ({done}); skipped"
            )
            continue
        for node, problems in sorted(bad.items()):
            for name, why in sorted(problems.items()):
                warnings.append(f"local step {step}: node {node}'s copy of {why}; skipped")
                holders[name].remove(node)
        lost = sorted(n for n in files if not holders[n])
        if lost:
            warnings.append(_unusable(step, lost, "no sound copy is left of"))
            continue
        done = _restore_step(store, step, files, holders, components, request, warnings)
        if isinstance(done, resuming.Resumed):
            return done, warnings
        warnings.append(f"local step {step} failed its checks while restoring ({done}); skipped")
    return None, warnings


def _copies(step: int, listed: dict[int, Any]) -> tuple[dict[int, Any], list[str]]:
    """The nodes' copies of ``step`` that belong to one save (the one most nodes hold),
    and notes on the others."""
    notes, good = [], {}
    for node, steps in sorted(listed.items()):
        entry = steps.get(step)
        if entry is None:
            continue
        if "error" in entry:
            notes.append(f"local step {step}: node {node}'s manifest is damaged; skipped")
        else:
            good[node] = entry
    if not good:
        return {}, notes
    ids = Counter(e["id"] for e in good.values())
    chosen = max(sorted(ids), key=lambda i: ids[i])
    for node, entry in sorted(good.items()):
        if entry["id"] != chosen:
            notes.append(f"local step {step}: node {node}'s copy is of another save; skipped")
    return {n: e for n, e in good.items() if e["id"] == chosen}, notes


def _holders(copies: dict[int, Any]) -> dict[str, list[int]]:
    holders: dict[str, list[int]] = {}
    for node, entry in sorted(copies.items()):
        for name in entry["held"]:
            holders.setdefault(name, []).append(node)
    return holders


def _unusable(step: int, lost: list[str], why: str) -> str:
    shown = ", ".join(lost[:4]) + (f" and {len(lost) - 4} more" if len(lost) > 4 else "")
    return f"local step {step} could not be used: {why} {shown or 'its files'}"


def _check_copies(store: LocalStore, step: int, copies: dict[int, Any]) -> dict[int, Any]:
    """node -> {file: why} for every held copy that fails its checksums; the ranks of a
    node share its files."""
    rank, nodes, folder = collective.rank(), store.nodes, store.folder
    node = nodes.node_of(rank)
    mine: dict[str, str] = {}
    if node in copies:
        ranks = nodes.ranks[node]
        shards = [n for n in copies[node]["held"] if n != MANIFEST]
        share = shards[ranks.index(rank) :: len(ranks)]
        try:
            doc, _ = folder.manifest(step)
        except Exception as exc:  # removed or damaged since it was listed
            mine = {name: f"{name} (its manifest cannot be read: {exc})" for name in share}
        else:
            for name in share:
                why = unsound(folder.step_path(step), name, doc)
                if why is not None:
                    mine[name] = why
    found: dict[int, Any] = {}
    for r, problems in enumerate(collective.gather_all(mine)):
        for name, why in problems.items():
            found.setdefault(nodes.node_of(r), {})[name] = why
    return found


def _restore_step(
    store: LocalStore,
    step: int,
    files: dict[str, int],
    holders: dict[str, list[int]],
    components: list[Component],
    request: restoring.RestoreRequest,
    warnings: list[str],
) -> resuming.Resumed | str:
    """Gather on each node the files of ``step`` its ranks read, and restore; what was
    found damaged when damage turned up (nothing live changed then)."""
    rank, nodes, folder = collective.rank(), store.nodes, store.folder
    node = nodes.node_of(rank)
    token = collective.from_rank0(uuid.uuid4().hex[:12])
    here_path = folder.view_path(step, token)
    here = location(here_path)
    in_view = {n: {name for name in files if n in holders[name]} for n in range(nodes.count)}
    fetched: list[int] = []
    view: Path | None = None

    def fetch(names: dict[int, set[str]]) -> None:
        """Every node receives the files of ``names`` (node -> files) it lacks."""
        moves = [
            (holders[name][0], dst, name)
            for dst in range(nodes.count)
            for name in sorted(names[dst] - in_view[dst])
        ]

        def move() -> None:
            if nodes.is_leader(rank):
                sends = [
                    (nodes.leader(dst), folder.step_path(step) / name, files[name])
                    for src, dst, name in moves
                    if src == node
                ]
                receives = [
                    (nodes.leader(src), here_path / name, files[name])
                    for src, dst, name in moves
                    if dst == node
                ]
                with collective.using(store.group):
                    exchange(sends, receives)

        collective.agree(move)
        for _, dst, name in moves:
            in_view[dst].add(name)
        fetched.append(len(moves))

    def prepare() -> None:
        nonlocal view
        if nodes.is_leader(rank):
            view = folder.view(step, token, sorted(in_view[node]))

    def read_what_is_needed(targets: restoring.Targets) -> None:
        every = collective.gather_all(sorted(needed_files(targets.tensors, doc)))
        need: dict[int, set[str]] = {n: set() for n in range(nodes.count)}
        for r, names in enumerate(every):
            need[nodes.node_of(r)].update(names)
        fetch(need)
        held = sorted(in_view[node] - {MANIFEST})
        collective.agree(lambda: check_folder(here, notes, held=held))

    notes: list[str] = []
    try:
        collective.agree(prepare)  # every node ready before any byte is sent
        fetch({n: {MANIFEST} for n in range(nodes.count)})  # the step's manifest, everywhere
        doc = collective.agree(lambda: manifest_file.read(here, notes))
        restored = restoring.restore(here, doc, components, request, read_what_is_needed)
    except CorruptCheckpointError as exc:
        return str(exc)
    finally:
        if view is not None:
            folder.discard(view)
    report = restored.report
    report.warnings[:0] = warnings + notes
    report.warnings.extend(
        f"the checkpoint of step {step} was saved with a warning: {w}"
        for w in doc.get("save_warnings") or []
    )
    source = "peer" if sum(fetched) else "local"
    report = dataclasses.replace(
        report, path=str(folder.step_path(step)), source=source, searched=str(folder.root)
    )
    return resuming.Resumed(report, doc, step, restored.installed, restored.algorithm)


def needed_files(targets: dict[str, torch.Tensor], doc: dict[str, Any]) -> set[str]:
    """The files holding a saved chunk that overlaps what this rank loads."""
    found: set[str] = set()
    for key, t in targets.items():
        entry = doc["tensors"].get(key)
        if entry is None:
            continue
        if isinstance(t, DTensor):
            if t.device_mesh.get_coordinate() is None:
                continue
            (chunk,) = t.__create_chunk_list__()
            box = (list(chunk.offsets), list(chunk.sizes))
        else:
            box = ([0] * len(entry["shape"]), list(entry["shape"]))
        for c in entry["chunks"]:
            if _overlap(box, c) or 0 in c["sizes"]:
                found.add(c["file"])
    return found


def _overlap(box: tuple[list[int], list[int]], chunk: dict[str, Any]) -> bool:
    return all(
        a < o + n and o < a + m
        for a, m, o, n in zip(box[0], box[1], chunk["offsets"], chunk["sizes"], strict=True)
    )
