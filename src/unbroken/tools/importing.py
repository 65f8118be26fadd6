"""Bring a checkpoint written by other code into an ordinary unbroken checkpoint.

The foreign state (a ``torch.save`` file or a DCP directory, see :mod:`unbroken.tools.foreign`)
is loaded into live objects built by a factory, then saved with :class:`Checkpointer`,
so the result is exactly what a training run would have saved. Nothing is dropped:
every model tensor, optimizer entry and top-level entry lands somewhere or is named in
an error (or left out on purpose with ``ignore``).

The factory is a zero-argument callable returning a module, or a ``(module, optimizer)``
tuple. With a module alone, an AdamW is built from the imported param groups.

An HF model folder holds a tied weight once (``lm_head.weight`` *is*
``model.embed_tokens.weight``): the alias takes the value of the parameter it is. A PEFT
adapter folder holds the adapter only: the factory builds the PeftModel on its base, and
the base's tensors are the factory's.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from ..checkpointer import Checkpointer
from ..errors import CheckpointError, IncompleteCheckpointError, StateMismatchError
from ..live.optimizer import OptimizerComponent
from ..live.state import ModelComponent
from ..storage.locate import checkpoint_dir
from . import deepspeed_folders, foreign, optimizer_mapping
from .reporting import JsonResult

Factory = Callable[[], "nn.Module | tuple[nn.Module, torch.optim.Optimizer]"]


@dataclasses.dataclass
class ImportResult(JsonResult):
    """What :func:`import_checkpoint` returns (``unbroken import --json``)."""

    path: str  # the committed step folder
    step: int  # the step it was saved as
    source_kind: str  # "torch.save" | "dcp" | "hf" | "peft" | "deepspeed"
    model_tensors: int  # model tensors imported
    optimizer: str  # "factory", "AdamW from the imported param groups", or "none"
    optimizer_params: int  # parameters with imported optimizer state and hyperparameters
    scheduler: bool  # a scheduler state was imported
    ignored: list[str]  # top-level source entries left out on request
    from_factory: int = 0  # model tensors not in the source: a tied weight's alias (the
    # parameter's value), a PEFT adapter's base model (as the factory built it)


def load_factory(spec: str) -> Factory:
    """The callable named by ``"package.module:function"``.

    Raises:
        ValueError: malformed spec, module not importable, or no such callable.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--model must look like 'package.module:factory', got {spec!r}")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import {module_name!r} for --model: {exc}") from None
    for part in attr.split("."):
        obj = getattr(obj, part, None)
    if not callable(obj):
        raise ValueError(f"{spec!r} does not name a callable in {module_name!r}")
    return obj


def build(factory: Factory) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    result = factory()
    if isinstance(result, nn.Module):
        return result, None
    if (
        isinstance(result, tuple)
        and len(result) == 2
        and isinstance(result[0], nn.Module)
        and isinstance(result[1], torch.optim.Optimizer)
    ):
        return result
    raise TypeError(
        f"the --model factory returned {type(result).__name__}; it must return an "
        "nn.Module or a (module, optimizer) tuple"
    )


class _SavedState:
    """A ``Stateful`` holding an imported state_dict (e.g. an LR scheduler's)."""

    def __init__(self, state: dict[str, Any]) -> None:
        self._state = state

    def state_dict(self) -> dict[str, Any]:
        return self._state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._state = state


def import_checkpoint(
    source: str | Path,
    dest: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int | None = None,
    ignore: Iterable[str] = (),
    trust_pickle: bool = False,
    adapter: str = "default",
    frozen: str | None = None,
) -> ImportResult:
    """Convert ``source`` into a committed unbroken checkpoint in run folder ``dest``
    (``unbroken import``).

    The source state is loaded into ``model`` (and ``optimizer``), which must be built
    exactly as in training, then saved with :class:`~unbroken.Checkpointer`: the result
    is what a training run would have saved. Nothing is dropped silently.

    Args:
        source: a ``torch.save`` file ``{"model", "optimizer"?, "scheduler"?, "step"?}``,
            a ``torch.distributed.checkpoint`` directory, a Hugging Face model folder
            (``model.safetensors.index.json`` and its shards, or ``model.safetensors``),
            a PEFT adapter folder (``adapter_model.safetensors``,
            ``adapter_config.json``), or a DeepSpeed ZeRO 1-3 checkpoint folder
            (``engine.save_checkpoint``'s, or a tag folder in it), saved as
            ``integrations.deepspeed.checkpointer_for`` saves. Its pickles are read
            safely: tensors, containers and plain values only (``torch.load(weights_only=True)``; DCP's
            ``.metadata`` through an unpickler that knows only its classes); safetensors
            files after their headers and index are checked against the files.
        dest: the run folder to save into (it must not hold this step already).
        model: the live model to load into (the command builds it with :func:`build`).
        optimizer: the live optimizer, or None to build an AdamW from the imported
            param groups.
        step: the step to save as (default: the step recorded in the source).
        ignore: top-level source entries to leave out on purpose.
        trust_pickle: read ``source`` with plain pickle instead, for what the safe
            readers refuse. It can run code: only for files you trust.
        adapter: a PEFT adapter folder is loaded as this adapter of ``model`` (a
            PeftModel the factory built on its base model).
        frozen: passed to the :class:`~unbroken.Checkpointer` that saves the result
            (``"verify"``: frozen parameters are not stored, only their fingerprints),
            where this version's Checkpointer accepts it.
    Returns:
        :class:`ImportResult`.

    Raises:
        CheckpointNotFoundError: ``source`` does not exist.
        CorruptCheckpointError: ``source`` holds something the safe readers refuse
            (naming the file or entry), or is damaged.
        StateMismatchError: an entry fits no parameter, or shapes/dtypes/counts differ.
        IncompleteCheckpointError: the source lacks a tensor the model has.
        ValueError: no step known, or ``dest`` already holds it; ``frozen`` given to a
            Checkpointer that does not take it.

    Example::

        model, opt = build_model_and_optimizer()  # as in training
        result = ub.import_checkpoint("ckpt.pt", "ckpts/run1", model, opt)
        print(result.step, result.path)
    """
    source, ignored = Path(source), sorted(set(ignore))
    if deepspeed_folders.is_deepspeed(source):
        return _import_deepspeed(source, dest, model, optimizer, step, ignore, trust_pickle, frozen)
    model_c = ModelComponent(model)
    fqn_of = model_c.parameter_fqns()
    params = {fqn: p for p, fqn in fqn_of.items()}
    live = get_model_state_dict(model)
    state = foreign.read(
        source, model_fqns=live.keys(), ignore=ignored, trust_pickle=trust_pickle, adapter=adapter
    )
    options = _checkpointer_options(frozen)
    if state.unmapped:
        raise StateMismatchError(
            f"{source}: entries that fit no model tensor, optimizer state or step: "
            f"{optimizer_mapping.listing(state.unmapped)}; pass --ignore NAME for each "
            "top-level name to leave out on purpose"
        )
    step = step if step is not None else state.step
    if step is None:
        raise ValueError(f"{source} records no step; pass --step N")
    ckdir = checkpoint_dir(dest)
    if step in ckdir.steps():
        raise ValueError(f"{dest} already holds a checkpoint of step {step}; choose another")
    ckdir.check_not_foreign()
    saved = _completed(model, live, state)
    _install_model(model, live, saved, source)
    opt_label, count = "none", 0
    if state.optimizer is not None:
        groups = optimizer_mapping.live_groups(optimizer, fqn_of) if optimizer else None
        convert = (
            optimizer_mapping.from_positions
            if state.optimizer_keyed_by == "position"
            else optimizer_mapping.from_fqns
        )
        mapped = convert(state.optimizer, list(params), groups)
        optimizer_mapping.check(mapped, params)
        opt_label = "factory"
        if optimizer is None:
            optimizer = optimizer_mapping.build_adamw(mapped, params)
            opt_label = "AdamW from the imported param groups"
        OptimizerComponent(optimizer, model_c).install(mapped)
        count = sum(len(g["params"]) for g in mapped["param_groups"])
    scheduler = _SavedState(state.scheduler) if state.scheduler is not None else None
    ckpt = Checkpointer(
        dest,
        model=model,
        optimizer=optimizer if state.optimizer is not None else None,
        scheduler=scheduler,
        keep_last=None,
        **options,
    )
    try:
        final = ckpt.save(step)
    except TypeError as exc:  # e.g. scheduler state that JSON cannot hold
        raise CheckpointError(f"{source}: cannot save the imported state: {exc}") from None
    finally:
        ckpt.close()
    return ImportResult(
        final,
        step,
        state.kind,
        len(state.model),
        opt_label,
        count,
        scheduler is not None,
        ignored,
        len(saved) - len(state.model),
    )


def _import_deepspeed(
    source: Path,
    dest: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    step: int | None,
    ignore: Iterable[str],
    trust_pickle: bool,
    frozen: str | None,
) -> ImportResult:
    """A DeepSpeed checkpoint folder, saved as ``checkpointer_for(engine)`` saves
    (:mod:`unbroken.tools.deepspeed_import`)."""
    from . import deepspeed_import

    options = _checkpointer_options(frozen)
    ds, view = deepspeed_import.prepare(source, model, optimizer, trust_pickle, ignore)
    step = step if step is not None else ds.counters["global_steps"]
    ckdir = checkpoint_dir(dest)
    if step in ckdir.steps():
        raise ValueError(f"{dest} already holds a checkpoint of step {step}; choose another")
    ckdir.check_not_foreign()
    _install_model(model, get_model_state_dict(model), ds.model, ds.folder)
    scheduler = _SavedState(ds.scheduler) if ds.scheduler is not None else None
    extra = {deepspeed_import.ENGINE_COMPONENT: deepspeed_import.Counters(ds.counters)}
    ckpt = Checkpointer(
        dest,
        model=model,
        optimizer=view,
        scheduler=scheduler,
        extra=extra,
        keep_last=None,
        **options,
    )
    try:
        final = ckpt.save(step)
    finally:
        ckpt.close()
    return ImportResult(
        final,
        step,
        "deepspeed",
        len(ds.model),
        f"{view.shown_class} state from ZeRO-{ds.stage} partitions of {ds.world} rank(s)",
        len(ds.state),
        scheduler is not None,
        ds.ignored,
    )


def _checkpointer_options(frozen: str | None) -> dict[str, Any]:
    if frozen is None:
        return {}
    if "frozen" not in inspect.signature(Checkpointer).parameters:
        raise ValueError(
            f"frozen={frozen!r}: this version's Checkpointer takes no 'frozen' option; "
            "leave it out (everything is saved)"
        )
    return {"frozen": frozen}


def _completed(
    model: nn.Module, live: dict[str, Any], state: foreign.ForeignState
) -> dict[str, torch.Tensor]:
    """The source's model tensors, plus what a format leaves out on purpose: the alias of
    a tied weight (the value of the parameter it is), and for a PEFT adapter the base
    model's tensors as the factory built them."""
    saved = dict(state.model)
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    for group in names.values():
        held = [n for n in group if n in saved]
        for alias in group:
            if held and alias not in saved and alias in live:
                saved[alias] = saved[held[0]]
    if state.partial:
        for key, value in live.items():
            saved.setdefault(key, value)
    return saved


def _install_model(
    model: nn.Module, live: dict[str, Any], saved: dict[str, torch.Tensor], source: Path
) -> None:
    saved = dict(saved)
    for prefix in ("module.", "_orig_mod."):  # DDP / torch.compile wrappers of the source
        if saved and not set(saved) & set(live):
            consume_prefix_in_state_dict_if_present(saved, prefix)
    missing = sorted(set(live) - set(saved))
    if missing:
        raise IncompleteCheckpointError(
            f"{source} has no value for model tensor(s) {optimizer_mapping.listing(missing)}"
        )
    unexpected = sorted(set(saved) - set(live))
    if unexpected:
        raise StateMismatchError(
            f"{source} has model tensor(s) the factory's model lacks: "
            f"{optimizer_mapping.listing(unexpected)}"
        )
    wrong = [
        f"{k}: {tuple(v.shape)} {v.dtype} in the source, {tuple(live[k].shape)} "
        f"{live[k].dtype} in the model"
        for k, v in saved.items()
        if v.shape != live[k].shape or v.dtype != live[k].dtype
    ]
    if wrong:
        raise StateMismatchError(
            "the source does not fit the factory's model (build it in the source's shapes "
            f"and dtypes): {'; '.join(wrong[:5])}"
        )
    set_model_state_dict(model, saved, options=StateDictOptions(strict=True))
