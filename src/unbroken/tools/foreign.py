"""Read checkpoints written by other code: ``torch.save`` files, DCP directories, Hugging
Face model folders and PEFT adapter folders.

HF folders hold safetensors files, which are not pickles: they are read through
:mod:`unbroken.tools.hf_folders`, which checks the index and every header against the
files before a tensor is read. A PEFT adapter's tensors are named without the adapter's
name; they are mapped onto the live PeftModel's FQNs (:mod:`unbroken.tools.peft_names`),
every one of them landing somewhere or named in an error; the base model's tensors are
the factory's (``ForeignState.partial``).

Both formats are pickles underneath (a ``torch.save`` file is a zip of pickles; DCP's
``.metadata`` file is one, and DCP stores each non-tensor value as a ``torch.save``
pickle), and unpickling a crafted file runs code. So ``torch.save`` files and DCP
entries are loaded with ``torch.load(weights_only=True)``, which refuses arbitrary
objects, and DCP's ``.metadata`` with an unpickler that knows only the classes of DCP
metadata (:mod:`unbroken.tools.dcp_metadata`); what they refuse is a
``CorruptCheckpointError`` naming the file or entry. ``trust_pickle=True`` lifts both (plain
pickle: only for files you trust). Our own checkpoints never come through this module.

The result is a :class:`ForeignState`: the source's model tensors and optimizer state in
a neutral form, every entry that could not be placed listed in ``unmapped``.
"""

from __future__ import annotations

import dataclasses
import io
import numbers
import pickle
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from ..core.collective import unwrap
from ..errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    StateMismatchError,
)
from . import dcp_metadata, hf_folders, peft_names

_KNOWN_TOP = ("model", "optimizer", "scheduler", "step")


@dataclasses.dataclass
class ForeignState:
    """What a foreign checkpoint holds, before it is mapped onto live objects.

    ``optimizer`` is either torch's positional form (``{"state": {int: ...},
    "param_groups": [{..., "params": [int]}]}``) when ``optimizer_keyed_by == "position"``,
    or FQN-keyed (``{"state": {fqn: ...}, "param_groups": [...]}`` with FQN ``params``,
    or ``"hyperparameters": {fqn: {...}}`` per parameter) when ``"fqn"``.
    """

    source: str
    kind: str  # "torch.save" | "dcp" | "hf" | "peft"
    model: dict[str, torch.Tensor]
    partial: bool = False  # the model tensors not in ``model`` keep the factory's values
    optimizer: dict[str, Any] | None = None
    optimizer_keyed_by: str = "position"
    scheduler: dict[str, Any] | None = None
    step: int | None = None
    unmapped: list[str] = dataclasses.field(default_factory=list)


def is_dcp(path: Path) -> bool:
    return path.is_dir() and (path / ".metadata").is_file()


def read(
    path: str | Path,
    *,
    model_fqns: Iterable[str],
    ignore: Iterable[str] = (),
    trust_pickle: bool = False,
    adapter: str = "default",
) -> ForeignState:
    """Read ``path`` (a ``torch.save`` file, a DCP directory, an HF model folder or a
    PEFT adapter folder).

    ``model_fqns`` are the live model's normalized FQNs (DCP keys are parsed against
    them, since FQNs contain dots; a PEFT adapter's names are mapped onto them, for
    ``adapter``). Top-level entries named in ``ignore`` are skipped. ``trust_pickle``
    unpickles everything with plain pickle, which can run code.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointNotFoundError(f"{path} does not exist")
    if hf_folders.is_adapter_folder(path):
        return read_adapter(path, list(model_fqns), adapter)
    if hf_folders.is_model_folder(path):
        files = hf_folders.open_model(path)
        return ForeignState(source=str(path), kind="hf", model=files.read_all())
    if is_dcp(path):
        return read_dcp(path, set(model_fqns), set(ignore), trust_pickle=trust_pickle)
    if path.is_file():
        return read_torch_save(path, set(ignore), trust_pickle=trust_pickle)
    raise CheckpointNotFoundError(
        f"{path} is neither a torch.save file, a torch.distributed.checkpoint directory "
        f"(one with a .metadata file), an HF model folder ({hf_folders.INDEX} or "
        f"{hf_folders.SINGLE}) nor a PEFT adapter folder ({hf_folders.ADAPTER_WEIGHTS})"
    )


def read_adapter(path: Path, model_fqns: list[str], adapter: str) -> ForeignState:
    """A PEFT adapter folder's tensors, under the live PeftModel's FQNs for ``adapter``.

    Raises:
        CorruptCheckpointError: a file is damaged or adapter_config.json is missing.
        StateMismatchError: an adapter tensor fits no tensor of the live model (named),
            or the live model has no adapter ``adapter``.
        IncompleteCheckpointError: the live adapter has a tensor the file lacks.
    """
    config = hf_folders.read_json(path / hf_folders.ADAPTER_CONFIG, "a PEFT adapter config")
    files = hf_folders.open_files(path, [path / hf_folders.ADAPTER_WEIGHTS])
    live = peft_names.file_names(model_fqns, adapter, config)  # live FQN -> name in file
    if not live:
        found = sorted(peft_names.adapters_in(model_fqns))
        raise StateMismatchError(
            f"the --model factory's model has no tensor of adapter {adapter!r} to load "
            f"{path} into (its adapters: {', '.join(found) or 'none'}); build the "
            "PeftModel with that adapter, or pass --adapter NAME"
        )
    fqn_of = {name: fqn for fqn, name in live.items()}
    stray = sorted(set(files.headers) - fqn_of.keys())
    if stray:
        raise StateMismatchError(
            f"{path / hf_folders.ADAPTER_WEIGHTS} holds adapter tensor(s) the model has no "
            f"place for: {', '.join(stray[:5])}{' ...' if len(stray) > 5 else ''}; build "
            "the PeftModel with this adapter's config (target_modules, modules_to_save)"
        )
    lacking = sorted(fqn_of.keys() - set(files.headers))
    if lacking:
        raise IncompleteCheckpointError(
            f"{path / hf_folders.ADAPTER_WEIGHTS} has no value for adapter tensor(s) "
            f"{', '.join(lacking[:5])}{' ...' if len(lacking) > 5 else ''} of the model"
        )
    values = files.read_all()
    model = {fqn_of[name]: t for name, t in values.items()}
    return ForeignState(source=str(path), kind="peft", model=model, partial=True)


def read_torch_save(path: Path, ignore: set[str], *, trust_pickle: bool = False) -> ForeignState:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=not trust_pickle)
    except Exception as exc:
        raise CorruptCheckpointError(
            f"{path} cannot be loaded with torch.load(weights_only={not trust_pickle}): "
            f"{_first_line(exc)}. Only tensors, containers and plain values are accepted"
            + ("" if trust_pickle else f". {dcp_metadata.TRUST}")
        ) from None
    if isinstance(obj, dict) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        obj = {"model": obj}  # a bare model state_dict
    if not isinstance(obj, dict) or not isinstance(obj.get("model"), dict):
        raise CorruptCheckpointError(
            f"{path} holds a {type(obj).__name__}, not a dict with a 'model' state_dict "
            "(expected {'model': ..., 'optimizer': ..., 'scheduler'?: ..., 'step'?: int})"
        )
    bad = [k for k, v in obj["model"].items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise CorruptCheckpointError(f"{path}: model entries that are not tensors: {bad[:5]}")
    step = obj.get("step")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        raise CorruptCheckpointError(f"{path}: 'step' is {step!r}, not an int >= 0")
    optimizer = obj.get("optimizer")
    if optimizer is not None and not (
        isinstance(optimizer, dict) and "state" in optimizer and "param_groups" in optimizer
    ):
        raise CorruptCheckpointError(
            f"{path}: 'optimizer' is not an optimizer.state_dict() (no state/param_groups)"
        )
    return ForeignState(
        source=str(path),
        kind="torch.save",
        model=dict(obj["model"]),
        optimizer=optimizer,
        scheduler=obj.get("scheduler"),
        step=step,
        unmapped=sorted(str(k) for k in obj if k not in _KNOWN_TOP and str(k) not in ignore),
    )


def read_dcp(
    path: Path, model_fqns: set[str], ignore: set[str], *, trust_pickle: bool = False
) -> ForeignState:
    md = dcp_metadata.read(path, trust_pickle=trust_pickle)
    reader = dcp_metadata.SafeReader(path, md)
    paths = md.planner_data or {}
    state = ForeignState(source=str(path), kind="dcp", model={}, optimizer_keyed_by="fqn")
    targets: dict[str, Any] = {}
    where: dict[str, tuple[str, ...]] = {}
    for key, meta in md.state_dict_metadata.items():
        obj_path = tuple(paths.get(key, (key,)))
        if str(obj_path[0]).split(".")[0] in ignore:
            continue
        place = _classify(key, obj_path, model_fqns)
        if place is None:
            state.unmapped.append(key)
            continue
        where[key] = place
        if isinstance(meta, BytesStorageMetadata):
            targets[key] = None
        else:
            targets[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    planner = _SafeBytesPlanner(path, trust_pickle)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(targets, storage_reader=reader, planner=planner, no_dist=True)
    except CheckpointException as exc:
        inner = unwrap(exc, f"reading {path}")
        if isinstance(inner, CorruptCheckpointError) or not isinstance(inner, Exception):
            raise inner from None  # ours, naming the entry; or an interrupt, unchanged
        raise CorruptCheckpointError(f"{path}: {inner}") from None
    _assemble(state, targets, where)
    return state


def _classify(key: str, obj_path: tuple, model_fqns: set[str]) -> tuple[str, ...] | None:
    """Where a DCP entry goes: ("model", fqn), ("state", fqn, name), ("hyper", fqn, name),
    ("group", index, name), ("step",); None if it fits nowhere."""
    if key in model_fqns:  # no prefix (checked first: HF models have a ``model.`` child)
        return ("model", key)
    if key.startswith("model.") and key[6:] in model_fqns:
        return ("model", key[6:])
    if key in ("step", "train_state.step"):
        return ("step",)
    rest = key.removeprefix("optimizer.")
    if rest.startswith("state."):
        fqn, _, name = rest[6:].rpartition(".")
        return ("state", fqn, name) if fqn in model_fqns else None
    if rest.startswith("param_groups."):
        if len(obj_path) >= 2 and isinstance(obj_path[-2], int):  # nested: groups by index
            return ("group", str(obj_path[-2]), str(obj_path[-1]))
        fqn, _, name = rest[13:].rpartition(".")
        if fqn in model_fqns:
            return ("hyper", fqn, name)
        index, _, name = rest[13:].partition(".")
        if index.isdigit() and name and "." not in name:
            return ("group", index, name)
    return None


def _assemble(state: ForeignState, values: dict[str, Any], where: dict[str, tuple]) -> None:
    opt_state: dict[str, dict[str, Any]] = {}
    hyper: dict[str, dict[str, Any]] = {}
    groups: dict[int, dict[str, Any]] = {}
    for key, place in where.items():
        value = values[key]
        if place[0] == "model":
            state.model[place[1]] = value
        elif place[0] == "state":
            opt_state.setdefault(place[1], {})[place[2]] = value
        elif place[0] == "hyper":
            hyper.setdefault(place[1], {})[place[2]] = value
        elif place[0] == "group":
            groups.setdefault(int(place[1]), {})[place[2]] = value
        elif isinstance(value, numbers.Integral) and not isinstance(value, bool):
            state.step = int(value)  # a NumPy integer too (read with trust_pickle)
        elif (
            isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point()
        ):
            state.step = int(value)
        else:
            state.unmapped.append(key)
    if opt_state or hyper or groups:
        state.optimizer = {"state": opt_state}
        if groups:
            state.optimizer["param_groups"] = [groups[i] for i in sorted(groups)]
        if hyper:
            state.optimizer["hyperparameters"] = hyper


class _SafeBytesPlanner(DefaultLoadPlanner):
    """Non-tensor entries are loaded with ``weights_only=True``: no arbitrary objects
    (unless ``trust_pickle``); one that cannot be loaded is an error naming it."""

    def __init__(self, folder: Path, trust_pickle: bool) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.folder, self.trust_pickle = folder, trust_pickle

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=not self.trust_pickle)
        except Exception as exc:
            refused = isinstance(exc, pickle.UnpicklingError) and not self.trust_pickle
            raise CorruptCheckpointError(
                f"{self.folder}: DCP entry {fqn!r} cannot be loaded with torch.load("
                f"weights_only={not self.trust_pickle}): {_first_line(exc)}"
                + (f". {dcp_metadata.TRUST}" if refused else "")
            ) from None
        self.state_dict[fqn] = loaded


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
