"""The public entry point: :class:`Checkpointer`, a facade over one save and one restore
(``core/``) and what the run remembers across calls (``run/``)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .core import background, collective, process_exit, restoring, resuming, saving
from .core.collective import any_rank, rank
from .errors import CheckpointError
from .live import gradients as grads
from .live import probe
from .live.components import as_step, build_components
from .live.stopping import StopPolicy, stop_tier
from .report import RestoreReport
from .run.replay_check import ReplayVerdict
from .run.run import Run
from .run.trackers import Tracker
from .storage.locate import checkpoint_dir, pinned
from .tiers import local_restore, local_save
from .tiers.config import LocalTier
from .tiers.local_save import LocalSaveSkipped
from .tiers.store import LocalStore, estimate_bytes

logger = logging.getLogger(__name__)


class Checkpointer:
    """Saves and restores the whole training state exactly, and proves it on restore.

    Every call that touches checkpoints (``save``, ``restore``, ``should_stop``) is
    collective: under ``torch.distributed`` all ranks must make it, in the same order.
    Not thread-safe: use one Checkpointer from the training loop's thread.
    At interpreter exit it destroys the default process group if the script left it, and
    waits until gloo's worker threads are idle, so that none aborts the finalizing
    interpreter (core/process_exit.py).

    One run per folder: a save finding steps that another run committed since this
    Checkpointer started or restored is refused naming both runs (run/ownership.py).

    Args:
        path: folder of this run's checkpoints (a local path or ``file://`` URL, or an
            object store's URL). A relative path is made absolute once, here, against
            the current directory (symbolic links are not resolved): ``os.chdir`` later
            changes nothing, and :attr:`path` returns it.
        model: the module (plain, DDP, FSDP2, compiled, activation-checkpointed) or a
            dict name -> module.
        optimizer: an optimizer, a dict name -> optimizer, or None.
        scheduler: an LR scheduler, a dict of them, or None.
        dataloader: anything with ``state_dict``/``load_state_dict`` (e.g. torchdata's
            ``StatefulDataLoader``); saved per rank.
        extra: name -> object with ``state_dict``/``load_state_dict``. Saved once when
            its state is the same on every rank; saved per rank (each rank's own value,
            restorable onto the same world size only) when it differs, as is the scheduler.
        probe: ``callable(model) -> Tensor | float``, recorded at save and recomputed
            after restore; any difference raises ``StateMismatchError``.
        keep_last: committed checkpoints to keep (None: keep all).
        async_save: ``True``: ``save()`` returns once the state is copied into reusable
            host buffers (one extra copy of the state in memory); writing, fingerprinting
            and the commit run in a background thread. ``"overlap"``: ``save()`` copies
            only the small state (buffers, scheduler, data position, RNG, ``extra``) and
            returns; the parameters and optimizer state are copied in the background
            while the next forward and backward run, and each optimizer's ``step()``
            waits for that copy (a step pre-hook) before changing them. The checkpoint is
            still exactly the state at ``save(step)``: until the next ``step()``, change
            parameters or optimizer state in place only through these optimizers, or
            call :meth:`wait` first; any other change (found by torch's tensor version
            counters) refuses the save with ``CheckpointError`` (core/background.py).
            On a GPU the host buffers are pinned, allocated at the first save (about a
            second per 3 GB): that save first copies the state beside itself on the
            device where there is room (one more copy there until the host copy is
            done), so the next step need not wait for the allocation.
            One save is in flight at a time: the next ``save()``, ``restore()`` or
            ``close()`` waits for it and raises its error.
        overwrite: the committed checkpoints already in ``path`` belong to a run this one
            replaces: ``restore()`` ignores them and the first save retires them (kept
            aside as ``.retired-step_*``, nothing deleted). Without it, saving into a
            folder holding another run's checkpoints without restoring raises. It never
            replaces a run that is still saving there: a step committed after this
            Checkpointer was made still refuses its saves.
        loss_metric: the name under which :meth:`track` receives the training loss; the
            post-resume health check watches it (docs/health-check.md). Default ``"loss"``.
        grad_norm_metric: the tracked gradient norm's name, or None if none is tracked
            (the check then judges the loss alone). Default ``"grad_norm"``.
        trackers: rank 0 forwards tracked metrics to them (docs/integrations/trackers.md).
        gradients: what a save does with gradients the parameters hold (a save between
            two micro-batches of gradient accumulation). ``"warn"`` (default): they are
            not saved; when some are nonzero the save warns naming them and the manifest
            records it (``gradients``). ``"save"``: every ``.grad`` that exists is saved
            (the component ``gradients``) and restored bit for bit, so a stop between
            micro-batches resumes exactly; with ``zero_grad(set_to_none=True)`` (torch's
            default) a save at a step boundary holds none and costs nothing more.
        local: a :class:`LocalTier`: a second tier of checkpoints in each node's memory,
            replicated on peer nodes (docs/tiers.md). ``save(step, tier="local")`` writes
            there; ``restore()`` takes the newest step that is complete across the
            surviving nodes when it is newer than the newest persistent one, verified
            like any restore, else falls back (loudly) to the persistent tier.
            Constructing it is collective (the nodes are found, each node's folder is
            checked: writable, in local memory, one job's, with room).
        frozen: ``"save"`` (default): every parameter is saved. ``"verify"``: parameters
            that do not require grad (a fine-tune's base) are not written; their
            fingerprints are, and ``restore()`` checks the live ones against them bit for
            bit before anything changes (``StateMismatchError`` naming them otherwise:
            load the same base, revision and dtype first). One that changed since the
            previous save (an in-place edit, an EMA) is saved in full with a warning, and
            so is a parameter that shares a name or memory with a trainable one
            (docs/fine-tuning.md). Either mode restores checkpoints of the other.

    Example::

        ckpt = ub.Checkpointer("ckpts/run1", model=model, optimizer=opt,
                               loss_metric="train/loss", grad_norm_metric=None)
        report = ckpt.restore()
        for step in range(report.step, total):
            ckpt.track(step + 1, **{"train/loss": loss})
            ckpt.save(step + 1)
        ckpt.close()
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        model: nn.Module | Mapping[str, nn.Module],
        optimizer: Any = None,
        scheduler: Any = None,
        dataloader: Any = None,
        extra: Mapping[str, Any] | None = None,
        probe: probe.Probe | None = None,
        keep_last: int | None = 3,
        async_save: bool | str = False,
        overwrite: bool = False,
        loss_metric: str = "loss",
        grad_norm_metric: str | None = "grad_norm",
        trackers: Sequence[Tracker] | None = None,
        gradients: str = "warn",
        local: LocalTier | None = None,
        frozen: str = "save",
    ) -> None:
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last!r}")
        if probe is not None and not callable(probe):
            raise TypeError(f"probe must be callable(model), got {type(probe).__name__}")
        self._dir = checkpoint_dir(pinned(path))  # resolved once: os.chdir changes nothing
        self._overwrite = bool(overwrite)
        self._model = model
        self._probe = probe
        self._components = build_components(
            model,
            optimizer,
            scheduler,
            dataloader,
            extra,
            gradients=grads.check_mode(gradients),
            frozen=frozen,
        )
        self._run = Run(
            self._dir,
            self._components,
            keep_last=keep_last,
            overwrite=self._overwrite,
            loss_metric=loss_metric,
            grad_norm_metric=grad_norm_metric,
            trackers=trackers,
        )
        self._noted_per_rank: set[str] = set()  # shared components found to differ by rank
        process_exit.register()  # no framework collective may abort the exit
        self._stop = StopPolicy(agree=any_rank)
        self._closed = False
        if local is not None and not isinstance(local, LocalTier):
            raise TypeError(f"local must be a ub.LocalTier, got {type(local).__name__}")
        self._local = (
            LocalStore(local, str(self._dir.root), estimate_bytes(model, optimizer is not None))
            if local is not None
            else None
        )
        mode = background.check_mode(async_save)
        self._saver = background.BackgroundSaver(mode, self._components) if mode else None
        self._gradient_watch = grads.WATCH  # which gradients a step consumed (shared)

    @property
    def run_id(self) -> str:
        """The run's id (letters, digits: a W&B id), one for all ranks, resumes and forks;
        decided by :meth:`restore`, else the first :meth:`save` (before: CheckpointError)."""
        return self._run.run_id

    @property
    def path(self) -> str:
        """The run folder, as resolved when this Checkpointer was made (absolute)."""
        return str(self._dir.root)

    def steps(self, tier: str = "persistent") -> list[int]:
        """Committed steps, ascending; ``tier="local"``: the local steps every node has
        committed (collective)."""
        if tier == "local":
            return self._local_store().steps()
        if tier != "persistent":
            raise ValueError(f'tier must be "persistent" or "local", got {tier!r}')
        return self._dir.steps()

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, step: int, tier: str = "persistent") -> str:
        """Save the whole training state as checkpoint ``step`` and commit it.

        ``tier="local"``: into the local tier only (``local=LocalTier(...)``): each node's
        folder in memory, replicated on peer nodes behind training. A local save that
        cannot fit or fails is not committed anywhere and warns (:attr:`warnings`): it
        never stops training and never touches the persistent tier.

        Returns the committed folder. Collective. Raises ``CheckpointError`` (and leaves
        every committed checkpoint untouched) if anything fails, among others when the
        folder holds a step that another run committed since this Checkpointer started
        or restored (or before, if it neither restored nor was made with ``overwrite``):
        the message names both runs, the step and what to do. A save whose model changed
        since the last one while an optimizer covering it holds no state and did not step
        is committed with a warning (:attr:`warnings`, the manifest's ``save_warnings``),
        as is a save while parameters hold nonzero gradients that it does not save (in
        the middle of gradient accumulation; see ``gradients``).
        """
        self._check_open()
        step = as_step(step)
        if tier not in ("persistent", "local"):
            raise ValueError(f'tier must be "persistent" or "local", got {tier!r}')
        if tier == "persistent" and self._stop.stopping_at(step) and stop_tier() == "local":
            if self._local is None:
                raise CheckpointError(
                    f"UNBROKEN_STOP_TIER=local (resume-test --tier local) asks the stop's "
                    f"save of step {step} to go to the local tier, but this Checkpointer "
                    "has none: pass local=ub.LocalTier(...)"
                )
            tier = "local"  # UNBROKEN_STOP_TIER=local: the stop's save (resume-test)
            if rank() == 0:
                logger.info("step %d: the stop's save goes to the local tier", step)
        local = tier == "local"
        store = self._local_store() if local else None
        record = probe.record(self._probe, self._model) if self._probe is not None else None
        self.wait()
        request = saving.SaveRequest(
            step=step,
            components=self._components,
            run=self._run.begin_save(step, local=local),
            probe=record,
            noted_per_rank=self._noted_per_rank,
            gradient_watch=self._gradient_watch,
        )
        finish = self._finish_save if store is None else self._finish_local
        if self._saver is None:
            finish(saving.stage(request))
        else:
            staged = saving.stage(request, self._saver.buffers, self._saver.defer())
            self._saver.submit(staged, finish)
        if store is not None:
            return str(store.folder.step_path(step))
        return str(self._dir.step_path(step))

    def _finish_save(self, staged: saving.Staged) -> None:
        saving.write(self._dir, staged)
        self._run.committed(staged.request.step, staged.warnings)

    def _finish_local(self, staged: saving.Staged) -> None:
        store = self._local_store()
        try:
            _, warnings = local_save.save(store, staged)
        except LocalSaveSkipped as exc:
            if rank() == 0:
                logger.warning("%s", exc)
            self._run.committed(staged.request.step, [str(exc)], local=True)
            return
        self._run.committed(staged.request.step, warnings, local=True)

    def _local_store(self) -> LocalStore:
        if self._local is None:
            raise CheckpointError(
                'tier="local" needs a local tier: pass local=ub.LocalTier(...) to the Checkpointer'
            )
        return self._local

    def wait(self) -> None:
        """Wait for an in-flight asynchronous save; raise its error if it failed.

        With ``async_save="overlap"``, call it before changing parameters or optimizer
        state in place other than through the optimizers' ``step()`` (an EMA update,
        weight surgery) between ``save()`` and the next step.
        """
        if self._saver is not None:
            self._saver.wait()

    def wait_replicated(self) -> None:
        """Wait until every local step saved so far is copied to its peer nodes (local to
        this rank; without a local tier, returns at once)."""
        self.wait()
        if self._local is not None:
            self._local.wait()

    def restore(
        self,
        step: int | None = None,
        *,
        reset: Iterable[str] | None = None,
        skip: Iterable[str] | None = None,
        require: bool | None = None,
    ) -> RestoreReport:
        """Restore the latest committed checkpoint (or ``step``); a fresh start if none.

        Args:
            step: a committed step to restore instead of the latest.
            reset: components passed here to start fresh on purpose (recorded in the
                lineage).
            skip: components the checkpoint holds but that were not passed here, left
                out on purpose (recorded; without it their absence is an error).
            require: a fresh start is an error (default: the environment variable
                ``UNBROKEN_REQUIRE_CHECKPOINT=1``, for launch scripts of resumed jobs).
        Raises:
            CheckpointNotFoundError: ``require`` and no checkpoint (the message says where
                it looked and what it found), or ``step`` is not committed.
            IncompleteCheckpointError: the checkpoint lacks something passed here.
            CorruptCheckpointError: a file is missing, truncated or altered.
            StateMismatchError: it does not fit the live objects (or holds a component not
                passed and not in ``skip``), or verification failed. Nothing live changed.
        """
        self._check_open()
        self.wait()
        reset_set, skip_set = set(reset or ()), set(skip or ())
        done, local_notes = None, []
        if self._local is not None and step is None and not self._overwrite:
            resuming.check_names(self._components, reset_set, skip_set)
            newest = collective.on_rank0(self.latest_step)
            request = restoring.RestoreRequest(reset_set, skip_set, self._probe, self._model)
            done, local_notes = local_restore.restore(
                self._local, newest, self._components, request
            )
            if done is None and local_notes and rank() == 0:
                for note in local_notes:
                    logger.warning("%s", note)
        if done is None:
            done = resuming.resume(
                self._dir,
                self._components,
                step=step,
                reset=reset_set,
                skip=skip_set,
                require=resuming.require_from_env(require),
                ignore=self._overwrite,
                probe_fn=self._probe,
                model=self._model,
            )
            if local_notes:
                done.report.warnings[:0] = local_notes
        if self._local is not None:
            self._local.drop_newer(done.step or 0)
        if done.doc is not None and rank() == 0:
            logger.info("%s", done.report)
        self._run.restored(done, reset=reset_set, skip=skip_set)
        return done.report

    def track(self, step: int, **metrics: float | torch.Tensor) -> None:
        """Record scalar metrics of ``step`` (floats or 0-d tensors).

        The last steps go into each checkpoint's manifest, the whole series into
        ``metrics.jsonl`` (on a store: objects under ``metrics/``; see
        :func:`unbroken.format.series.read_series`); after a resume the
        ones named ``loss_metric`` and ``grad_norm_metric`` feed the health check, whose
        finding (at most one per resume) is logged and kept in :attr:`warnings`.
        """
        self._run.track(as_step(step), metrics)

    @property
    def replay(self) -> ReplayVerdict | None:
        """The replay check of the last resume (None without one): steps the earlier run
        had tracked after the restored checkpoint, compared bit for bit as they are
        tracked again. Decided on rank 0 (which records metrics); other ranks receive its
        verdict at each ``save()`` and at ``close()``."""
        return self._run.replay

    @property
    def warnings(self) -> list[str]:
        """Warnings about the last resume (the health check's, a replay difference) and
        about the last committed save (e.g. an optimizer holding no state while the
        parameters it covers changed: run/idle_optimizers.py; with ``async_save``,
        known once that save committed), and replicas of local steps that could not be
        completed (this rank's)."""
        replicas = self._local.failures if self._local is not None else []
        return [*self._run.warnings, *replicas]

    def should_stop(self, step: int) -> bool:
        """True on every rank once SIGTERM/SIGUSR1 arrived, or at ``UNBROKEN_STOP_AT``."""
        return self._stop.should_stop(step)

    def close(self) -> None:
        """Finish pending work and restore the previous signal handlers."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
            self._run.finish()
        finally:
            self._run.release()
            self._stop.close()
            if self._saver is not None:
                self._saver.close()
            if self._local is not None:
                self._local.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed")
