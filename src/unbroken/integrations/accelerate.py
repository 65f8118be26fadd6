"""Hugging Face Accelerate: one :class:`unbroken.Checkpointer` over everything an
``Accelerator`` prepared.

    from unbroken.integrations.accelerate import checkpointer_for

    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    ckpt = checkpointer_for(accelerator, "ckpts/run1")
    start = ckpt.restore().step

What it saves, by component name (``docs/integrations/accelerate.md``):

- ``model``, ``optimizer``, ``scheduler``: ``accelerator._models``, the optimizers inside
  ``accelerator._optimizers`` (``AcceleratedOptimizer.optimizer``) and the schedulers
  inside ``accelerator._schedulers``; one object each, or a dict keyed ``"0"``, ``"1"``...
  in the order they were prepared. DDP and FSDP wrappers are the Checkpointer's business.
- ``dataloader``: each prepared loader's position, per rank, mid-epoch included, with its
  epoch counter (``iteration``, which Accelerate's own ``state_dict()`` leaves out and
  which seeds a ``SeedableRandomSampler``'s shuffle). A loader saved on its epoch's last
  batch, its ``for`` loop not yet ended, resumes there: its next pass hands out nothing
  and counts the epoch, so the code after the loop (an evaluation) runs on resume.
- ``custom_0``, ``custom_1``...: the objects given to ``accelerator.register_for_checkpointing``.
- ``accelerator``: ``accelerator.step``, the counter gradient accumulation syncs on.
- ``scaler``: ``accelerator.scaler`` (mixed precision with a GradScaler), if any.
- ``rng``: as with any Checkpointer.

A loader whose position cannot be restored exactly is refused at construction, naming it
and the fix: one prepared without ``use_stateful_dataloader=True``, and one that shuffles
with a plain ``RandomSampler`` (its mid-epoch permutation is drawn again, differently, on
resume) rather than Accelerate's seedable sampler.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from ..checkpointer import Checkpointer

__all__ = ["checkpointer_for"]

# Components this module adds; a user's ``extra`` may not reuse them.
ACCELERATE_COMPONENTS = ("accelerator", "scaler")
ITERATION_KEY = "unbroken:iteration"  # older checkpoints: the counter as it was at save
NEXT_EPOCH_KEY = "unbroken:next_epoch"  # the epoch of the next batches handed out
EPOCH_END_KEY = "unbroken:epoch_end_pending"
GENERATOR_KEY = "unbroken:generator"
FINISHED_KEY = "_iterator_finished"

STATEFUL_FIX = (
    "pass Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True, "
    "use_seedable_sampler=True)) (from accelerate.utils import DataLoaderConfiguration; needs "
    "torchdata), or leave this loader out with checkpointer_for(..., dataloaders=[...])"
)


def checkpointer_for(
    accelerator: Any,
    path: str | os.PathLike,
    *,
    dataloaders: Sequence[Any] | None = None,
    extra: Mapping[str, Any] | None = None,
    **options: Any,
) -> Checkpointer:
    """A :class:`unbroken.Checkpointer` over everything ``accelerator`` prepared.

    Call it after ``accelerator.prepare(...)`` and ``register_for_checkpointing(...)``:
    objects prepared later are not in it. Use the result like any Checkpointer
    (``restore``, ``track``, ``should_stop``, ``save``, ``close``); every call is
    collective, so every process makes it.

    Args:
        accelerator: an ``accelerate.Accelerator`` after ``prepare``.
        path: the run's checkpoint folder (as for ``Checkpointer``).
        dataloaders: the prepared loaders whose position to save (default: all of
            ``accelerator``'s). Leave out one that starts over on purpose, such as an
            evaluation loader; its position is then neither saved nor restored.
        extra: more name -> stateful objects, as ``Checkpointer(extra=...)``.
        **options: any other ``Checkpointer`` keyword (``keep_last``, ``probe``,
            ``async_save``, ``overwrite``, ``loss_metric``, ``grad_norm_metric``).
    Returns:
        the Checkpointer; ``restore()``'s report names each component listed in the
        module docstring.
    Raises:
        ValueError: nothing was prepared, ``extra`` reuses a name this adds, or the
            launcher started more processes than the Accelerator joined (Accelerate's
            FSDP plugin on a machine without GPUs: each process runs alone).
        TypeError: a loader cannot be restored exactly (the message names it by its
            index in ``accelerator._dataloaders`` and says what to pass instead), or ``dataloaders``
            holds something ``accelerator`` did not prepare.

    Example::

        ckpt = checkpointer_for(accelerator, "ckpts/run1", keep_last=2)
        for step in range(ckpt.restore().step, total):
            ...
            ckpt.track(step + 1, loss=loss)
            if (step + 1) % 100 == 0 or ckpt.should_stop(step + 1):
                ckpt.save(step + 1)
    """
    if not accelerator._models:
        raise ValueError(
            "the Accelerator has prepared no model: call checkpointer_for() after "
            "accelerator.prepare(model, ...)"
        )
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and accelerator.num_processes != launched:
        raise ValueError(
            f"launched as {launched} processes (WORLD_SIZE) but the Accelerator runs "
            f"{accelerator.num_processes} (distributed_type {accelerator.distributed_type}): "
            "each process would train and save alone, into the same folder. On a machine "
            "without GPUs pass Accelerator(cpu=True) and launch with --multi_gpu (DDP on "
            "gloo); Accelerate's FSDP plugin needs GPUs"
        )
    taken = sorted(set(extra or ()) & {*ACCELERATE_COMPONENTS, *_custom_names(accelerator)})
    if taken:
        raise ValueError(f"extra reuses the component name(s) {taken}, which checkpointer_for adds")
    loaders = _loaders(accelerator, dataloaders)
    left_out = [
        (i, p)
        for i, p in enumerate(accelerator._dataloaders)
        if not any(chosen._loader is p for chosen in loaders)
    ]
    added: dict[str, Any] = {"accelerator": _AcceleratorStep(accelerator, left_out)}
    if getattr(accelerator, "scaler", None) is not None:
        added["scaler"] = accelerator.scaler
    added.update(zip(_custom_names(accelerator), accelerator._custom_objects, strict=True))
    return Checkpointer(
        path,
        model=_one_or_indexed(list(accelerator._models)),
        optimizer=_one_or_indexed([_inner(o, "optimizer") for o in accelerator._optimizers]),
        scheduler=_one_or_indexed([_inner(s, "scheduler") for s in accelerator._schedulers]),
        dataloader=_one_or_indexed(loaders) if loaders else None,
        extra={**added, **(extra or {})},
        **options,
    )


def _custom_names(accelerator: Any) -> list[str]:
    return [f"custom_{i}" for i in range(len(accelerator._custom_objects))]


def _one_or_indexed(objs: list[Any]) -> Any:
    """None, the one object, or {"0": first, "1": second, ...} in the order prepared."""
    if not objs:
        return None
    return objs[0] if len(objs) == 1 else {str(i): o for i, o in enumerate(objs)}


def _inner(wrapper: Any, what: str) -> Any:
    """The torch object inside an AcceleratedOptimizer/AcceleratedScheduler: the one whose
    state the wrapper passes through, and the one torch's state-dict helpers accept."""
    inner = getattr(wrapper, what, None)
    return inner if inner is not None else wrapper


def _loaders(accelerator: Any, chosen: Sequence[Any] | None) -> list[_PreparedLoader]:
    prepared = list(accelerator._dataloaders)
    if chosen is None:
        chosen = prepared
    out = []
    for loader in chosen:
        index = next((i for i, p in enumerate(prepared) if p is loader), None)
        if index is None:
            raise TypeError(
                f"dataloaders holds a {type(loader).__name__} that this Accelerator did not "
                "prepare: pass the objects accelerator.prepare() returned"
            )
        out.append(_PreparedLoader(loader, f"accelerator._dataloaders[{index}]"))
    return out


class _AcceleratorStep:
    """``accelerator.step``, the counter gradient accumulation syncs on, and what the
    loaders left out of ``dataloader`` hold that decides later random draws.

    A prepared ``StatefulDataLoader`` makes its first iterator when it is prepared (its
    ``state_dict()`` needs one), so its first pass draws no seed from torch's RNG and every
    later pass draws one. A left-out loader re-prepared after a resume would be back on
    its first pass and skip that draw, shifting every random number after it (dropout
    masks included); so for each left-out loader this keeps whether its next pass makes a
    new iterator, and its epoch counter (the seed of a seedable sampler's shuffle).
    Its position within a pass is not kept: it starts its next pass from the beginning.
    """

    def __init__(self, accelerator: Any, left_out: Sequence[tuple[int, Any]] = ()) -> None:
        self._accelerator = accelerator
        self._left_out = list(left_out)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"step": int(self._accelerator.step)}
        if self._left_out:
            state["left_out_loaders"] = {
                str(i): {
                    "epoch": int(getattr(loader, "iteration", 0)),
                    "new_iterator": _next_pass_makes_iterator(loader),
                }
                for i, loader in self._left_out
            }
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._accelerator.step = int(state["step"])
        saved = state.get("left_out_loaders") or {}
        for i, loader in self._left_out:
            entry = saved.get(str(i))
            if entry is None:
                continue  # saved as a restored loader, or by an older unbroken
            loader.iteration = int(entry["epoch"])
            base = getattr(loader, "base_dataloader", None)
            if entry["new_iterator"] and getattr(base, "_initial_iter_for_state_dict", False):
                # The iterator made at prepare is the one a first pass would use: drop it,
                # so that the next pass makes (and seeds) a new one, as the saved run did.
                base._initial_iter_for_state_dict = False


def _next_pass_makes_iterator(loader: Any) -> bool:
    """Whether ``iter()`` on this prepared loader makes a new inner iterator (drawing a seed
    from torch's RNG): true unless it still holds the unused one made at prepare
    (torchdata 0.11 ``StatefulDataLoader.__iter__``)."""
    base = getattr(loader, "base_dataloader", None)
    iterator = getattr(base, "_iterator", None)
    if iterator is None or not getattr(base, "_initial_iter_for_state_dict", False):
        return True
    return bool(getattr(iterator, "_finished", False))


class _PreparedLoader:
    """One prepared loader (Accelerate's ``DataLoaderShard``/``DataLoaderDispatcher`` over
    torchdata's ``StatefulDataLoader``) as a ``Stateful``, with what its own
    ``state_dict()`` misses: the epoch counter and the loader's generator.

    Checked against accelerate 1.15 / torchdata 0.11: the adapter's ``state_dict()`` is a
    snapshot taken before its one-batch look-ahead, so it is the position of the batches
    the training loop has seen; ``load_state_dict()`` reaches the inner loader but leaves
    that snapshot stale (a save before the next batch would record the old position), so
    the snapshot is set here too.
    """

    def __init__(self, loader: Any, label: str) -> None:
        _check_restorable(loader, label)
        self._loader = loader
        self._label = label
        self._ending: _EpochEnd | None = None

    def _base(self) -> Any:
        return self._loader.base_dataloader

    def _generator(self) -> torch.Generator | None:
        g = getattr(self._base(), "generator", None)
        return g if isinstance(g, torch.Generator) else None

    def state_dict(self) -> dict[str, Any]:
        state = dict(self._loader.state_dict())
        epoch, ending = self._position(state)
        state[NEXT_EPOCH_KEY] = epoch + ending
        state[EPOCH_END_KEY] = ending
        g = self._generator()
        if g is not None:
            state[GENERATOR_KEY] = g.get_state()
        return state

    def _position(self, state: Mapping[str, Any]) -> tuple[int, bool]:
        """The loader's epoch counter, and whether its pass has handed out its last batch
        but not ended yet. Accelerate counts an epoch when the ``for`` loop asks for a
        batch after the last one; until then (inside the loop, or after a ``break`` on
        the last batch) the code after the loop, such as an evaluation, has not run."""
        epoch = int(getattr(self._loader, "iteration", 0))
        if self._ending is not None and self._ending.pending():
            return epoch, True  # restored at such a point, and not iterated since
        if not state.get(FINISHED_KEY):
            return epoch, False
        references = getattr(self._loader.gradient_state, "dataloader_references", ())
        return epoch, any(ref is self._loader for ref in references)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        state = dict(state)
        ending = bool(state.pop(EPOCH_END_KEY, False))
        if NEXT_EPOCH_KEY in state:
            epoch = int(state.pop(NEXT_EPOCH_KEY)) - ending
        else:  # saved by an older unbroken: the counter as it was, the epoch not yet counted
            epoch = int(state.pop(ITERATION_KEY)) + bool(state.get(FINISHED_KEY))
        generator = state.pop(GENERATOR_KEY, None)
        self._loader.iteration = epoch
        base = self._base()
        base.load_state_dict(state)
        self._loader.dl_state_dict = state
        # Make the resumed inner iterator now, inside restore(), before the rng component
        # is put back: making it draws a seed, which a resumed training loop would
        # otherwise draw from the restored RNG (shifting every later random draw).
        base.state_dict()
        self._ending = None
        if ending:
            self._ending = _EpochEnd(self._loader, base)
        g = self._generator()
        if g is not None and generator is not None:
            g.set_state(generator)


class _EpochEnd:
    """The inner iterator of a loader restored where its saved run had handed out the
    epoch's last batch, its ``for`` loop not yet ended: the next pass hands out nothing
    and counts the epoch, as that loop's next ``next()`` did in the saved run, so the
    code after the loop (an evaluation, which draws from the RNG) runs in the resumed
    run too. After it the loader makes a new iterator for the next epoch, as then.

    It stands in for torchdata 0.11's ``StatefulDataLoader._iterator`` (made by
    ``state_dict()``, taken up by the next ``iter()`` because it is not ``_finished``).
    """

    _finished = False

    def __init__(self, loader: Any, base: Any) -> None:
        self._loader = loader
        self._base = base
        self._inner = base._iterator
        base._iterator = self

    def pending(self) -> bool:
        return self._base._iterator is self

    def __iter__(self) -> _EpochEnd:
        return self

    def __next__(self) -> Any:
        if self.pending():
            self._base._iterator = self._inner  # finished: the next iter() makes a new one
            if type(self._loader).__name__ != "DataLoaderDispatcher":  # counts empty passes
                self._loader.iteration += 1
        raise StopIteration

    def state_dict(self) -> dict[str, Any]:
        return self._inner.state_dict()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _check_restorable(loader: Any, label: str) -> None:
    name = type(loader).__name__
    if not getattr(loader, "use_stateful_dataloader", False) or not hasattr(
        loader, "base_dataloader"
    ):
        raise TypeError(
            f"{label} ({name}) was prepared without use_stateful_dataloader=True: its "
            f"position cannot be saved, and a resumed run would start the epoch over. {STATEFUL_FIX}"
        )
    for sampler in _samplers(loader):
        if type(sampler) is torch.utils.data.RandomSampler:
            raise TypeError(
                f"{label} ({name}) shuffles with a torch RandomSampler: on resume its "
                "permutation is drawn again from the generator's current state, so the rest "
                f"of the epoch would come in another order. {STATEFUL_FIX}"
            )


def _samplers(loader: Any) -> Iterable[Any]:
    """The samplers under a prepared loader's (possibly sharded) batch sampler."""
    seen = []
    node = getattr(loader, "batch_sampler", None)
    if node is None:
        node = getattr(loader, "sampler", None)
    for _ in range(4):  # BatchSamplerShard -> BatchSampler -> sampler, at most
        if node is None:
            break
        seen.append(node)
        node = getattr(node, "batch_sampler", None) or getattr(node, "sampler", None)
    return seen
