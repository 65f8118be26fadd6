"""PyTorch Lightning: :class:`UnbrokenCallback` saves and resumes a ``Trainer.fit`` run exactly.

One callback does it all, through :class:`unbroken.Checkpointer`; Lightning's own
``CheckpointIO`` and ``ckpt_path`` are not used (a Lightning checkpoint is a pickle, and it
holds neither the RNG nor, unless asked, the data position).

What is saved, and when (checked against Lightning 2.6):

- **When.** After a training batch (``on_train_batch_end``) whose optimizer step is done
  and after which nothing else happens before the next batch is fetched: not a batch
  that is still accumulating gradients, not the last batch of an epoch (the epoch-end
  hooks, epoch schedulers and the next epoch's shuffle follow it) and not a batch that
  validation follows (validation draws random numbers a resumed run would not). A save
  or stop that falls on such a batch is carried out after the next batch that qualifies.
  When ``fit()`` ends, its last step is saved if it was not: such a final checkpoint
  restores a finished run (for its weights, or to compare), but training on from it is
  refused, since it was taken where the loops cannot go on exactly.
- **What.** The LightningModule, the optimizers and LR schedulers of
  ``configure_optimizers``, the train dataloaders' positions (each per rank), the RNGs,
  the state of stateful callbacks, datamodule and precision plugin, and the fit loop's
  progress (``global_step``, epoch, batch index, scheduler and optimizer counters):
  ``Trainer.fit_loop.state_dict()`` as Lightning's own checkpoints hold it.
- **Restore.** In ``on_train_start``: the train dataloaders exist and the sanity check
  is over, and no training batch has been fetched. The fit loop gets its saved state
  and is reset again, as Lightning does before it runs when given ``ckpt_path``; the
  data fetcher is re-created on the restored loaders (whose iterators were made inside
  the restore, before the RNGs were set, so nothing shifts a random draw).

Lightning's private attributes and functions this module relies on are used only in
``_Fit`` and ``_LoopState`` below.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from ..checkpointer import Checkpointer
from ..errors import CheckpointError, StateMismatchError
from ..live.frozen import check_mode
from ..live.probe import Probe
from ..report import RestoreReport
from . import _lightning_fsdp

logger = logging.getLogger(__name__)

LOOPS = "lightning_loops"
FINAL = "unbroken:final"


class UnbrokenCallback(pl.Callback):
    """Checkpoints a Lightning run with :class:`unbroken.Checkpointer` and resumes it exactly.

    Add it to ``Trainer(callbacks=[...])`` and call ``trainer.fit(model)`` as always:
    the latest committed checkpoint in ``dirpath`` is restored when training starts (a
    fresh start if there is none), one is saved every ``every_n_steps`` optimizer steps
    and when ``fit()`` ends, and on preemption (SIGTERM/SIGUSR1, or ``UNBROKEN_STOP_AT``)
    one is saved and ``trainer.should_stop`` is set. Every step's loss and gradient norm
    are tracked (:meth:`unbroken.Checkpointer.track`), so ``unbroken resume-test`` and
    the post-resume checks can compare. Runs on one device, with ``strategy="ddp"``,
    ``FSDPStrategy`` (FSDP1) and ``ModelParallelStrategy`` (FSDP2 ``fully_shard`` in
    ``configure_model``); every rank must have the callback. Sharded model and optimizer
    state restores onto any number of devices; per-rank state (RNG, loader positions)
    onto the saved number only, unless ``reset`` names it.

    Args:
        dirpath: the run's checkpoint folder (``Checkpointer``'s ``path``).
        every_n_steps: save every this many optimizer steps (``trainer.global_step``);
            None saves only at the last step and on a stop.
        keep_last: committed checkpoints to keep (None: all).
        extra: name -> object with ``state_dict``/``load_state_dict``, saved too.
        probe: ``callable(module) -> Tensor | float`` recomputed after restore.
        restore_step: restore this committed step instead of the latest.
        reset: components to start fresh instead of restoring (``Checkpointer.restore``'s
            ``reset``): ``{"rng", "dataloader"}`` to resume on another number of devices,
            where each rank's saved RNG and loader position have no counterpart (the
            resumed epoch then starts its data over, sharded the new way).
        require: a fresh start is an error (default: ``UNBROKEN_REQUIRE_CHECKPOINT=1``).
        async_save: see ``Checkpointer``.
        loss_metric: the name the loss is tracked under (from ``training_step``'s
            returned loss).
        grad_norm_metric: the name the gradients' total L2 norm (before clipping) is
            tracked under; None tracks none.
        frozen: ``"verify"``: frozen parameters are not saved, their fingerprints are,
            checked at restore (see ``Checkpointer``, docs/fine-tuning.md).

    Attributes:
        checkpointer: the :class:`unbroken.Checkpointer`, once training started.
        report: the :class:`unbroken.RestoreReport` of this fit's restore.

    Raises (at training start, before anything is restored):
        CheckpointError: the run holds state this callback cannot restore exactly (the
            message names it and what to do).
        TypeError: a train dataloader has no ``state_dict()`` (a plain ``DataLoader``).

    Example::

        from unbroken.integrations.lightning import UnbrokenCallback
        trainer = L.Trainer(max_steps=1000, callbacks=[UnbrokenCallback("ckpts/run1",
                            every_n_steps=100)], enable_checkpointing=False)
        trainer.fit(model)  # resumes from ckpts/run1 when it holds a checkpoint

    Not thread-safe; one instance per ``Trainer``.
    """

    def __init__(
        self,
        dirpath: str | os.PathLike,
        *,
        every_n_steps: int | None = None,
        keep_last: int | None = 3,
        extra: Mapping[str, Any] | None = None,
        probe: Probe | None = None,
        restore_step: int | None = None,
        reset: Collection[str] = (),
        require: bool | None = None,
        async_save: bool | str = False,
        loss_metric: str = "loss",
        grad_norm_metric: str | None = "grad_norm",
        frozen: str = "save",
    ) -> None:
        if every_n_steps is not None and (not isinstance(every_n_steps, int) or every_n_steps < 1):
            raise ValueError(f"every_n_steps must be >= 1 or None, got {every_n_steps!r}")
        self._dirpath = dirpath
        self._every = every_n_steps
        self._options = dict(
            keep_last=keep_last,
            probe=probe,
            async_save=async_save,
            loss_metric=loss_metric,
            grad_norm_metric=grad_norm_metric,
            frozen=check_mode(frozen),
        )
        self._extra = dict(extra or {})
        if isinstance(reset, str) or not all(isinstance(name, str) for name in reset):
            raise TypeError(f"reset must be a collection of component names, got {reset!r}")
        self._restore_step = restore_step
        self._reset = frozenset(reset)
        self._require = require
        self._loss_metric, self._grad_norm_metric = loss_metric, grad_norm_metric
        self.checkpointer: Checkpointer | None = None
        self.report: RestoreReport | None = None
        self._grad_norm: torch.Tensor | None = None
        self._module: torch.nn.Module | None = None  # the module holding the trained state
        self._shard_group: Any = None  # FSDP1's, for the gradient norm
        self._loops: _LoopState | None = None
        self._start(0)

    def _start(self, step: int) -> None:
        self._tracked = self._saved = step  # the last step tracked, and saved
        self._pending_save = False  # asked for at a batch where saving is not exact
        self._pending_stop = False

    # -- restore ----------------------------------------------------------------------

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        fit = _Fit(trainer)
        fit.check_supported(pl_module)
        self._loops = _LoopState(fit)
        self._module = _lightning_fsdp.trained_module(trainer, pl_module)
        extra = {LOOPS: self._loops, **fit.stateful_parts(), **self._extra}
        self.checkpointer = Checkpointer(
            self._dirpath,
            model=self._module,
            optimizer=_one_or_named(trainer.optimizers),
            scheduler=_one_or_named([c.scheduler for c in trainer.lr_scheduler_configs]),
            dataloader=_one_or_named(fit.loaders()),
            extra=extra,
            **self._options,
        )
        self._shard_group = _lightning_fsdp.shard_group(self._module)
        self.report = self.checkpointer.restore(
            self._restore_step, reset=self._reset, require=self._require
        )
        self._start(self.report.step)
        rank_zero_info(f"unbroken: {self.report.headline}")
        if not self.report.restored:
            return
        fit.resume_loops()
        if self._loops.final and not trainer.fit_loop.done:
            raise CheckpointError(
                f"step {self.report.step} ({self.report.path}) was saved when fit() ended, "
                "at a batch after which the loops cannot go on exactly (an epoch end, "
                "validation or gradient accumulation followed it); to train further, "
                f"restore an earlier step (restore_step=, one of {self.checkpointer.steps()}) "
                "or start a new run"
            )
        if trainer.global_step != self.report.step:
            raise StateMismatchError(
                f"the restored fit loop is at global_step {trainer.global_step}, the "
                f"checkpoint at step {self.report.step} ({self.report.path}): the loop state "
                "does not belong to this checkpoint; restore another step (restore_step=)"
            )

    # -- tracking ---------------------------------------------------------------------

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        if self._grad_norm_metric is None:
            return
        assert self._module is not None, "on_train_start has not run"
        norm = _lightning_fsdp.grad_norm(self._module, self._shard_group)
        if norm is not None:
            self._grad_norm = norm

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        ckpt = self.checkpointer
        assert ckpt is not None, "on_train_start has not run"
        step = trainer.global_step
        if step == self._tracked:  # no optimizer step in this batch (accumulating)
            return
        self._tracked = step
        ckpt.track(step, **self._metrics(outputs))
        due = (self._every is not None and step % self._every == 0) or step == trainer.max_steps
        self._pending_save |= due
        self._pending_stop |= ckpt.should_stop(step)  # collective: every rank, every step
        if not (self._pending_save or self._pending_stop):
            return
        if not _Fit(trainer).between_batches():
            logger.info(
                "step %d: a checkpoint here would not be exact; saving after the next batch", step
            )
            return
        ckpt.save(step)
        self._saved, self._pending_save = step, False
        if self._pending_stop:
            self._pending_stop = False
            trainer.should_stop = True
            if not _Fit(trainer).can_stop():
                logger.warning(
                    "stop requested at step %d, but min_epochs/min_steps are not "
                    "met: Lightning goes on training",
                    step,
                )

    def _metrics(self, outputs: Any) -> dict[str, Any]:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        metrics: dict[str, Any] = {}
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            metrics[self._loss_metric] = loss.detach().reshape(())
        if self._grad_norm_metric is not None and self._grad_norm is not None:
            metrics[self._grad_norm_metric] = self._grad_norm
            self._grad_norm = None
        return metrics

    # -- end --------------------------------------------------------------------------

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        ckpt = self.checkpointer
        if ckpt is None:
            return
        if trainer.global_step > self._saved:  # the last step, not at a batch that qualified
            assert self._loops is not None
            self._loops.final = True
            ckpt.save(trainer.global_step)
        ckpt.close()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()


class _LoopState:
    """The ``lightning_loops`` component: ``Trainer.fit_loop``'s progress, ``Stateful``.

    The data loaders' positions are their own component, so the loop's copy of them is
    left out. Loading it also sets the samplers' epoch to the restored one, before the
    ``dataloader`` component (installed after every extra) re-creates their iterators.
    """

    def __init__(self, fit: _Fit) -> None:
        self._fit = fit
        self.final = False  # saved when fit() ended: the loops cannot go on exactly

    def state_dict(self) -> dict[str, Any]:
        state = self._fit.loop.state_dict()
        own = dict(state.get("state_dict", {}))
        own.pop("combined_loader", None)
        return {**state, "state_dict": own, FINAL: self.final}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        self.final = bool(state.pop(FINAL, False))
        self._fit.loop.load_state_dict(state)
        epoch = self._fit.loop.epoch_progress.current.processed
        for loader in self._fit.loaders():
            _set_sampler_epoch(loader, epoch)


class _Fit:
    """The fit loop's internals this integration reads or drives (Lightning 2.6)."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer
        self.loop = trainer.fit_loop

    def loaders(self) -> list[Any]:
        combined = self.loop._combined_loader
        return list(combined.flattened) if combined is not None else []

    def check_supported(self, pl_module: pl.LightningModule) -> None:
        trainer = self.trainer
        where = "UnbrokenCallback"
        if not isinstance(trainer.strategy, _lightning_fsdp.SUPPORTED_STRATEGIES):
            raise CheckpointError(
                f"{where}: strategy {type(trainer.strategy).__name__} is not supported (its "
                f"exact resume is unverified); use {_lightning_fsdp.SUPPORTED_NAMES}"
            )
        if trainer.ckpt_path is not None:
            raise CheckpointError(
                f"{where}: fit(ckpt_path={trainer.ckpt_path!r}) restores Lightning's own "
                "checkpoint on top of ours; leave ckpt_path out (the callback resumes "
                "from its folder)"
            )
        for hook in ("on_save_checkpoint", "on_load_checkpoint"):
            if is_overridden(hook, pl_module):
                raise CheckpointError(
                    f"{where}: {type(pl_module).__name__}.{hook} is overridden, and the "
                    "callback never calls it (it saves no Lightning checkpoint dict): keep "
                    "that state in an object with state_dict()/load_state_dict() and pass "
                    "it as UnbrokenCallback(extra={...})"
                )
        if not self.loaders():
            raise CheckpointError(f"{where}: the trainer has no train dataloader to save")
        for i, loader in enumerate(self.loaders()):
            samplers = (
                getattr(loader, "sampler", None),
                getattr(getattr(loader, "batch_sampler", None), "sampler", None),
            )
            if any(isinstance(s, DistributedSamplerWrapper) for s in samplers):
                raise CheckpointError(
                    f"{where}: train dataloader {i}'s sampler is wrapped in Lightning's "
                    "DistributedSamplerWrapper (it wraps a sampler other than torch's "
                    "RandomSampler/SequentialSampler, e.g. the one StatefulDataLoader("
                    "shuffle=True) makes), whose order (a shuffle drawn at each epoch) is "
                    "not in the loader's state: give the loader a "
                    "torch.utils.data.DistributedSampler(dataset, shuffle=True, seed=...) "
                    "and pass Trainer(use_distributed_sampler=False)"
                )
        fetcher = self.loop._data_fetcher
        if getattr(fetcher, "batches", None):
            raise CheckpointError(
                f"{where}: Lightning prefetched a batch of a train dataloader without len() "
                "(an IterableDataset), so the loader's saved position would skip it; give "
                "the dataset a __len__"
            )

    def stateful_parts(self) -> dict[str, Any]:
        """Callbacks, datamodule and precision plugin that hold state, by component name."""
        trainer, parts = self.trainer, {}
        for cb in trainer.callbacks:
            if not isinstance(cb, UnbrokenCallback) and cb.state_dict():
                name = base = f"callback_{type(cb).__name__}"
                n = 1
                while name in parts:  # a second callback of the same class
                    name, n = f"{base}_{n}", n + 1
                parts[name] = cb
        if trainer.datamodule is not None and trainer.datamodule.state_dict():
            parts["datamodule"] = trainer.datamodule
        if trainer.precision_plugin.state_dict():
            parts["precision"] = trainer.precision_plugin
        return parts

    def between_batches(self) -> bool:
        """In ``on_train_batch_end``: is nothing but fetching the next batch left to do?"""
        epoch_loop = self.loop.epoch_loop
        return not (
            epoch_loop._should_accumulate()
            or epoch_loop._num_ready_batches_reached()
            or epoch_loop._should_check_val_fx(self.loop._data_fetcher)
        )

    def can_stop(self) -> bool:
        """Does Lightning honour ``should_stop`` now (min_epochs/min_steps met)?"""
        return self.loop._can_stop_early

    def resume_loops(self) -> None:
        """After the restore: Lightning's restart bookkeeping, and batches from the
        restored loaders (whose iterators the restore made)."""
        self.loop.reset()
        iter(self.loop._data_fetcher)


def _one_or_named(objs: Sequence[Any]) -> Any:
    if not objs:
        return None
    return objs[0] if len(objs) == 1 else {str(i): obj for i, obj in enumerate(objs)}
