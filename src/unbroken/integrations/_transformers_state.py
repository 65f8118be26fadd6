"""What the Hugging Face Trainer keeps outside its model, optimizer and scheduler, as
``Stateful`` extras of a :class:`~unbroken.Checkpointer`, and the early look at a
checkpoint that the Trainer's resume path needs before its optimizer exists.

Three extras (see docs/integrations/transformers.md):

- ``trainer_state``: the ``TrainerState`` (global step, epoch, log history, best metric,
  FLOs, tokens seen, callbacks' exported state), all JSON values;
- ``trainer_loop``: this rank's loss summed since the last logged step, and that step, so
  the next logged loss averages the same steps as in an uninterrupted run (the Trainer
  itself starts the sum over after a resume);
- ``data_order``: the settings the Trainer derives the data position from (batches per
  epoch, batch size, world size, sampler seed...). The Trainer skips ``global_step``
  batches of a reshuffled epoch; if any of these changed, it would land elsewhere, so a
  difference is refused before anything live changes.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from ..core import collective, resuming
from ..errors import CorruptCheckpointError, IncompleteCheckpointError, StateMismatchError
from ..format import tree
from ..format.manifest import read as read_manifest
from ..live.rng import RNGState
from ..storage.locate import checkpoint_dir

# TrainerState fields the Trainer sets from the current run, not from a checkpoint
# (TrainerState.init_training_references): never saved, never overwritten.
REFRESHED = frozenset(
    {
        "max_steps",
        "num_train_epochs",
        "is_local_process_zero",
        "is_world_process_zero",
        "is_hyper_param_search",
        "trial_name",
        "trial_params",
    }
)
STATE, LOOP, DATA = "trainer_state", "trainer_loop", "data_order"


class TrainerStateView:
    """``trainer_state``: the live ``trainer.state``'s progress fields."""

    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        fields = dataclasses.asdict(self._trainer.state)  # a deep copy
        return {k: v for k, v in fields.items() if k not in REFRESHED}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        live = self._trainer.state
        known = {f.name for f in dataclasses.fields(live)}
        unknown = sorted(set(state) - known)
        if unknown:
            raise StateMismatchError(
                f"the checkpoint's TrainerState has fields {unknown} that this transformers "
                f"version's TrainerState lacks: resume with the transformers version that "
                "saved it"
            )
        for name, value in json.loads(json.dumps(state)).items():  # fresh containers
            setattr(live, name, value)


class TrainerLoopView:
    """``trainer_loop``: the loss summed since the last log, per rank (a tensor)."""

    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        return {
            "tr_loss": self._trainer._tr_loss,
            "globalstep_last_logged": int(self._trainer._globalstep_last_logged),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        live = self._trainer._tr_loss
        self._trainer._tr_loss = state["tr_loss"].to(device=live.device).clone()
        self._trainer._globalstep_last_logged = int(state["globalstep_last_logged"])


class DataOrder:
    """``data_order``: the facts the Trainer's data skip depends on; loading verifies."""

    def __init__(self, facts: dict[str, Any]) -> None:
        self.facts = facts

    def state_dict(self) -> dict[str, Any]:
        return dict(self.facts)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_data_order(state, self.facts, where="the checkpoint")


def data_facts(args: Any, trainer: Any, train_dataloader: Any) -> dict[str, Any]:
    """What decides which batch comes after step N: a change moves the data position."""
    dataset = trainer.train_dataset
    sampler = _sampler(train_dataloader)
    seed = getattr(sampler, "initial_seed", None)
    return {
        "world_size": int(args.world_size),
        "per_device_train_batch_size": int(args.per_device_train_batch_size),
        "gradient_accumulation_steps": int(args.gradient_accumulation_steps),
        "batches_per_epoch": len(train_dataloader),
        "dataset_length": len(dataset) if hasattr(dataset, "__len__") else None,
        "sampler": type(sampler).__name__ if sampler is not None else None,
        "sampler_seed": int(seed) if seed is not None else None,
        "train_sampling_strategy": str(getattr(args, "train_sampling_strategy", "")),
        "dataloader_drop_last": bool(args.dataloader_drop_last),
    }


def _sampler(loader: Any) -> Any:
    get = getattr(loader, "get_sampler", None)  # accelerate's DataLoaderShard
    if callable(get):
        return get()
    return getattr(loader, "sampler", None)


def check_data_order(saved: dict[str, Any], live: dict[str, Any], *, where: str) -> None:
    """Raise ``StateMismatchError`` naming every setting that differs."""
    changed = [
        f"{k} was {saved.get(k)!r}, is {live.get(k)!r}"
        for k in sorted(set(saved) | set(live))
        if saved.get(k) != live.get(k)
    ]
    if changed:
        raise StateMismatchError(
            f"{where} was saved with other data settings, so the Trainer would resume at "
            f"another data position: {'; '.join(changed)}. Resume with the settings it was "
            "saved with, or start a new run in a new folder"
        )


@dataclasses.dataclass
class ResumePoint:
    """The checkpoint a resume will restore, read before the Trainer builds anything."""

    step: int
    folder: Path
    trainer_state: dict[str, Any]
    data_order: dict[str, Any]

    def write_trainer_state(self, folder: str | os.PathLike) -> None:
        """``trainer_state.json`` for the Trainer's own resume path (data skip, epochs)."""
        from transformers import TrainerState

        TrainerState(**self.trainer_state).save_to_json(os.path.join(folder, "trainer_state.json"))


def find_resume_point(path: str | os.PathLike, step: int | None) -> ResumePoint | None:
    """The newest checkpoint whose manifest reads (or ``step``), or None; collective.

    Raises:
        CheckpointNotFoundError: ``step`` is not committed.
        CorruptCheckpointError: no committed manifest reads.
        IncompleteCheckpointError: the checkpoint was not saved through this integration.
    """
    ckdir = checkpoint_dir(path)
    steps = resuming.candidate_steps(ckdir, step)  # collective: every rank the same list

    def look() -> tuple[int, dict, dict] | None:
        errors = []
        for chosen in steps:
            try:
                doc = read_manifest(ckdir.step_path(chosen))
            except CorruptCheckpointError as exc:
                if step is not None:
                    raise
                errors.append(str(exc))
                continue
            return chosen, _component(doc, STATE, chosen), _component(doc, DATA, chosen)
        if errors:
            raise CorruptCheckpointError("no committed checkpoint reads: " + "; ".join(errors))
        return None

    # Rank 0 reads the manifest; every rank adopts its answer (or its error).
    found = collective.on_rank0(look)
    if found is None:
        return None
    chosen, state, data = found
    return ResumePoint(chosen, ckdir.step_path(chosen), state, data)


def _component(doc: dict[str, Any], name: str, step: int) -> dict[str, Any]:
    entry = doc["components"].get(name)
    if entry is None:
        raise IncompleteCheckpointError(
            f"the checkpoint of step {step} has no {name!r}: it was not saved by "
            "unbroken.integrations.transformers.UnbrokenCallback, so the Trainer's state and "
            "data position cannot be restored. Resume it with the loop that saved it, or "
            "start a new run in a new folder"
        )
    skeleton = entry["ranks"]["0"] if entry.get("per_rank") else entry["state"]
    if tree.tensor_keys(skeleton):
        raise CorruptCheckpointError(f"the checkpoint's {name!r} holds tensors; it is damaged")
    value = tree.decode(skeleton, {})
    if not isinstance(value, dict):
        raise CorruptCheckpointError(f"the checkpoint's {name!r} is not a dict; it is damaged")
    return value


def rng_snapshot() -> dict[str, Any]:
    """This process's generators now (cloned), to put back when the Trainer asks."""
    state = RNGState().state_dict()
    state["torch"] = state["torch"].clone()
    return state


def put_back(snapshot: dict[str, Any]) -> None:
    RNGState().load_state_dict(snapshot)
