"""DeepSpeed checkpoint folders (``engine.save_checkpoint``) read as whole per-parameter state.

A tag folder (``dir/global_stepN``) holds the module state and counters
(``mp_rank_00_model_states.pt``; at ZeRO-3 one ``zero_pp_rank_R_mp_rank_00_model_states.pt``
per rank) and one ``*zero_pp_rank_R_mp_rank_00_optim_states.pt`` per data-parallel rank
with that rank's flat partitions: the fp32 master weights and the torch optimizer's state
shaped like them. Each parameter is cut out of every rank's partition and joined:

- stages 1-2: by the ``param_slice_mappings`` each rank records (name -> numel, start in
  its partition); the parameter's fragments in rank order make it whole;
- stage 3: every parameter is split on its own, ``ceil(numel / world)`` elements per rank,
  one after the other in ``param_shapes`` order; the pieces in rank order, cut to numel.

The compute weights are the module state at stages 1-2; at ZeRO-3 the module holds
placeholders and the compute weight is the fp32 master cast to the compute dtype (what
DeepSpeed copies after every step). Everything that would not come back exactly (Muon,
fp16, frozen or shared parameters, model parallelism, a missing rank) is refused by name.
Files are read with ``torch.load(weights_only=True)`` (:mod:`.deepspeed_pickles`): no code
is unpickled, and DeepSpeed need not be installed.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

import torch

from ..errors import CorruptCheckpointError, IncompleteCheckpointError, StateMismatchError
from . import deepspeed_pickles

MASTER = "fp32_master"
OPTIM_FILE = re.compile(r"^(.*)zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
COUNTERS = ("global_steps", "global_samples", "skipped_steps")
# What DeepSpeed itself writes in the model states file (engine._common_checkpoint_state);
# any other top-level key is the client_state passed to save_checkpoint.
ENGINE_KEYS = frozenset(
    {
        "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes",
        "shared_params", "frozen_param_fragments", "lr_scheduler", "skipped_steps",
        "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
        "ds_version", "checkpoint_parallel_dimensions",
    }
)  # fmt: skip
# Engine state with no place in an unbroken checkpoint: an error unless left out.
UNMAPPED = ("data_sampler", "random_ltd", "universal_checkpoint_info")


@dataclasses.dataclass
class DeepSpeedState:
    """One DeepSpeed tag folder, whole and keyed by parameter FQN."""

    folder: Path
    stage: int
    world: int
    model: dict[str, torch.Tensor]  # compute weights (and buffers)
    state: dict[str, dict[str, Any]]  # per FQN: fp32_master, exp_avg, exp_avg_sq, step
    param_groups: list[dict[str, Any]]  # hyperparameters, "params": [FQN, ...]
    counters: dict[str, int]  # the engine's: global_steps ... micro_steps
    scheduler: dict[str, Any] | None
    ignored: list[str]  # top-level entries left out on request (client_state...)


def is_deepspeed(path: Path) -> bool:
    """Whether ``path`` is a DeepSpeed checkpoint folder (its ``latest`` naming a tag
    folder of its own) or a tag folder (it holds ``*mp_rank_00_model_states.pt``)."""
    if not path.is_dir():
        return False
    if _holds_model_states(path):
        return True
    latest = path / "latest"
    if not latest.is_file() or latest.stat().st_size > 4096:
        return False
    # DeepSpeed writes its offline converter beside ``latest``; a tag folder that lost
    # its files still makes this a DeepSpeed folder (tag_folder says which is missing)
    return (path / "zero_to_fp32.py").is_file() or any(
        _holds_model_states(sub) for sub in path.iterdir()
    )


def tag_folder(path: Path) -> Path:
    """``path`` itself if it holds the files, else the tag its ``latest`` names."""
    if _holds_model_states(path):
        return path
    tag = (path / "latest").read_text(errors="replace").strip()
    folder = path / tag
    if not tag or "/" in tag or not _holds_model_states(folder):
        raise IncompleteCheckpointError(
            f"{path / 'latest'} names tag {tag!r}, but {folder} holds no "
            "*mp_rank_00_model_states.pt; pass a tag folder that does"
        )
    return folder


def _holds_model_states(path: Path) -> bool:
    return path.is_dir() and any(path.glob("*mp_rank_00_model_states.pt"))


def _load(path: Path, trust_pickle: bool) -> dict[str, Any]:
    return deepspeed_pickles.load(path, trust_pickle=trust_pickle)


def read(path: Path, *, trust_pickle: bool = False, ignore: Any = ()) -> DeepSpeedState:
    """The DeepSpeed checkpoint at ``path`` (a folder with ``latest``, or a tag folder).
    The model states file's other top-level entries (``save_checkpoint``'s
    ``client_state``, curriculum or random-LTD state) must be named in ``ignore``.

    Raises:
        IncompleteCheckpointError: a rank's optimizer file (or the model file) is missing.
        StateMismatchError: state this import cannot bring in exactly (named).
        CorruptCheckpointError: a file is unreadable or its partitions do not add up.
    """
    folder = tag_folder(path)
    if any(folder.glob("*mp_rank_01_*")):
        raise StateMismatchError(
            f"{folder}: model-parallel files (mp_rank_01...); only data-parallel ZeRO "
            "checkpoints (mp_rank_00) can be imported"
        )
    meta = _model_states(folder, trust_pickle)
    config = meta.get("ds_config") or {}
    _refuse_unsupported(folder, meta, config)
    ignored = _left_out(folder, meta, set(ignore))
    world = int(meta["dp_world_size"])
    ranks = [_load(f, trust_pickle)["optimizer_state_dict"] for f in _optim_files(folder, world)]
    stage = int(ranks[0]["zero_stage"])
    shapes = [dict(g) for g in meta["param_shapes"]]
    if stage in (1, 2):
        masters, pieces = _stage12(folder, ranks, shapes)
        base = [r["base_optimizer_state"] for r in ranks]
    elif stage == 3:
        masters, pieces = _stage3(folder, ranks, shapes, world)
        base = [r["optimizer_state_dict"] for r in ranks]
    else:
        raise StateMismatchError(f"{folder}: ZeRO stage {stage}; only stages 1-3 can be imported")
    flat_key = "single_partition_of_fp32_groups" if stage < 3 else "fp32_flat_groups"
    sizes = [[t.numel() for t in r[flat_key]] for r in ranks]
    state, groups = _optimizer(folder, base, shapes, masters, pieces, sizes)
    model = _model(folder, meta["module"], shapes, masters, stage)
    counters = {name: int(meta[name]) for name in COUNTERS}
    counters["micro_steps"] = counters["global_steps"] * _accumulation(config, world)
    scheduler = meta.get("lr_scheduler")
    return DeepSpeedState(folder, stage, world, model, state, groups, counters, scheduler, ignored)


def _model_states(folder: Path, trust_pickle: bool) -> dict[str, Any]:
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        if (folder / name).is_file():
            return _load(folder / name, trust_pickle)
    raise IncompleteCheckpointError(
        f"{folder} has no mp_rank_00_model_states.pt (or zero_pp_rank_0_mp_rank_00_model_states.pt)"
    )


def _refuse_unsupported(folder: Path, meta: dict, config: dict) -> None:
    if (config.get("fp16") or {}).get("enabled"):
        raise StateMismatchError(
            f"{folder}: an fp16 DeepSpeed checkpoint; its dynamic loss scaler is not part of "
            "an unbroken checkpoint, so a resume would not continue exactly (bf16 and fp32 only)"
        )
    optimizer = str((config.get("optimizer") or {}).get("type", "")).lower()
    if "muon" in optimizer:
        raise StateMismatchError(
            f"{folder}: a DeepSpeed Muon checkpoint, which cannot be imported exactly: at "
            "ZeRO stages 1-2 Muon keeps its momentum in a flat buffer of whole parameters "
            "that the files do not lay out per parameter (refused at every stage). Save "
            "with unbroken's checkpointer_for(engine) during training instead"
        )
    for key in ("frozen_param_shapes", "shared_params"):
        if meta.get(key):
            raise StateMismatchError(
                f"{folder}: the checkpoint has {key} ({', '.join(map(str, meta[key]))}); "
                "frozen and shared parameters cannot be imported yet"
            )


def _left_out(folder: Path, meta: dict, ignore: set[str]) -> list[str]:
    """The entries to leave out: every one not DeepSpeed's own must be in ``ignore``."""
    extra = {k for k in meta if k not in ENGINE_KEYS and k not in UNMAPPED}
    extra |= {k for k in UNMAPPED if meta.get(k) is not None}
    unasked = sorted(extra - ignore, key=str)
    if unasked:
        raise StateMismatchError(
            f"{folder}: entries with no place in an unbroken checkpoint (save_checkpoint's "
            f"client_state, or engine state this import does not map): "
            f"{', '.join(map(str, unasked))}; pass --ignore NAME for each to leave it out on "
            "purpose"
        )
    return sorted(extra & ignore, key=str)


def _optim_files(folder: Path, world: int) -> list[Path]:
    found: dict[int, Path] = {}
    prefixes = set()
    for f in folder.iterdir():
        m = OPTIM_FILE.match(f.name)
        if m and m.group(3) == "00":
            found[int(m.group(2))] = f
            prefixes.add(m.group(1))
    if not found:
        raise IncompleteCheckpointError(
            f"{folder} has no *zero_pp_rank_R_mp_rank_00_optim_states.pt: not a ZeRO checkpoint "
            "(stage 0 checkpoints cannot be imported)"
        )
    prefix = sorted(prefixes)[0]
    missing = [
        f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
        for r in range(world)
        if r not in found
    ]
    if missing:
        raise IncompleteCheckpointError(
            f"{folder} lacks {', '.join(missing)} of its {world} data-parallel rank(s); copy "
            "the whole tag folder as every rank wrote it"
        )
    extra = sorted(r for r in found if r >= world)
    if extra:
        raise CorruptCheckpointError(
            f"{folder} holds optimizer files of rank(s) {extra}, but its model states record "
            f"{world} rank(s): files from another run were mixed in"
        )
    return [found[r] for r in range(world)]


Pieces = dict[str, list[tuple[int, int, int, int]]]  # FQN -> [(rank, group, start, numel)]


def _stage12(folder: Path, ranks: list[dict], shapes: list[dict]) -> tuple[dict, Pieces]:
    pieces: Pieces = {}
    for r, osd in enumerate(ranks):
        mappings = osd.get("param_slice_mappings")
        if mappings is None:
            raise StateMismatchError(
                f"{folder}: rank {r}'s optimizer file records no param_slice_mappings"
            )
        for g, mapping in enumerate(mappings):
            for name, address in mapping.items():
                pieces.setdefault(name, []).append((r, g, int(address.start), int(address.numel)))
    flats = [osd["single_partition_of_fp32_groups"] for osd in ranks]
    masters = _join(folder, pieces, shapes, lambda r, g: flats[r][g], "fp32 master")
    return masters, pieces


def _stage3(folder: Path, ranks: list[dict], shapes: list[dict], world: int) -> tuple[dict, Pieces]:
    pieces: Pieces = {}
    for g, group in enumerate(shapes):
        at = 0
        for name, shape in group.items():
            each = math.ceil(math.prod(shape) / world)
            pieces[name] = [(r, g, at, each) for r in range(world)]
            at += each
        for r, osd in enumerate(ranks):
            if len(osd["fp32_flat_groups"]) != len(shapes):
                raise StateMismatchError(
                    f"{folder}: rank {r} holds {len(osd['fp32_flat_groups'])} fp32 sub-group(s) "
                    f"for {len(shapes)} parameter group(s) (a sub_group_size that splits "
                    "groups); such checkpoints cannot be imported yet"
                )
            held = osd["fp32_flat_groups"][g].numel()
            if held != at:
                raise CorruptCheckpointError(
                    f"{folder}: rank {r}'s fp32 group {g} holds {held} elements, its "
                    f"parameters' partitions {at}"
                )
    flats = [osd["fp32_flat_groups"] for osd in ranks]
    masters = _join(folder, pieces, shapes, lambda r, g: flats[r][g], "fp32 master")
    return masters, pieces


def _join(
    folder: Path, pieces: Pieces, shapes: list[dict], flat, what: str
) -> dict[str, torch.Tensor]:
    """Each parameter whole from its pieces of ``flat(rank, group)``."""
    out = {}
    for group in shapes:
        for name, shape in group.items():
            numel = math.prod(shape)
            parts = []
            for r, g, start, n in pieces.get(name, []):
                source = flat(r, g).reshape(-1)
                if start + n > source.numel():
                    n = max(0, source.numel() - start)  # stage 3: the last rank's padding
                parts.append(source[start : start + n])
            whole = torch.cat(parts) if parts else torch.empty(0)
            if whole.numel() < numel:
                raise CorruptCheckpointError(
                    f"{folder}: the {what} of {name} adds up to {whole.numel()} of its "
                    f"{numel} elements across the ranks' partitions"
                )
            out[name] = whole[:numel].reshape(shape).detach().clone()
    return out


def _optimizer(
    folder: Path,
    base: list[dict],
    shapes: list[dict],
    masters: dict,
    pieces: Pieces,
    sizes: list[list[int]],
) -> tuple[dict, list[dict]]:
    """Per parameter: its master and every state entry shaped like the partitions (cut
    as the masters are); an entry kept once per group (a step) goes to each."""
    groups = []
    for g, group in enumerate(base[0]["param_groups"]):
        hyper = {k: v for k, v in group.items() if k != "params"}
        if "use_muon" in hyper:
            raise StateMismatchError(
                f"{folder}: Muon parameter groups; Muon checkpoints cannot be imported exactly"
            )
        groups.append({**hyper, "params": list(shapes[g])})
    if len(groups) != len(shapes):
        raise CorruptCheckpointError(
            f"{folder}: {len(groups)} optimizer param group(s), {len(shapes)} in param_shapes"
        )
    state: dict[str, dict[str, Any]] = {name: {MASTER: t} for name, t in masters.items()}
    for g, group in enumerate(shapes):
        held = [b["state"].get(g, {}) for b in base]
        for key in sorted(held[0]):
            value = held[0][key]
            if isinstance(value, torch.Tensor) and value.dim():
                _check_partitioned(folder, g, key, [h.get(key) for h in held], sizes)
                whole = _join(folder, pieces, [group], lambda r, _, k=key, h=held: h[r][k], key)
            else:  # one per group (Adam's step): every parameter's
                whole = {
                    name: value.clone() if isinstance(value, torch.Tensor) else value
                    for name in group
                }
            for name, tensor in whole.items():
                state[name][key] = tensor
    return state, groups


def _check_partitioned(
    folder: Path, g: int, key: str, values: list[Any], sizes: list[list[int]]
) -> None:
    """Every rank holds ``key`` shaped like its partition of group ``g``: the fp32 one at
    stage 3; at stages 1-2 one padded size on every rank, at least its fp32 partition
    (which the files keep without the last rank's padding). Anything else (Muon's flat
    momentum) would be cut wrongly."""
    lengths = [v.numel() if isinstance(v, torch.Tensor) else None for v in values]
    padded = len(set(lengths)) == 1 and all(
        n is not None and n >= sizes[r][g] for r, n in enumerate(lengths)
    )
    if not padded:
        raise StateMismatchError(
            f"{folder}: optimizer state {key!r} of group {g} holds {lengths} elements on the "
            f"ranks, their fp32 partitions {[s[g] for s in sizes]}: it is not laid out like "
            "the partitions, so it cannot be cut per parameter exactly"
        )


def _model(folder: Path, module: dict, shapes: list[dict], masters: dict, stage: int) -> dict:
    params = {name for group in shapes for name in group}
    out = {}
    for name, value in module.items():
        if name in params and stage == 3:  # a placeholder: the master in the compute dtype
            out[name] = masters[name].to(value.dtype)
        else:
            out[name] = value
    missing = sorted(params - set(out))
    if missing:
        raise IncompleteCheckpointError(
            f"{folder}: the module state lacks parameter(s) {missing[:5]}"
        )
    return out


def _accumulation(config: dict, world: int) -> int:
    gas = config.get("gradient_accumulation_steps")
    if isinstance(gas, int):
        return gas
    batch, micro = config.get("train_batch_size"), config.get("train_micro_batch_size_per_gpu")
    if isinstance(batch, int) and isinstance(micro, int):
        return max(1, batch // (micro * world))
    return 1
