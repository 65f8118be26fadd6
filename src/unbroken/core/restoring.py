"""One restore of a chosen checkpoint, as its phases (``resuming.py`` chooses it).

::

    plan            which components are restored, reset or absent (no I/O, no round)
    targets         load targets built from the manifest, never from live lazy state;
                    the snapshot (undo) begun, copying while the checkpoint is read
    read and check  every chunk read and checksummed, every tensor fingerprinted and
                    compared with the manifest; the snapshot completed. Nothing live
                    has changed: damage here lets the caller fall back to an older step
    install         each component's state installed, in order
    verify live     the live objects hold exactly what was loaded; the probe matches
    commit or       success keeps the installs; any failure after the first install
    roll back       puts every live object back as it was (:class:`Transaction`)

Each phase is collective and ends in one agreement round (``collective``): a failure on
any rank raises on every rank, so no rank waits while another has left.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from ..errors import (
    CorruptCheckpointError,
    IncompleteCheckpointError,
    StateMismatchError,
)
from ..format import manifest, tree
from ..format.shard_reader import ShardReader
from ..format.shards import ChunkLocation, quiet_single_process
from ..live import exchange, probe, snapshot, stages
from ..live.components import component_prefix
from ..live.optimizer import OptimizerComponent
from ..live.state import Component, ModelComponent, live_tensors
from ..report import RestoreReport
from ..storage.interface import Location
from . import collective, frozen, verify
from .transaction import Transaction

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class RestoreRequest:
    """What the caller asked of a restore besides the step."""

    reset: set[str]  # components to start fresh on purpose
    skip: set[str]  # saved components not passed, left out on purpose
    probe_fn: probe.Probe | None = None
    model: Any = None  # what the probe is called with


@dataclasses.dataclass
class Plan:
    """What happens to each component (the same on every rank)."""

    status: dict[str, str]  # name -> "restored" | "reset" | "absent"
    active: list[Component]  # the components restored, in install order
    warnings: list[str]
    saved_world: int
    world: int


@dataclasses.dataclass
class Targets:
    """Where the checkpoint's bytes go on this rank."""

    tensors: dict[str, torch.Tensor]  # key -> load target (new memory, or exchanged later)
    skeletons: dict[str, Any]  # component -> its saved skeleton (this rank's)
    saved: dict[str, dict[str, dict]]  # component -> its tensors' manifest entries
    exchanges: dict[str, exchange.Exchange]  # models installed by exchanging bytes
    snapshot: snapshot.Pending  # the undo, being taken while the checkpoint is read


@dataclasses.dataclass
class Loaded:
    """What was read, checked and decoded, and the undo of every active component."""

    states: dict[str, Any]  # component -> its decoded state
    fingerprints: verify.LoadedFingerprints
    read_whole: dict[str, ChunkLocation]  # key -> the chunk read straight into its target
    undo: list[snapshot.Undo]  # in the order of Plan.active
    recut: bool = False  # a tensor cut otherwise than at save, on some rank


@dataclasses.dataclass
class Restored:
    """What :func:`restore` did: its report, and this rank's fingerprint share of each
    value it installed (key -> share, None where it holds none; ``algorithm``'s), which
    the run's first-step check compares with the live values later."""

    report: RestoreReport
    installed: dict[str, int | None]
    algorithm: str


def restore(
    folder: Location,
    doc: dict[str, Any],
    components: list[Component],
    request: RestoreRequest,
    before_read: Callable[[Targets], None] | None = None,
) -> Restored:
    """Load ``doc``'s checkpoint (in ``folder``) into the live components; collective.
    ``before_read(targets)``: called on every rank once the load targets are known and
    before a byte is read (the local tier fetches the files they need there).

    Raises:
        CorruptCheckpointError: damage found while reading; nothing live changed.
        IncompleteCheckpointError, StateMismatchError: the checkpoint does not fit the
            live objects, or verification failed; every live object is as it was.
    """
    started = time.perf_counter()
    plan = plan_components(doc, components, request)
    # Frozen parameters the checkpoint proves by fingerprint instead of storing them are
    # checked first; they keep their live values, left out of every capture below.
    base = frozen.check_base(doc, plan.active, folder)
    with frozen.omitting(base.omit):
        targets = build_targets(folder, doc, plan)
        if before_read is not None:
            before_read(targets)
        loaded = read_and_check(folder, doc, plan, targets)
        with Transaction(plan.active, loaded.undo) as transaction:
            install(plan, targets, loaded, transaction)
            verify_live(plan, targets, loaded, doc, request)
    frozen.adopt(doc, plan.active, base)
    if request.probe_fn is not None and not doc.get("probe"):
        plan.warnings.append("a probe was given but the checkpoint recorded none; not checked")
    resharded = plan.saved_world != plan.world or loaded.recut
    if resharded:
        plan.warnings.append(_RESHARDED)
    if collective.rank() == 0:
        logger.info(
            "restored step %d from %s in %.2fs", doc["step"], folder, time.perf_counter() - started
        )
    report = RestoreReport(
        step=doc["step"],
        restored=True,
        path=str(folder),
        components=plan.status,
        verified=True,
        saved_world_size=plan.saved_world,
        world_size=plan.world,
        resharded=resharded,
        warnings=plan.warnings,
        frozen_verified=sum(map(len, base.omit.values())),
    )
    installed = {**base.held, **loaded.fingerprints.partials}
    return Restored(report, installed, loaded.fingerprints.algorithm)


_RESHARDED = (
    "resharded: the state was saved in another layout (world size or sharding) and is "
    "restored bit for bit; losses after it may still differ from an uninterrupted run in "
    "their last bits, since gradients and norms are now reduced in another order"
)


# -- plan ---------------------------------------------------------------------------------


def plan_components(
    doc: dict[str, Any], components: list[Component], request: RestoreRequest
) -> Plan:
    """Restored, reset or absent, per component; one error naming all that were passed but
    are not in the checkpoint, or saved but not passed, unless asked for on purpose."""
    saved_world, world = doc["world_size"], collective.world_size()
    status: dict[str, str] = {}
    warnings: list[str] = []
    absent, unmappable = [], []  # passed but not restorable: one error names them all
    for c in components:
        if c.name in request.reset:
            status[c.name] = "reset"
            logger.warning("component %r starts fresh on request (reset)", c.name)
        elif c.name not in doc["components"]:
            absent.append(repr(c.name))
        elif doc["components"][c.name].get("per_rank") and saved_world != world:
            why = "" if c.per_rank else " (its state differed between ranks when saved)"
            unmappable.append(f"{c.name!r}{why}")
        else:
            status[c.name] = "restored"
    if absent or unmappable:
        raise IncompleteCheckpointError(
            _not_restorable(doc, components, status, absent, unmappable, world)
        )
    not_passed = [name for name in doc["components"] if name not in status]
    unexpected = [name for name in not_passed if name not in request.skip]
    if unexpected:
        raise StateMismatchError(_not_passed(doc, unexpected))
    for name in not_passed:
        status[name] = "absent"
        warnings.append(f"{name!r} left out on request (skip): it will not be in new checkpoints")
    active = [c for c in components if status[c.name] == "restored"]
    return Plan(status, active, warnings, saved_world, world)


def _not_restorable(
    doc: dict[str, Any],
    components: list[Component],
    status: dict[str, str],
    absent: list[str],
    unmappable: list[str],
    world: int,
) -> str:
    """Every component passed that cannot be restored, and one ``reset=`` for them all."""
    why = []
    if absent:
        why.append(
            f"{', '.join(absent)} passed to the Checkpointer but not in the "
            f"checkpoint of step {doc['step']}"
        )
    if unmappable:
        why.append(
            f"{', '.join(unmappable)}: per-rank state saved by {doc['world_size']} "
            f"rank(s), not mappable onto {world}"
        )
    names = ", ".join(repr(c.name) for c in components if c.name not in status)
    return f"{'; '.join(why)}; pass reset={{{names}}} to start them fresh on purpose"


def _not_passed(doc: dict[str, Any], unexpected: list[str]) -> str:
    """Every saved component not passed, one ``skip=`` for them all, and what leaving an
    optimizer out means (an extra holding ``param_groups`` is one too)."""
    listed = ", ".join(repr(n) for n in unexpected)
    states = {n: doc["components"][n].get("state") for n in unexpected}
    optimizers = [
        repr(n)
        for n, state in states.items()
        if n == "optimizer" or (isinstance(state, dict) and "param_groups" in state)
    ]
    adamw = f" (for {', '.join(optimizers)}: AdamW silently reset)" if optimizers else ""
    return (
        f"the checkpoint of step {doc['step']} holds {listed}, not passed to the "
        "Checkpointer: restoring without them would leave them fresh and drop them from "
        f"every later checkpoint{adamw}. Pass them to the Checkpointer, or "
        f"restore(skip={{{listed}}}) to leave them out on purpose (recorded in the lineage)"
    )


# -- targets ------------------------------------------------------------------------------


def build_targets(folder: Location, doc: dict[str, Any], plan: Plan) -> Targets:
    """Load targets for every saved tensor of the active components, shaped by the
    manifest (DESIGN.md F1), and the snapshot begun; one agreement round.

    The targets are new tensors (or, for a model installed by exchange, swapped in only
    at install), so nothing live changes while the checkpoint is read, and the undo (a
    copy of a model that is not exchanged) is made meanwhile."""
    rank = collective.rank()
    unheld: dict[str, list[str]] = {}  # component -> saved names its live part lacks here

    def build() -> Targets:
        tensors: dict[str, torch.Tensor] = {}
        skeletons: dict[str, Any] = {}
        saved: dict[str, dict[str, dict]] = {}
        exchanges: dict[str, exchange.Exchange] = {}
        for c in plan.active:
            entry = doc["components"][c.name]
            skeleton = entry["ranks"][str(rank)] if entry.get("per_rank") else entry["state"]
            live_skeleton, live = (
                live_tensors(c, component_prefix(c, rank))
                if isinstance(c, ModelComponent)
                else (None, {})
            )
            if not entry.get("per_rank"):  # this rank's part: pipeline stages hold parts
                skeleton, unheld[c.name] = stages.held(c, skeleton, live_skeleton)
            keys = {}
            for key in tree.tensor_keys(skeleton):
                if key not in doc["tensors"]:
                    raise CorruptCheckpointError(
                        f"{folder}: the manifest references tensor {key!r} but does not list "
                        "it; the checkpoint is damaged"
                    )
                keys[key] = doc["tensors"][key]
            skeletons[c.name], saved[c.name] = skeleton, keys
            if isinstance(c, OptimizerComponent):
                c.check_coverage(skeleton)
            if isinstance(c, ModelComponent):
                mine = c.targets(keys, live)
                swap = c.exchange_plan(live, mine)
                if swap is not None:
                    exchanges[c.name] = swap
            else:
                mine = c.targets(keys, {})
            tensors.update(mine)
        undos = {name: swap.undo for name, swap in exchanges.items()}
        return Targets(tensors, skeletons, saved, exchanges, snapshot.begin(plan.active, undos))

    # ``unheld`` is filled by build() before the round hands it to every rank.
    targets, every = collective.agree_sharing(build, unheld)
    assert targets is not None
    _refuse_unheld(plan, every)
    return targets


def _refuse_unheld(plan: Plan, every: list[dict[str, list[str]]]) -> None:
    """Refuse, on every rank alike, saved state that no rank's live objects hold (each
    rank may hold a part of a model split into pipeline stages)."""
    for c in plan.active:
        names = set(every[0].get(c.name, []))
        for mine in every[1:]:
            names &= set(mine.get(c.name, []))
        if names:
            raise stages.unheld_error(c, sorted(names))


# -- read and check -----------------------------------------------------------------------


def read_and_check(folder: Location, doc: dict[str, Any], plan: Plan, targets: Targets) -> Loaded:
    """Read every chunk into its target (checksummed as it is read), fingerprint each
    tensor as it completes, compare with the manifest, and complete the snapshot: one
    agreement round for this rank's verdicts, the sharded tensors' fingerprint shares
    added up in the same round. Raises ``CorruptCheckpointError`` before anything live
    changes."""
    loaded = verify.LoadedFingerprints(targets.tensors, manifest.fingerprint_algorithm(doc))
    reader = ShardReader(folder, doc["tensors"], on_loaded=loaded.loaded, warnings=plan.warnings)
    try:
        with quiet_single_process():
            dcp.load(
                targets.tensors,
                storage_reader=reader,
                planner=DefaultLoadPlanner(),
                no_dist=not collective.active(),
            )
    except BaseException as exc:
        loaded.abandon()
        if isinstance(exc, CheckpointException):
            raise collective.unwrap(exc, f"reading {folder}") from None
        raise
    problems, sharded = loaded.check_local(doc["tensors"])
    keys = list(doc["tensors"])  # the manifest's order: the same on every rank

    def checked() -> tuple[dict[str, Any], list[snapshot.Undo]]:
        _raise_corrupt(problems, folder)
        for swap in targets.exchanges.values():
            swap.check_ties(targets.tensors)
        states = {c.name: _decode(folder, c.name, targets) for c in plan.active}
        return states, targets.snapshot.collect()  # nothing live has changed up to here

    terms = [*loaded.terms(keys, sharded), int(reader.recut)]
    done, sums = collective.agree_summing(checked, terms)
    recut = sums.pop() > 0  # on any rank
    _raise_corrupt(loaded.check_sharded(doc["tensors"], dict(zip(keys, sums, strict=True))), folder)
    assert done is not None
    states, undo = done
    return Loaded(states, loaded, reader.read_whole, undo, recut)


def _decode(folder: Location, name: str, targets: Targets) -> Any:
    """Component ``name``'s state from its skeleton and the loaded tensors."""
    try:
        return tree.decode(targets.skeletons[name], targets.tensors)
    except tree.SkeletonError as exc:  # the schema lets nothing undecodable through: hostile
        raise CorruptCheckpointError(
            f"{folder}: the saved state of {name!r} does not decode ({exc}); use an older step"
        ) from None


def _raise_corrupt(problems: list[str], folder: Location) -> None:
    if problems:
        shown = "; ".join(f"{folder}: {p}" for p in problems[:5])
        raise CorruptCheckpointError(f"{shown}; use an older step")


# -- install ------------------------------------------------------------------------------


def install(plan: Plan, targets: Targets, loaded: Loaded, transaction: Transaction) -> None:
    """Install each component's loaded state, in order: a model by exchanging bytes where
    that is what ``load_state_dict`` would do, else through ``load_state_dict`` (hooks and
    all); one agreement round."""

    def each() -> None:
        for c in plan.active:
            transaction.begin(c.name)
            if c.name in targets.exchanges:
                targets.exchanges[c.name].install()
            else:
                c.install(loaded.states[c.name])
        transaction.installed()

    collective.agree(each)


# -- verify live --------------------------------------------------------------------------


def verify_live(
    plan: Plan, targets: Targets, loaded: Loaded, doc: dict[str, Any], request: RestoreRequest
) -> None:
    """Every active component's live state equals what was loaded, and the probe (if the
    checkpoint recorded one) gives the recorded value; one agreement round.

    Every rank runs every check and the probe whatever its own earlier ones found:
    capturing an FSDP1 optimizer's state, or a sharded model's forward, is collective. A
    failed check names the tensor: it is reported before any rank's probe mismatch."""
    failure: Exception | None = None
    for c in plan.active:
        if not c.verify_live:
            continue
        try:
            problems = verify.live_problems(
                c,
                targets.skeletons[c.name],
                targets.saved[c.name],
                targets.tensors,
                targets.exchanges.get(c.name),
                loaded.fingerprints,
                loaded.read_whole,
            )
            verify.raise_problems(problems, repr(c.name))
        except Exception as exc:
            failure = failure or exc
    mismatch = None
    if doc.get("probe") and request.probe_fn is not None:
        try:
            value = probe.record(request.probe_fn, request.model)
            same_world = plan.saved_world == plan.world
            mismatch = probe.mismatch(doc["probe"], value, collective.rank() if same_world else 0)
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
