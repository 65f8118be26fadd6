"""Hugging Face ``transformers.Trainer``: checkpoints through unbroken, resumed bit for bit.

Two lines change in a Trainer script::

    from unbroken.integrations.transformers import UnbrokenCallback, UnbrokenTrainer

    trainer = UnbrokenTrainer(model=model, args=args, train_dataset=train,
                              callbacks=[UnbrokenCallback("ckpts/run1")])
    trainer.train()  # resumes from the newest checkpoint in ckpts/run1, if there is one

(A Trainer subclass of your own, e.g. TRL's ``SFTTrainer``: ``class MyTrainer(
UnbrokenTrainerMixin, SFTTrainer)``.) The Trainer saves when its ``save_strategy`` says
(``save_steps``), and when ``ckpt.should_stop`` does (SIGTERM/SIGUSR1, or
``UNBROKEN_STOP_AT``), then stops; every save is an unbroken checkpoint instead of a
``checkpoint-N`` folder. Saved: the model, the optimizer, the LR scheduler, every rank's
RNGs, the ``TrainerState``, the loss summed since the last log, the AMP grad scaler, and
the settings the data position depends on.

Why a Trainer subclass and not only a callback: the Trainer decides which epoch to start
in and how many batches of it to skip from ``global_step`` *before* it creates the
optimizer (and before any callback runs), and it fetches the first resumed batch before
putting the RNGs back. So the subclass hands the Trainer's own resume path the saved
``TrainerState`` (it skips the seen batches of the reshuffled epoch itself), the callback
restores everything in ``on_train_begin`` (the optimizer and scheduler then exist, and no
batch has been drawn), and the RNGs restored there are put back again at the moment the
Trainer's resume path sets them. See docs/integrations/transformers.md.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from typing import Any

from transformers import Trainer, TrainerCallback

from ..checkpointer import Checkpointer
from ..errors import CheckpointError
from ..live.frozen import check_mode as check_frozen
from ..live.probe import Probe
from ..report import RestoreReport
from . import _transformers_state as hf

logger = logging.getLogger(__name__)

TRACKED = ("loss", "grad_norm", "learning_rate")  # from the Trainer's logs, every log step

NOT_BOUND = (
    "UnbrokenCallback was given to a Trainer that cannot resume through it: the Trainer "
    "chooses the data position before any callback runs. Use "
    "unbroken.integrations.transformers.UnbrokenTrainer in place of transformers.Trainer, "
    "or mix UnbrokenTrainerMixin into your Trainer class (class MyTrainer("
    "UnbrokenTrainerMixin, SFTTrainer): ...)"
)


class UnbrokenCallback(TrainerCallback):
    """Saves the Trainer's whole training state with :class:`unbroken.Checkpointer` and
    restores it before the first batch; use it with :class:`UnbrokenTrainer`.

    Args:
        path: the folder of this run's checkpoints (as for ``Checkpointer``).
        keep_last, async_save, probe, overwrite: as for ``Checkpointer``.
        frozen: as for ``Checkpointer``: ``"verify"`` leaves the parameters that do not
            require grad (a PEFT model's base) out of every checkpoint and checks the
            live ones against their fingerprints at the resume (docs/fine-tuning.md).
        extra: more ``Stateful`` objects to save, name -> object (as for ``Checkpointer``).
        step: restore this committed step instead of the newest one.
        reset: components to start fresh on purpose (``Checkpointer.restore(reset=)``),
            e.g. ``{"optimizer"}``; recorded in the checkpoint's lineage.
        require: a fresh start is an error (default: ``UNBROKEN_REQUIRE_CHECKPOINT``).

    After a resume, :attr:`report` is the ``RestoreReport`` and :attr:`checkpointer` the
    ``Checkpointer`` (until training ends). The Trainer's logged ``loss``, ``grad_norm``
    and ``learning_rate`` are tracked at every logging step (``logging_steps=1``: every
    step), which ``unbroken resume-test`` and the post-resume health check read.
    Not thread-safe; one callback per Trainer.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        keep_last: int | None = 3,
        async_save: bool | str = False,
        probe: Probe | None = None,
        overwrite: bool = False,
        frozen: str = "save",
        extra: Mapping[str, Any] | None = None,
        step: int | None = None,
        reset: Iterable[str] | None = None,
        require: bool | None = None,
    ) -> None:
        if extra and set(extra) & {hf.STATE, hf.LOOP, hf.DATA, "scaler"}:
            raise ValueError(
                f"extra may not use the names {[hf.STATE, hf.LOOP, hf.DATA, 'scaler']}"
            )
        self.path = os.fspath(path)
        self._options = {
            "keep_last": keep_last,
            "async_save": async_save,
            "probe": probe,
            "overwrite": overwrite,
            "frozen": check_frozen(frozen),
        }
        self._extra = dict(extra or {})
        self._step, self._reset, self._require = step, set(reset or ()), require
        self._trainer: Any = None
        self._point: hf.ResumePoint | None = None
        self._rng: dict[str, Any] | None = None
        self.checkpointer: Checkpointer | None = None
        self.report: RestoreReport | None = None

    # Called by UnbrokenTrainerMixin.train, before the Trainer builds anything.
    def _bind(self, trainer: Any) -> hf.ResumePoint | None:
        self._trainer, self._rng = trainer, None
        overwrite = self._options["overwrite"]
        self._point = None if overwrite else hf.find_resume_point(self.path, self._step)
        return self._point

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        trainer = self._trainer
        if trainer is None:
            raise RuntimeError(NOT_BOUND)
        live = hf.data_facts(args, trainer, kwargs["train_dataloader"])
        if self._point is not None:  # before anything live changes
            hf.check_data_order(
                self._point.data_order, live, where=f"the checkpoint {self._point.folder}"
            )
        self.checkpointer = Checkpointer(
            self.path,
            model=trainer.model,
            optimizer=getattr(trainer.optimizer, "optimizer", trainer.optimizer),
            scheduler=trainer.lr_scheduler,
            extra={**self._extra, **_trainer_extras(trainer, live)},
            grad_norm_metric="grad_norm" if args.max_grad_norm else None,
            **self._options,
        )
        point = self._point
        self.report = self.checkpointer.restore(
            point.step if point is not None else None, reset=self._reset, require=self._require
        )
        if state.is_world_process_zero:  # visible at the Trainer's default verbosity
            logger.warning("unbroken: %s", self.report.headline)
        if point is None and self.report.restored:
            raise CheckpointError(
                f"a checkpoint of step {self.report.step} appeared in {self.path} after "
                "training started from scratch; another run is saving there"
            )
        if point is not None:
            if state.global_step != point.step:  # the manifest said so; cannot differ
                raise CheckpointError(
                    f"restored global_step {state.global_step}, expected {point.step}"
                )
            self._rng = hf.rng_snapshot()  # put back when the Trainer restores its RNGs
            logger.info("resumed the Trainer at step %d: %s", point.step, self.report)

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if self.checkpointer is not None and self.checkpointer.should_stop(state.global_step):
            control.should_save = True  # the Trainer saves (through us) after it logs
            control.should_training_stop = True

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        if self.checkpointer is None or not logs or "loss" not in logs:
            return  # eval and the end-of-training summary have no "loss"
        values = {k: float(logs[k]) for k in TRACKED if isinstance(logs.get(k), int | float)}
        self.checkpointer.track(state.global_step, **values)

    def on_train_end(self, args, state, control, **kwargs) -> None:
        self._close()

    def _save(self, step: int) -> None:
        if self.checkpointer is None:
            raise RuntimeError(NOT_BOUND)
        self.checkpointer.save(step)

    def _put_back_rng(self) -> None:
        if self._rng is not None:
            hf.put_back(self._rng)

    def _close(self) -> None:
        ckpt, self.checkpointer = self.checkpointer, None
        self._trainer = None
        if ckpt is not None:
            ckpt.close()


def _trainer_extras(trainer: Any, facts: dict[str, Any]) -> dict[str, Any]:
    extras: dict[str, Any] = {
        hf.STATE: hf.TrainerStateView(trainer),
        hf.LOOP: hf.TrainerLoopView(trainer),
        hf.DATA: hf.DataOrder(facts),
    }
    scaler = getattr(trainer.accelerator, "scaler", None)
    if scaler is not None:
        extras["scaler"] = scaler
    return extras


class UnbrokenTrainerMixin:
    """Makes a ``transformers.Trainer`` (sub)class resume from its ``UnbrokenCallback``'s
    checkpoints: ``class MyTrainer(UnbrokenTrainerMixin, SFTTrainer): pass``.

    ``train()`` resumes from the newest checkpoint in the callback's folder (a fresh
    start if there is none) and every save the Trainer makes goes to that folder.

    Raises (from ``train()``, before anything is built):
        ValueError: ``resume_from_checkpoint`` is given (the callback's folder is where
            runs resume from), or a setting under which a resume cannot be exact:
            ``ignore_data_skip``, ``load_best_model_at_end``, DeepSpeed, an
            ``IterableDataset``; or not exactly one ``UnbrokenCallback``.
    """

    def train(self, resume_from_checkpoint: Any = None, trial: Any = None, **kwargs: Any) -> Any:
        if resume_from_checkpoint not in (None, False):
            raise ValueError(
                f"resume_from_checkpoint={resume_from_checkpoint!r}: an UnbrokenTrainer "
                "resumes from its UnbrokenCallback's folder by itself; leave it unset (to "
                "restore a given step: UnbrokenCallback(path, step=N))"
            )
        callback = _the_callback(self)
        _refuse_inexact(self)
        point = callback._bind(self)
        marker = tempfile.mkdtemp(prefix="unbroken-hf-resume-") if point is not None else None
        try:
            if point is not None:
                point.write_trainer_state(marker)
            self._unbroken_marker = marker
            return super().train(resume_from_checkpoint=marker, trial=trial, **kwargs)
        finally:
            callback._close()
            self._unbroken_marker = None
            if marker is not None:
                shutil.rmtree(marker, ignore_errors=True)

    # The Trainer's resume path, pointed at `marker`: the callback restores the model,
    # optimizer, scheduler and scaler (on_train_begin); the RNGs it restored are put back
    # when the Trainer sets its RNGs (after the first batch of a resumed epoch is drawn).
    def _is_ours(self, checkpoint: Any) -> bool:
        marker = getattr(self, "_unbroken_marker", None)
        return marker is not None and checkpoint == marker

    def _load_from_checkpoint(self, resume_from_checkpoint: Any, model: Any = None) -> None:
        if not self._is_ours(resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: Any) -> None:
        if not self._is_ours(checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)

    def _load_scaler(self, checkpoint: Any) -> None:
        if not self._is_ours(checkpoint):
            super()._load_scaler(checkpoint)

    def _load_rng_state(self, checkpoint: Any) -> None:
        if self._is_ours(checkpoint):
            _the_callback(self)._put_back_rng()
        else:
            super()._load_rng_state(checkpoint)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """The Trainer's save, as an unbroken checkpoint of ``global_step`` (collective)."""
        if self.hp_search_backend is None and trial is None:
            self.store_flos()  # as the Trainer does: FLOs counted so far into the state
        _export_callback_states(self)
        _the_callback(self)._save(self.state.global_step)


class UnbrokenTrainer(UnbrokenTrainerMixin, Trainer):
    """``transformers.Trainer`` that resumes through its :class:`UnbrokenCallback`.

    Example::

        trainer = UnbrokenTrainer(model=model, args=args, train_dataset=train,
                                  callbacks=[UnbrokenCallback("ckpts/run1")])
        trainer.train()
    """


def _the_callback(trainer: Any) -> UnbrokenCallback:
    found = [c for c in trainer.callback_handler.callbacks if isinstance(c, UnbrokenCallback)]
    if len(found) != 1:
        raise ValueError(
            f"an UnbrokenTrainer needs exactly one UnbrokenCallback in its callbacks, found "
            f"{len(found)}: pass callbacks=[UnbrokenCallback('ckpts/run1')]"
        )
    return found[0]


def _refuse_inexact(trainer: Any) -> None:
    args = trainer.args
    problems = []
    if args.ignore_data_skip:
        problems.append(
            "ignore_data_skip=True: a resumed run would start its epoch over; set it to False"
        )
    if args.load_best_model_at_end:
        problems.append(
            "load_best_model_at_end=True needs the Trainer's own checkpoint-N "
            "folders; set it to False"
        )
    if getattr(trainer, "is_deepspeed_enabled", False):
        problems.append(
            "DeepSpeed keeps the optimizer and scheduler inside its engine, which "
            "unbroken does not restore; use DDP or FSDP"
        )
    import torch.utils.data

    if isinstance(trainer.train_dataset, torch.utils.data.IterableDataset):
        problems.append(
            "an IterableDataset has no position the Trainer can skip to exactly "
            "(it re-reads and drops batches); use a map-style dataset"
        )
    if problems:
        raise ValueError("this Trainer cannot resume exactly: " + "; ".join(problems))
    if args.dataloader_num_workers:
        logger.warning(
            "dataloader_num_workers=%d: worker processes are seeded from a draw made when "
            "the epoch's iterator is created, which a resume makes at another RNG state; "
            "random draws in workers (augmentation, random collators) are not resumed "
            "exactly. Use 0 workers for random transforms, or check with unbroken resume-test",
            args.dataloader_num_workers,
        )


def _export_callback_states(trainer: Any) -> None:
    """Put ``ExportableState`` callbacks' state into ``TrainerState.stateful_callbacks``, as
    the Trainer does before it saves (so ``restore_callback_states_from_checkpoint`` works)."""
    from transformers.trainer_callback import ExportableState

    for cb in [*trainer.callback_handler.callbacks, trainer.control]:
        if isinstance(cb, ExportableState):
            name = type(cb).__name__
            held = trainer.state.stateful_callbacks.get(name)
            if isinstance(held, list):
                held.append(cb.state())
            else:
                trainer.state.stateful_callbacks[name] = cb.state()


__all__ = ["UnbrokenCallback", "UnbrokenTrainer", "UnbrokenTrainerMixin"]
