"""The public entry point: :class:`Checkpointer` orchestrates save, restore and retention."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .core import collective, restoring, saving
from .core.staging import StagingBuffers
from .errors import CheckpointError, CorruptCheckpointError
from .format.storage import CheckpointDir
from .live import probe
from .live.rng import RNGState
from .live.state import Component, ModelComponent, OptimizerComponent, StatefulComponent
from .live.stopping import StopPolicy
from .proof.metrics import MetricLog
from .proof.monitor import HealthCheck
from .report import RestoreReport

logger = logging.getLogger(__name__)

BUILTIN_COMPONENTS = ("model", "optimizer", "scheduler", "dataloader", "rng")
METRICS_WINDOW = 200


class Checkpointer:
    """Saves and restores the whole training state exactly, and proves it on restore.

    Every call that touches checkpoints (``save``, ``restore``, ``should_stop``) is
    collective: under ``torch.distributed`` all ranks must make it, in the same order.
    Not thread-safe: use one Checkpointer from the training loop's thread.

    Args:
        path: folder of this run's checkpoints (a local path or ``file://`` URL).
        model: the module (plain, DDP, FSDP2, compiled, activation-checkpointed) or a
            dict name -> module.
        optimizer: an optimizer, a dict name -> optimizer, or None.
        scheduler: an LR scheduler, a dict of them, or None.
        dataloader: anything with ``state_dict``/``load_state_dict`` (e.g. torchdata's
            ``StatefulDataLoader``); saved per rank.
        extra: name -> object with ``state_dict``/``load_state_dict`` (same on all ranks).
        probe: ``callable(model) -> Tensor | float``, recorded at save and recomputed
            after restore; any difference raises ``StateMismatchError``.
        keep_last: committed checkpoints to keep (None: keep all).
        async_save: ``save()`` returns once the state is copied into reusable host
            buffers (one extra copy of the state in memory); writing, fingerprinting and
            the commit run in a background thread. One save is in flight at a time: the
            next ``save()``, ``restore()`` or ``close()`` waits for it and raises its error.
        loss_metric: the name under which :meth:`track` receives the training loss; the
            post-resume health check watches it (docs/health-check.md). Default ``"loss"``.
        grad_norm_metric: the tracked gradient norm's name, or None if none is tracked
            (the check then judges the loss alone). Default ``"grad_norm"``.

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
        async_save: bool = False,
        loss_metric: str = "loss",
        grad_norm_metric: str | None = "grad_norm",
    ) -> None:
        _check_metric_names(loss_metric, grad_norm_metric)
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last!r}")
        if probe is not None and not callable(probe):
            raise TypeError(f"probe must be callable(model), got {type(probe).__name__}")
        self._dir = CheckpointDir(path)
        self._model = model
        self._probe = probe
        self._keep_last = keep_last
        self._components = self._build_components(model, optimizer, scheduler, dataloader, extra)
        self._lineage: list[dict[str, Any]] = [
            {"event": "start", "time": time.time(), "world_size": collective.world_size()}
        ]
        self._metrics = MetricLog()
        self._metric_names = (loss_metric, grad_norm_metric)
        self._health: HealthCheck | None = None
        self._stop = StopPolicy(agree=collective.any_rank)
        self._closed = False
        self._async = bool(async_save)
        self._buffers = StagingBuffers() if self._async else None
        self._pending: Future[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        # A background save runs its collectives on a group of its own, so they never
        # interleave with the training loop's collectives on the default group.
        self._group = (
            dist.new_group(backend="gloo") if self._async and collective.active() else None
        )

    @staticmethod
    def _build_components(model, optimizer, scheduler, dataloader, extra) -> list[Component]:
        model_c = ModelComponent(model)
        comps: list[Component] = [model_c]
        if optimizer is not None:
            comps.append(OptimizerComponent(optimizer, model_c))
        if scheduler is not None:
            comps.append(StatefulComponent("scheduler", scheduler, kind="scheduler"))
        for name, obj in (extra or {}).items():
            if not isinstance(name, str) or not name.isidentifier() or name in BUILTIN_COMPONENTS:
                raise ValueError(
                    f"extra key {name!r} must be an identifier other than {BUILTIN_COMPONENTS}"
                )
            comps.append(StatefulComponent(name, obj, kind="extra"))
        if dataloader is not None:
            comps.append(
                StatefulComponent("dataloader", dataloader, kind="dataloader", per_rank=True)
            )
        comps.append(StatefulComponent("rng", RNGState(), kind="rng", per_rank=True))
        return comps

    @property
    def path(self) -> str:
        return str(self._dir.root)

    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        return self._dir.steps()

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, step: int) -> str:
        """Save the whole training state as checkpoint ``step`` and commit it.

        Returns the committed folder. Collective. Raises ``CheckpointError`` (and leaves
        every committed checkpoint untouched) if anything fails.
        """
        self._check_open()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        record = probe.record(self._probe, self._model) if self._probe is not None else None
        request = saving.SaveRequest(
            step=step,
            components=self._components,
            lineage=self._lineage,
            metrics=self._metrics.window(step, METRICS_WINDOW),
            probe=record,
        )
        self.wait()
        if not self._async:
            self._finish_save(saving.stage(request))
            return str(self._dir.step_path(step))
        staged = saving.stage(request, self._buffers)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="unbroken-save")
        self._pending = self._executor.submit(self._finish_save_in_background, staged)
        return str(self._dir.step_path(step))

    def _finish_save(self, staged: saving.Staged) -> None:
        saving.write(self._dir, staged)
        self._apply_retention(staged.request.step)
        self._flush_metrics()

    def _finish_save_in_background(self, staged: saving.Staged) -> None:
        with collective.using(self._group):
            self._finish_save(staged)

    def wait(self) -> None:
        """Wait for an in-flight asynchronous save; raise its error if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def restore(
        self, step: int | None = None, *, reset: Iterable[str] | None = None
    ) -> RestoreReport:
        """Restore the latest committed checkpoint (or ``step``); a fresh start if none.

        Args:
            step: a committed step to restore instead of the latest.
            reset: component names to start fresh on purpose (recorded in the lineage).
        Raises:
            IncompleteCheckpointError: the checkpoint lacks something passed here.
            CorruptCheckpointError: a file is missing, truncated or altered.
            StateMismatchError: it does not fit the live objects, or verification failed.
        """
        self._check_open()
        self.wait()
        reset_set = set(reset or ())
        names = [c.name for c in self._components]
        unknown = sorted(reset_set - set(names))
        if unknown:
            raise ValueError(f"reset names unknown component(s) {unknown}; known: {names}")
        candidates = restoring.candidate_steps(self._dir, step)
        world = collective.world_size()
        if not candidates:
            return RestoreReport(world_size=world, components={n: "absent" for n in names})
        skipped: list[str] = []
        for chosen in candidates:
            folder = self._dir.step_path(chosen)
            try:
                doc = restoring.read_manifest(folder)
                report = restoring.restore(
                    folder, doc, self._components, reset_set, self._probe, self._model
                )
                break
            except CorruptCheckpointError as exc:
                # Damage is detected before any live object is touched, so an older
                # checkpoint can be tried. An explicitly requested step never falls back.
                if step is not None:
                    raise
                skipped.append(f"skipped the damaged checkpoint of step {chosen}: {exc}")
                if chosen == candidates[-1]:
                    raise CorruptCheckpointError(
                        f"no committed checkpoint in {self._dir.root} is sound: "
                        + "; ".join(skipped)
                    ) from exc
                logger.warning("checkpoint of step %d is damaged, trying an older one", chosen)
        report.warnings[:0] = skipped
        self._lineage = [
            *doc["lineage"],
            {
                "event": "resume",
                "from_step": chosen,
                "time": time.time(),
                "world_size": world,
                "reset": sorted(reset_set),
            },
        ]
        self._metrics.load_window(doc.get("metrics", []), resumed_from=chosen)
        if self._health is not None:
            self._health.close()
        self._health = self._health_check(report, chosen)
        if collective.rank() == 0:
            logger.info("%s", report)
        return report

    def _health_check(self, report: RestoreReport, resumed_from: int) -> HealthCheck:
        """The post-resume check: the tracked metrics, and the optimizers just restored."""
        optimizers = {
            name: opt
            for c in self._components
            if isinstance(c, OptimizerComponent) and report.components.get(c.name) == "restored"
            for name, opt in c.optimizers.items()
        }
        loss, grad_norm = self._metric_names
        return HealthCheck(
            self._metrics.values,
            resumed_from,
            loss=loss,
            grad_norm=grad_norm,
            optimizers=optimizers,
        )

    def track(self, step: int, **metrics: float | torch.Tensor) -> None:
        """Record scalar metrics of ``step`` (floats or 0-d tensors).

        The last steps go into each checkpoint's manifest, the whole series into
        ``metrics.jsonl`` (see :func:`unbroken.proof.metrics.read_series`); after a resume the
        ones named ``loss_metric`` and ``grad_norm_metric`` feed the health check, whose
        finding (at most one per resume) is logged and kept in :attr:`warnings`.
        """
        self._metrics.track(step, metrics)
        if self._health is not None:
            for warning in self._health.observe(step, self._metrics.values[step]):
                self._metrics.note(step, warning)

    @property
    def warnings(self) -> list[str]:
        """Health-check warnings about the last resume (empty when it looks right)."""
        return list(self._health.warnings) if self._health is not None else []

    def should_stop(self, step: int) -> bool:
        """True on every rank once SIGTERM/SIGUSR1 arrived, or at ``UNBROKEN_STOP_AT``."""
        return self._stop.should_stop(step)

    def close(self) -> None:
        """Finish pending work and restore the previous signal handlers."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._health is not None:
                self._health.close()
            self.wait()
            self._flush_metrics()
        finally:
            self._dir.finish_removals()
            self._stop.close()
            if self._executor is not None:
                self._executor.shutdown(wait=True)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed")

    def _flush_metrics(self) -> None:
        collective.agree(lambda: self._metrics.flush(self._dir.root), only_rank0=True)

    def _apply_retention(self, newest: int) -> None:
        if self._keep_last is None:
            return

        def prune() -> None:
            # Delete older checkpoints only once the new one reads back as committed.
            restoring.check_folder(self._dir.step_path(newest))
            steps = self._dir.steps()
            # Retention never removes the newest checkpoint, however steps are ordered.
            doomed = [s for s in steps if s != newest][: max(0, len(steps) - self._keep_last)]
            for s in doomed:
                self._dir.remove(s)

        collective.agree(prune, only_rank0=True)


def _check_metric_names(loss_metric: object, grad_norm_metric: object) -> None:
    """The names the health check reads: strings, non-empty, different."""
    for arg, name in (("loss_metric", loss_metric), ("grad_norm_metric", grad_norm_metric)):
        if name is None and arg == "grad_norm_metric":
            continue
        if not isinstance(name, str):
            allowed = "a str or None" if arg == "grad_norm_metric" else "a str"
            raise TypeError(f"{arg} must be {allowed}, got {type(name).__name__}")
        if not name:
            raise ValueError(f"{arg} must be a non-empty metric name, got ''")
    if grad_norm_metric == loss_metric:
        raise ValueError(f"loss_metric and grad_norm_metric must differ, both are {loss_metric!r}")
