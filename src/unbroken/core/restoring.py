"""One restore: manifest -> load targets -> shard reads -> install -> verification."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from ..errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    StateMismatchError,
)
from ..format import manifest, schema, tree
from ..format.shards import ChunkLocation, ShardReader, quiet_single_process
from ..live import exchange, probe, snapshot
from ..live.optimizer import OptimizerComponent
from ..live.state import Component, ModelComponent, live_tensors
from ..report import RestoreReport
from ..storage.interface import Location
from . import collective, verify
from .saving import component_prefix, unwrap

logger = logging.getLogger(__name__)


def check_folder(folder: Location) -> dict[str, Any]:
    """Read and validate a committed checkpoint's manifest and the files it lists.

    The rules are storage's (``Location.problems``), which ``unbroken verify`` applies too.

    Raises:
        CorruptCheckpointError: naming the file that is missing, resized, sparse, a
            link, not listed in the manifest, or unreadable (permissions).
        CheckpointError: its tensor bytes are in another byte order than this machine's,
            or its fingerprints use an algorithm this version does not know.
    """
    try:
        return _check_folder(folder)
    except CorruptCheckpointError:
        raise
    except OSError as exc:  # no permission, gone meanwhile: the checkpoint is unusable
        raise CorruptCheckpointError(
            f"{exc.filename or folder} cannot be read ({exc.strerror or exc}); fix its "
            "permissions, or use an older step"
        ) from None


def _check_folder(folder: Location) -> dict[str, Any]:
    doc = manifest.read(folder)  # refuses a linked folder or manifest
    problems = folder.problems(doc["files"])
    if problems:
        raise CorruptCheckpointError(f"{problems[0][1]}; use an older step")
    unreferenced = schema.unreferenced(doc)
    if unreferenced:
        raise CorruptCheckpointError(
            f"{folder}: the manifest lists tensor(s) no component references "
            f"({', '.join(unreferenced[:5])}): it was altered; use an older step"
        )
    manifest.require_native_byteorder(folder, doc)
    manifest.require_known_fingerprints(folder, doc)
    return doc


def read_manifest(folder: Location) -> dict[str, Any]:
    """Rank 0 checks the folder (:func:`check_folder`); every rank gets the manifest."""
    return collective.on_rank0(lambda: check_folder(folder))


def restore(
    folder: Location,
    doc: dict[str, Any],
    components: list[Component],
    reset: set[str],
    skip: set[str],
    probe_fn: probe.Probe | None,
    model: Any,
) -> RestoreReport:
    """Load ``doc``'s checkpoint into the live components; collective across ranks."""
    started = time.perf_counter()
    rank, world = collective.rank(), collective.world_size()
    saved_world = doc["world_size"]
    status, warnings = _plan(doc, components, reset, skip, saved_world, world)
    active = [c for c in components if status[c.name] == "restored"]

    skeletons: dict[str, Any] = {}
    saved_keys: dict[str, dict[str, dict]] = {}
    exchanges: dict[str, exchange.Exchange] = {}  # models installed by exchanging bytes

    def build_targets() -> dict[str, torch.Tensor]:
        targets: dict[str, torch.Tensor] = {}
        for c in active:
            entry = doc["components"][c.name]
            skeleton = entry["ranks"][str(rank)] if entry.get("per_rank") else entry["state"]
            skeletons[c.name] = skeleton
            keys = {}
            for key in tree.tensor_keys(skeleton):
                if key not in doc["tensors"]:
                    raise CorruptCheckpointError(
                        f"{folder}: the manifest references tensor {key!r} but does not list "
                        "it; the checkpoint is damaged"
                    )
                keys[key] = doc["tensors"][key]
            saved_keys[c.name] = keys
            if isinstance(c, OptimizerComponent):
                c.check_coverage(skeleton)
            if isinstance(c, ModelComponent):
                live = live_tensors(c, component_prefix(c, rank))[1]
                mine = c.targets(keys, live)
                swap = c.exchange_plan(live, mine)
                if swap is not None:
                    exchanges[c.name] = swap
            else:
                mine = c.targets(keys, {})
            targets.update(mine)
        return targets

    # The targets are new tensors: nothing live changes while the checkpoint is read, so
    # the undo (a copy of the tensors of a model that is not exchanged) is made meanwhile.
    prepared = collective.agree(
        lambda: (build_targets(), snapshot.begin(active, {n: e.undo for n, e in exchanges.items()}))
    )
    assert prepared is not None
    targets, undos = prepared
    loaded = verify.LoadedFingerprints(targets, manifest.fingerprint_algorithm(doc))
    reader = ShardReader(folder, doc["tensors"], on_loaded=loaded.loaded)
    try:
        with quiet_single_process():
            dcp.load(
                targets,
                storage_reader=reader,
                planner=DefaultLoadPlanner(),
                no_dist=not collective.active(),
            )
    except BaseException as exc:
        loaded.abandon()
        if isinstance(exc, CheckpointException):
            raise unwrap(exc, f"reading {folder}") from None
        raise

    # Damaged data (or a bug) is caught before anything live is touched, in one round:
    # each rank's own verdict, and the sums of the ranks' shares of sharded tensors'
    # fingerprints (in the manifest's order of keys: the same on every rank).
    problems, sharded = loaded.check_local(doc["tensors"])
    keys = list(doc["tensors"])

    def checked_undos() -> list[snapshot.Undo]:
        _raise_corrupt(problems, folder)
        for swap in exchanges.values():
            swap.check_ties(targets)
        return undos()  # nothing live has changed up to here

    undo, sums = collective.agree_summing(checked_undos, [sharded.get(k, 0) for k in keys])
    summed = dict(zip(keys, sums, strict=True))
    _raise_corrupt(loaded.check_sharded(doc["tensors"], summed), folder)  # same everywhere
    assert undo is not None
    states = {c.name: tree.decode(skeletons[c.name], targets) for c in active}
    touched: list[int] = []  # indices into active whose install began
    try:

        def install() -> None:
            for i, c in enumerate(active):
                touched.append(i)
                if c.name in exchanges:
                    exchanges[c.name].install()
                else:
                    c.install(states[c.name])
            touched.append(-1)  # every install finished

        collective.agree(install)
        checks = {
            c.name: functools.partial(
                _live_problems,
                c,
                skeletons[c.name],
                saved_keys[c.name],
                targets,
                rank,
                exchanges.get(c.name),
                loaded,
                reader.read_whole,
            )
            for c in active
            if c.verify_live
        }
        probing = doc["probe"] if doc.get("probe") and probe_fn is not None else None
        _agree_installed(checks, probing, lambda: probe.record(probe_fn, model), saved_world)
    except BaseException as exc:
        raising = None if touched[-1:] == [-1] or not touched else active[touched[-1]].name
        _roll_back([(active[i], undo[i]) for i in touched if i >= 0], raising, exc)
        raise
    if probe_fn is not None and not doc.get("probe"):
        warnings.append("a probe was given but the checkpoint recorded none; not checked")

    if rank == 0:
        logger.info(
            "restored step %d from %s in %.2fs", doc["step"], folder, time.perf_counter() - started
        )
    return RestoreReport(
        step=doc["step"],
        restored=True,
        path=str(folder),
        components=status,
        verified=True,
        saved_world_size=saved_world,
        world_size=world,
        resharded=saved_world != world,
        warnings=warnings,
    )


def _roll_back(
    touched: list[tuple[Component, snapshot.Undo]], raising: str | None, exc: BaseException
) -> None:
    """Put every component whose install began back as it was; the caller then re-raises
    ``exc``, which now says so. ``raising`` names the component whose own install raised,
    if any: putting it back is best effort. Raises if another cannot be put back."""
    failed = {}
    for c, put_back in reversed(touched):
        try:
            put_back()
        except Exception as err:
            failed[c.name] = f"{type(err).__name__}: {err}"
    lost = [f"{name!r} ({why})" for name, why in failed.items() if name != raising]
    if lost:
        raise CheckpointError(
            f"restore failed ({type(exc).__name__}: {exc}) after it began installing state, "
            f"and {', '.join(lost)} could not be put back as it was: rebuild those objects "
            "before training"
        ) from exc
    note = "nothing was changed: every live object was put back as it was before restore()"
    if raising in failed:
        note += (
            f", except {raising!r}, whose load_state_dict raised and whose previous state "
            f"could not be loaded back either ({failed[raising]}): check it"
        )
    if isinstance(exc, CheckpointError) and exc.args and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0]}\n({note})", *exc.args[1:])
    else:
        exc.add_note(note)


def _raise_corrupt(problems: list[str], folder: Any) -> None:
    if problems:
        shown = "; ".join(f"{folder}: {p}" for p in problems[:5])
        raise CorruptCheckpointError(f"{shown}; use an older step")


def _plan(
    doc: dict[str, Any],
    components: list[Component],
    reset: set[str],
    skip: set[str],
    saved_world: int,
    world: int,
) -> tuple[dict[str, str], list[str]]:
    status: dict[str, str] = {}
    warnings: list[str] = []
    for c in components:
        if c.name in reset:
            status[c.name] = "reset"
            logger.warning("component %r starts fresh on request (reset)", c.name)
            continue
        if c.name not in doc["components"]:
            raise IncompleteCheckpointError(
                f"the checkpoint of step {doc['step']} has no {c.name!r} component, which was "
                f"passed to the Checkpointer; pass reset={{{c.name!r}}} to start it fresh on "
                "purpose"
            )
        if doc["components"][c.name].get("per_rank") and saved_world != world:
            why = "" if c.per_rank else " (its state differed between ranks when saved)"
            raise IncompleteCheckpointError(
                f"{c.name!r} is per-rank state{why} saved by {saved_world} rank(s) and cannot "
                f"be mapped onto {world}; pass reset={{{c.name!r}}} to start it fresh on purpose"
            )
        status[c.name] = "restored"
    not_passed = [name for name in doc["components"] if name not in status]
    unexpected = [name for name in not_passed if name not in skip]
    if unexpected:
        listed = ", ".join(repr(n) for n in unexpected)
        raise StateMismatchError(
            f"the checkpoint of step {doc['step']} holds {listed}, not passed to the "
            "Checkpointer: restoring without it would leave it fresh and drop it from every "
            "later checkpoint (for an optimizer: AdamW silently reset). Pass it to the "
            f"Checkpointer (e.g. {unexpected[0]}=...), or restore(skip={{{unexpected[0]!r}}}) "
            "to leave it out on purpose (recorded in the lineage)"
        )
    for name in not_passed:
        status[name] = "absent"
        warnings.append(f"{name!r} left out on request (skip): it will not be in new checkpoints")
    return status, warnings


def _live_problems(
    c: Component,
    skeleton: Any,
    keys: dict[str, dict],
    targets: dict,
    rank: int,
    swap: exchange.Exchange | None,
    loaded: verify.LoadedFingerprints,
    read_whole: dict[str, ChunkLocation],
) -> list[str]:
    """Problems of the component's live state, compared with what was loaded (no
    collective). Where ``swap`` installed it by exchanging bytes, the targets of its keys
    now hold the previous values: those are compared with the checksums of the chunks
    read whole into them, else with their ``loaded`` fingerprints."""
    live_skeleton, live = live_tensors(c, component_prefix(c, rank))
    if swap is None:
        problems = verify.compare_installed(keys, targets, live)
    else:
        expected = {**targets, **{k: live[k] for k in swap.keys if k in live}}
        problems = verify.compare_installed(keys, expected, live)
        problems += verify.compare_exchanged(
            swap.keys, loaded.partials, live, loaded.algorithm, read_whole
        )
    where = None if problems else tree.difference(skeleton, live_skeleton, c.name)
    if where is not None:
        problems.append(
            f"{c.name}: non-tensor state (hyperparameters, structure, types) differs from "
            f"the saved one at {where}"
        )
    return problems


def _agree_installed(
    checks: dict[str, Callable[[], list[str]]],
    recorded_probe: dict[str, Any] | None,
    run_probe: Callable[[], dict[str, Any]],
    saved_world: int,
) -> None:
    """Check every component's live state (``checks``: name -> its problems) and, if the
    checkpoint recorded one, the probe; raise on every rank if any rank found a problem.
    One round for all of them. A failed check names the tensor: it is reported before any
    rank's probe mismatch."""
    # Every rank runs every check and the probe, whatever its own earlier ones found:
    # capturing an FSDP1 optimizer's state, or a sharded model's forward, is collective.
    failure: Exception | None = None
    for name, problems in checks.items():
        try:
            verify.raise_problems(problems(), repr(name))
        except Exception as exc:
            failure = failure or exc
    mismatch = None
    if recorded_probe is not None:
        try:
            mismatch = _probe_mismatch(recorded_probe, run_probe(), saved_world)
        except Exception as exc:  # a probe that fails on one rank fails on every rank
            failure = failure or exc

    def checked() -> None:
        if failure is not None:
            raise failure

    _, mismatches = collective.agree_sharing(checked, mismatch)
    for r, message in enumerate(mismatches):
        if message is not None:
            mine = r == collective.rank()
            raise StateMismatchError(message if mine else f"[rank {r}] {message}")


def _probe_mismatch(
    recorded: dict[str, Any], value: dict[str, Any], saved_world: int
) -> str | None:
    """What is wrong with the probe's value after restore, or None if it is the saved one."""
    same_world = saved_world == collective.world_size()
    expected = recorded["ranks"][collective.rank() if same_world else 0]
    if value == expected:
        return None
    return (
        f"the probe differs after restore: saved {probe.describe(expected)}, now "
        f"{probe.describe(value)}. The weights the forward pass uses are not the ones saved: "
        "something installs them late (after the first step, say); see the probe in the README"
    )
