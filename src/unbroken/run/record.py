"""The run's record: every tracked step of one Checkpointer, and what is judged from them.

A :class:`RunRecord` owns, for the Checkpointer that holds it:

- the metrics record (:class:`.metrics.MetricLog`): rank 0 appends each tracked step to
  ``metrics.jsonl`` (on an object store: objects under ``metrics/``) once the folder is
  shown to be this run's (the ``gate``: ``run/ownership.py``; until then the lines wait
  in memory), and the last :data:`METRICS_WINDOW` steps go into each checkpoint's
  manifest;
- after a resume, the replay check (:mod:`.replay_check`): the steps the earlier run had
  recorded after the restored checkpoint, compared bit for bit as they are tracked
  again; decided on rank 0 (which holds the record), its verdict shared with every rank
  at each save and at the end;
- after a resume, the health check (:mod:`.health_check`): the first steps' loss and
  gradient norm, and the restored optimizers; at most one warning, kept in the record.

The Checkpointer calls it at its moments, and only through these (those marked * are
collective)::

    RunRecord(root, loss_metric=, grad_norm_metric=, gate=, replaces=)  construction
    resumed(window, from_step=, saved_by=, ...)     * a restore loaded a checkpoint
    track(step, metrics)                              each Checkpointer.track: the step
                                                      it completed (another step's), if any
    complete(mark=)                                   a save, the end: the last step is
                                                      complete
    window(step)                                      a save's manifest: its metrics window
    before_save()                                   * a save: the replay verdict, for the lineage
    after_commit()                                  * a save committed: fsync (upload), a
                                                      failure only a warning
    finish()                                        * Checkpointer.close: the replay verdict
                                                      decided and shared, fsync (upload);
                                                      lines the gate never let through
                                                      dropped, with a warning
    close()                                           the file and the optimizer hooks released
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import torch

from ..core import collective
from ..storage.interface import Location
from .health_check import HealthCheck, check_metric_names
from .metrics import MetricLog, RecordGate
from .replay_check import ReplayCheck, ReplayVerdict

logger = logging.getLogger(__name__)

METRICS_WINDOW = 200  # tracked steps kept in each checkpoint's manifest


class RunRecord:
    """The tracked metrics of one Checkpointer, the replay check and the health check.

    Args:
        root: the run's folder (local or on a store); only rank 0 writes the record there,
            the other ranks keep their tracked values in memory.
        loss_metric: the tracked loss's name, which the health check watches.
        grad_norm_metric: the tracked gradient norm's name, or None.
        gate: whether rank 0 may write to the folder's record now (None: always).
        replaces: this run replaces the one recorded before (``overwrite=True``): the
            record's series begins anew with it.
    Raises:
        TypeError, ValueError: a metric name that is not a non-empty str, or the two equal.

    Methods marked collective must be called by every rank, in the same order. Not
    thread-safe, except that :meth:`after_commit` may run in a background save's thread
    while the training loop calls :meth:`track` (the metrics log is locked).

    Example::

        record = RunRecord(ckdir.root, loss_metric="loss", grad_norm_metric=None)
        record.track(1, {"loss": 0.5})
        record.after_commit()
        record.finish()
        record.close()
    """

    def __init__(
        self,
        root: Location,
        *,
        loss_metric: str = "loss",
        grad_norm_metric: str | None = "grad_norm",
        gate: RecordGate | None = None,
        replaces: bool = False,
    ) -> None:
        check_metric_names(loss_metric, grad_norm_metric)
        self._names = (loss_metric, grad_norm_metric)
        self._root = root
        self._log = MetricLog(
            root if collective.rank() == 0 else None,
            world_size=collective.world_size(),
            gate=gate,
            replaces=replaces,
        )
        self._replay: ReplayCheck | None = None
        self._health: HealthCheck | None = None
        self._pending: int | None = None  # the step tracked last, until complete
        self._health_step: int | None = None  # the step the health check saw last
        self._warned_reopened = False

    @property
    def segment(self) -> str:
        """This segment's identity in the metrics record (the lineage names it)."""
        return self._log.segment

    def window(self, step: int) -> list[dict[str, Any]]:
        """The last :data:`METRICS_WINDOW` tracked steps up to ``step``, for its manifest."""
        return self._log.window(step, METRICS_WINDOW)

    def resumed(
        self,
        window: list[dict[str, Any]],
        *,
        from_step: int,
        saved_by: str | None,
        world_size: int,
        reset: list[str],
        optimizers: Mapping[str | None, torch.optim.Optimizer],
    ) -> None:
        """A restore loaded the checkpoint of ``from_step``: start a segment that resumes
        from it, the replay check and the health check. Collective.

        Args:
            window: the checkpoint's saved metrics window (its manifest's ``metrics``).
            from_step: the step restored.
            saved_by: the metrics segment that saved it (None: an older checkpoint), whose
                later records are the replay check's reference.
            world_size: this run's; steps recorded with another are not compared.
            reset: the components the restore started fresh on purpose.
            optimizers: name -> optimizer the restore restored (the optimizer watch).
        """
        self._log.load_window(window, resumed_from=from_step, parent=saved_by)
        self._pending = self._health_step = None  # a step tracked before: completed by then
        self._replay = self._start_replay(from_step, saved_by, world_size, reset)
        if self._health is not None:
            self._health.close()
        loss, grad_norm = self._names
        self._health = HealthCheck(
            self._log.values, from_step, loss=loss, grad_norm=grad_norm, optimizers=optimizers
        )

    def track(
        self, step: int, metrics: dict[str, float | torch.Tensor]
    ) -> tuple[int, dict[str, float]] | None:
        """Record scalar metrics of ``step`` and feed the checks of the last resume.

        A step may be tracked in several calls (the loss, then an evaluation): it is
        complete when another step is tracked, or at :meth:`complete` (a save, the end).
        Returns the step this call completed, with every metric tracked for it (the
        trackers take it then), or None.

        Raises:
            TypeError, ValueError: a metric that is not a number or a one-element tensor.
        """
        reopened = step != self._pending and step in self._log.values
        self._log.track(step, metrics)  # checks the values first: a bad call completes nothing
        if reopened and not self._warned_reopened:
            self._warned_reopened = True
            logger.warning(
                "step %d was tracked again (%s) after it was complete (another step or "
                "a save came after it): its metrics reached the trackers then, and W&B "
                "drops a second row for a step. Track every metric of a step before the "
                "next step and before its save",
                step,
                ", ".join(sorted(metrics)),
            )
        done = self.complete(mark=False) if self._pending not in (None, step) else None
        self._pending = step
        values = self._log.values[step]
        if self._health is not None and self._names[0] in metrics:
            self._observe_health(step, values)  # at once, as the loss is there
        if self._replay is not None:
            self._decided(self._replay.observe(step, values, complete=False))
        return done

    @property
    def pending(self) -> int | None:
        """The step tracked last, while not complete (None: none)."""
        return self._pending

    def complete(self, *, mark: bool = True) -> tuple[int, dict[str, float]] | None:
        """Complete the step tracked last, if any: its metrics, all of them, are judged
        (a recorded metric the replay lacks is a difference now) and returned with it
        for the trackers; ``mark``: record that it was complete (a save, the end), so a
        later resume knows the trackers had it."""
        step, self._pending = self._pending, None
        if step is None:
            return None
        values = self._log.values[step]
        if self._health is not None:
            self._observe_health(step, values)
        if self._replay is not None:
            self._decided(self._replay.observe(step, values, complete=True))
        if mark:
            self._log.complete(step)
        return step, dict(values)

    def _observe_health(self, step: int, values: dict[str, float]) -> None:
        """Feed the health check each step once: when its loss is tracked, or when the
        step is complete."""
        assert self._health is not None
        if self._health_step == step:
            return
        self._health_step = step
        for warning in self._health.observe(step, values):
            self._log.note(step, warning)

    @property
    def replay(self) -> ReplayVerdict | None:
        """A copy of the last resume's replay verdict (None without a resume)."""
        return dataclasses.replace(self._replay.verdict) if self._replay is not None else None

    @property
    def warnings(self) -> list[str]:
        """The health check's warning of the last resume, and a replay difference."""
        found = list(self._health.warnings) if self._health is not None else []
        verdict = self.replay
        if verdict is not None and verdict.identical is False:
            found.append(str(verdict))
        return found

    def before_save(self) -> dict[str, Any] | None:
        """The replay verdict so far, as the lineage's resume event records it, the same on
        every rank (rank 0's); None without a resume. Collective."""
        if self._replay is None:
            return None
        self._share_replay()
        return self._replay.verdict.record()

    def after_commit(self) -> str | None:
        """A save committed: write and fsync (or upload) the record. A failure is a logged
        warning, returned (on rank 0), not an error: the checkpoint is committed, and a
        save that raised must have committed nothing. Collective (on a background save's
        group in its thread)."""
        return self._flush(strict=False)

    def finish(self) -> None:
        """The end of the run's segment: complete the last step, decide a pending replay
        verdict, share it with every rank, and write and fsync (or upload) the record.
        Collective.

        Raises:
            CheckpointError: the record could not be written, naming where.
        """
        self.complete()
        if self._replay is not None:
            self._decided(self._replay.finish())
            self._share_replay()
        self._flush(strict=True)
        self._log.drop_held()

    def close(self) -> None:
        """Stop the health check's optimizer watch and close the record's file. Local;
        safe to call more than once."""
        if self._health is not None:
            self._health.close()
        self._log.close()

    def _flush(self, *, strict: bool) -> str | None:
        return collective.agree(lambda: self._log.flush(strict=strict), only_rank0=True)

    def _start_replay(
        self, from_step: int, saved_by: str | None, world_size: int, reset: list[str]
    ) -> ReplayCheck:
        """Rank 0 reads its reference from the record; the other ranks get its verdict."""
        built: list[ReplayCheck] = []

        def verdict() -> ReplayVerdict | None:
            built.append(ReplayCheck.from_file(self._root, from_step, saved_by, world_size, reset))
            return built[0].verdict

        shared = collective.on_rank0(verdict)
        return built[0] if built else ReplayCheck.passive(shared)

    def _share_replay(self) -> None:
        """Every rank adopts rank 0's verdict (collective)."""
        assert self._replay is not None
        verdict = collective.from_rank0(self._replay.verdict)
        if collective.rank() != 0:
            self._replay = ReplayCheck.passive(verdict)

    def _decided(self, verdict: ReplayVerdict | None) -> None:
        if verdict is not None:
            self._log.append({"segment": self._log.segment, "replay": verdict.record()})
