"""The run: everything one Checkpointer remembers across its calls.

A :class:`Run` owns, for the Checkpointer that holds it:

- the lineage and the run's id (:mod:`.lineage`), and the branch a resume from an
  older step forks (its abandoned steps are retired by the first save);
- the claim on the folder (:mod:`.ownership`): one run per folder;
- the record (:mod:`.record`): tracked metrics, the replay and health checks;
- the idle-optimizer watch (:mod:`.idle_optimizers`);
- retention (``keep_last``) and the save warnings, each logged once;
- the trackers (:mod:`.trackers`), which rank 0 feeds.

A save asks the run for what it needs through one object, :class:`RunSave` (the
``core.saving.RunHooks`` role), made at ``save()`` and fixed then, so that a save
written in the background records the run as it was when it was asked.

Methods marked * are collective: every rank calls them, in the same order.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..core import collective
from ..core.resuming import Resumed
from ..errors import CheckpointError
from ..format.folder_check import check_folder
from ..live.optimizer import OptimizerComponent
from ..live.state import Component
from ..storage.interface import CheckpointDir
from .first_step import FirstStepCheck
from .idle_optimizers import IdleOptimizers
from .lineage import Lineage, abandoned_steps, saved_by, unknown_run_id
from .ownership import FolderClaim, other_writer
from .record import RunRecord
from .replay_check import ReplayVerdict
from .trackers import Tracker, TrackerHub

logger = logging.getLogger(__name__)


class RunSave:
    """What one save asks of the run (the ``core.saving.RunHooks`` role), fixed when
    ``save()`` was called: the lineage and metrics window its manifest records, the
    steps of an abandoned branch it retires, and rank 0's checks around its commit.

    Thread-safe: a background save calls it while the training loop goes on.
    """

    def __init__(
        self, run: Run, step: int, lineage: Lineage, retire: list[int], *, local: bool = False
    ) -> None:
        self.local = local  # a save into the local tier: the persistent folder is not its
        self._claim = run.claim
        self._idle = run.idle
        self.lineage = lineage.events
        self.metrics = run.record.window(step)
        self.retire = retire
        self._optimizer_steps = run.idle.counts()

    def check(self, step: int) -> None:
        """Before the save writes anything (rank 0, holding the save lock): refuse it if
        another run committed into the folder (``OtherRunError``)."""
        if not self.local:
            self._claim.check(step, self.lineage)

    def other_writer(self, committed: bytes) -> str | None:
        """At the commit (rank 0): who wrote the copy of the step committed already, if
        not this run (a job racing on a store), else None: it may be replaced."""
        return other_writer(committed, self.lineage)

    def findings(
        self, skeletons: Mapping[str, Any], tensors: Mapping[str, Any], algorithm: str
    ) -> list[str]:
        """Rank 0, before the commit: the run's save warnings (an idle optimizer)."""
        return self._idle.findings(skeletons, tensors, self._optimizer_steps, algorithm)

    def committed(
        self,
        step: int,
        skeletons: Mapping[str, Any],
        tensors: Mapping[str, Any],
        algorithm: str,
    ) -> None:
        """Rank 0, once the save committed: the step is this run's. Never raises."""
        if not self.local:
            self._claim.committed(step)
        self._idle.committed(step, skeletons, tensors, self._optimizer_steps, algorithm)


class Run:
    """What one Checkpointer remembers across its calls (module docstring).

    Args:
        folder: the run folder.
        components: the Checkpointer's components (the optimizers are watched).
        keep_last: committed checkpoints to keep (None: all).
        overwrite: the checkpoints in ``folder`` belong to a run this one replaces.
        loss_metric, grad_norm_metric: the tracked names the health check reads.
        trackers: rank 0 forwards tracked metrics to them.

    Not thread-safe, except where :class:`RunSave` says.
    """

    def __init__(
        self,
        folder: CheckpointDir,
        components: list[Component],
        *,
        keep_last: int | None,
        overwrite: bool,
        loss_metric: str,
        grad_norm_metric: str | None,
        trackers: Sequence[Tracker] | None,
    ) -> None:
        self.folder = folder
        self._components = components
        self._keep_last = keep_last
        # The steps this run may keep beside its own; rank 0 asks it.
        self.claim = FolderClaim(folder, overwrite=overwrite)
        if overwrite and collective.rank() == 0:
            self.claim.replaces()
        self.record = RunRecord(
            folder.root,
            loss_metric=loss_metric,
            grad_norm_metric=grad_norm_metric,
            gate=self.claim,
            replaces=overwrite,
        )
        self.idle = IdleOptimizers(components)
        self._lineage = Lineage.start(self.record.segment)
        self._trackers = TrackerHub(trackers, record=self.record)  # rank 0's only
        # The step resumed from, until the first save commits (-1: every step there).
        self._fork: int | None = -1 if overwrite else None
        self._save_warnings: list[str] = []  # the last committed save's
        self._logged: set[str] = set()  # each save warning is logged once
        self._tracking = False  # whether track() was allowed once
        self._first_step: FirstStepCheck | None = None  # armed by a restore

    @property
    def run_id(self) -> str:
        """The run's id, once decided (else ``CheckpointError``)."""
        if self._lineage.run_id is None:
            raise unknown_run_id()
        return self._lineage.run_id

    # -- restore ---------------------------------------------------------------------

    def restored(self, done: Resumed, *, reset: set[str], skip: set[str]) -> None:
        """* ``restore()`` finished: a fresh start, or a checkpoint loaded."""
        self._forward(self.record.complete())  # a step tracked before the restore
        if collective.rank() == 0:  # the steps now (a leftover put back included) are ours
            self.claim.restored(done.step if done.doc is not None else None)
        if done.doc is None:  # a fresh start: rank 0's new id is every rank's
            self._lineage = self._lineage.agree()
            self._trackers.start(self.run_id, 0, None)
            return
        doc, step = done.doc, done.step
        assert step is not None
        self.idle.restored(doc)  # the next save compares with its fingerprints
        self.record.resumed(
            doc.get("metrics", []),
            from_step=step,
            saved_by=saved_by(doc),
            world_size=collective.world_size(),
            reset=sorted(reset),
            optimizers=self._restored_optimizers(done.report.components),
        )
        self._lineage = Lineage.restored(doc).resumed(
            step,
            segment=self.record.segment,
            reset=reset,
            skipped=skip & set(doc["components"]),
            source=done.report.source,
        )
        self._fork = step  # newer committed steps are retired by the first save
        self._trackers.start(self.run_id, step, self.folder.root)
        if self._first_step is not None:
            self._first_step.close()
        if done.installed is not None and done.algorithm is not None:
            self._first_step = FirstStepCheck(self._components, done.installed, done.algorithm)

    def _restored_optimizers(self, states: Mapping[str, str]) -> dict[str | None, Any]:
        """name -> optimizer that the restore restored: the health check watches them."""
        return {
            name: opt
            for c in self._components
            if isinstance(c, OptimizerComponent) and states.get(c.name) == "restored"
            for name, opt in c.optimizers.items()
        }

    # -- save ------------------------------------------------------------------------

    def begin_save(self, step: int, *, local: bool = False) -> RunSave:
        """* A save of ``step`` begins: the run's id decided if no restore did, the
        abandoned steps of a branch listed, the replay verdict so far recorded, all in
        the lineage the save writes. ``local``: a save into the local tier (the
        persistent folder's abandoned steps wait for the next persistent save)."""
        self._forward(self.record.complete())  # the save completes the step tracked last
        if self._first_step is not None and self._first_step.done:
            self._first_step.close()  # checked: its hooks go (outside any optimizer step)
            self._first_step = None
        if self._lineage.run_id is None:  # no restore(): this save decides the run's id
            self._lineage = self._lineage.agree()
        retire: list[int] = []
        if self._fork is not None and not local:
            fork = self._fork
            retire = collective.on_rank0(lambda: abandoned_steps(self.folder.steps(), fork))
            self._lineage = self._lineage.amended(retired=retire or [])
        replay = self.record.before_save()
        if replay is not None:
            self._lineage = self._lineage.amended(replay=replay)
        return RunSave(self, step, self._lineage, retire or [], local=local)

    def committed(self, step: int, warnings: list[str], *, local: bool = False) -> None:
        """* The save of ``step`` committed (in the save's thread): its warnings logged
        once, the branch committed, retention applied, the record written. ``local``: a
        local step (the local tier keeps its own retention)."""
        if not local:
            self._fork = None  # the branch is committed; its abandoned steps are retired
        self._save_warnings = warnings
        if collective.rank() == 0:
            for warning in warnings:
                if warning not in self._logged:
                    self._logged.add(warning)
                    logger.warning("step %d: %s", step, warning)
        if not local:
            self._apply_retention(step)
        unrecorded = self.record.after_commit()  # committed: a failure is a warning
        if unrecorded is not None:
            self._save_warnings = [*warnings, unrecorded]

    def _apply_retention(self, newest: int) -> None:
        """Unlist (then delete in the background) all but the ``keep_last`` newest
        committed checkpoints; rank 0 acts, errors are agreed on every rank. ``newest``,
        the checkpoint just committed, is never removed, however steps are ordered."""
        keep_last = self._keep_last
        if keep_last is None:
            return

        def prune() -> None:
            check_folder(self.folder.step_path(newest))  # delete nothing until it reads back
            steps = self.folder.steps()
            doomed = [s for s in steps if s != newest][: max(0, len(steps) - keep_last)]
            for s in doomed:
                self.folder.remove(s)

        collective.agree(prune, only_rank0=True)

    # -- the training loop -------------------------------------------------------------

    def track(self, step: int, metrics: dict[str, float | torch.Tensor]) -> None:
        """Record metrics of ``step``; rank 0 forwards each step to the trackers once it
        is complete (another step is tracked, a save, the end), all its metrics in one
        record. Refused (``CheckpointError``) before ``restore()`` on a folder holding
        checkpoints."""
        if not self._tracking:
            self._refuse_tracking_before_restore(step)
            self._tracking = True
        if self.record.pending not in (None, step):  # forwarded before this step is judged
            self._forward(self.record.complete(mark=False))
        self._forward(self.record.track(step, metrics))

    def _forward(self, done: tuple[int, dict[str, float]] | None) -> None:
        """Forward a completed step to the trackers (rank 0's; the others hold none)."""
        if done is not None:
            self._trackers.log(*done, run_id=self._lineage.events[0]["run"])

    def _refuse_tracking_before_restore(self, step: int) -> None:
        if self._lineage.run_id is not None or self._fork == -1:  # restored, saved, overwrite
            return
        steps = self.folder.steps()
        if steps:
            raise CheckpointError(
                f"track({step}) before restore(): {self.folder.root} holds checkpoints "
                f"(steps {steps[0]}..{steps[-1]}), and tracking now would start a second "
                "run beside them (a new run id for the trackers, a fresh segment in the "
                "metrics record). Call restore() first, which resumes the newest of them, "
                "or pass overwrite=True to start a new run in this folder"
            )

    @property
    def replay(self) -> ReplayVerdict | None:
        return self.record.replay

    @property
    def warnings(self) -> list[str]:
        """The last resume's warnings, then the last committed save's."""
        return [*self.record.warnings, *self._save_warnings]

    def finish(self) -> None:
        """* The end of this Checkpointer's part of the run: the replay verdict decided
        and shared, the record written (``CheckpointError`` if it cannot be)."""
        self._forward(self.record.complete())
        self.record.finish()

    def release(self) -> None:
        """Let go of everything held (after :meth:`finish`, or instead of it when a save
        failed): the trackers (a verdict decided by ``finish`` forwarded first), the
        record's file, the folder's run lock, the optimizer hooks; background deletions
        waited for. Local; safe to call more than once."""
        try:  # a step still incomplete (no finish: a save failed) reaches the trackers
            self._forward(self.record.complete())
        except Exception as exc:  # letting go must go on
            logger.warning("the last tracked step could not be completed at close: %s", exc)
        self._trackers.close()
        self.record.close()
        self.claim.release()
        self.idle.close()
        if self._first_step is not None:
            self._first_step.close()
        self.folder.finish_removals()
