"""Export into a folder that ``transformers`` or ``peft`` loads: ``--format hf`` and
``--format peft``.

``hf``: the model's tensors in safetensors shards named and split as transformers 5.24's
``save_pretrained`` splits them (huggingface_hub's rule: tensors in order, a new shard
when the next would pass ``max_shard_size``, a tensor larger than that alone in its
own), ``model.safetensors`` alone when one shard holds everything, else
``model-0000K-of-0000N.safetensors`` and ``model.safetensors.index.json`` built from what
was written. Tied weights are written once (``export_source.py``), as transformers does.
``config`` (a ``config.json`` or a folder holding one) is copied beside them, so that
``AutoModelForCausalLM.from_pretrained(folder)`` loads the folder.

``peft``: the adapter's tensors under the names PEFT's file uses (``peft_names.py``) in
``adapter_model.safetensors``, and ``adapter_config.json`` from ``config`` or from the
checkpoint's manifest (its ``peft`` field, when the save recorded one).

Everything is written into ``.<name>.partial-<id>`` beside the destination and renamed to
it at the end; the destination must not exist or be an empty folder; on any failure the
partial folder is removed and nothing appears at the destination.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    StateMismatchError,
)
from . import peft_names
from .export_source import ExportSource
from .hf_folders import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    CONFIG,
    INDEX,
    SINGLE,
    read_json,
)
from .reporting import Progress
from .safetensors_files import Entry, write_file

DEFAULT_SHARD_SIZE = "50GB"  # transformers 5.24 save_pretrained's default
_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}  # huggingface_hub's


def parse_shard_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or a number and a decimal unit (``"5GB"``, ``"1.5MB"``,
    ``"2KB"``), parsed as huggingface_hub parses ``max_shard_size``.

    Raises:
        ValueError: any other form, or a size below 1 byte.
    """
    if isinstance(size, str) and size.strip().isdigit():
        size = int(size)
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    elif isinstance(size, str) and size.strip()[-2:].upper() in _UNITS:
        text = size.strip()
        try:
            value = int(float(text[:-2].strip()) * _UNITS[text[-2:].upper()])
        except ValueError:
            value = 0
    else:
        value = 0
    if value < 1:
        raise ValueError(
            f"max_shard_size must be bytes (an int) or a number with TB, GB, MB or KB "
            f"(e.g. 5GB, 500MB), at least 1 byte; got {size!r}"
        )
    return value


def split(entries: list[Entry], max_size: int) -> list[list[Entry]]:
    """``entries`` in shards as huggingface_hub's ``split_state_dict_into_shards`` makes
    them."""
    shards: list[list[Entry]] = []
    current: list[Entry] = []
    size = 0
    for e in entries:
        if e.nbytes > max_size:
            shards.append([e])
            continue
        if size + e.nbytes > max_size:
            shards.append(current)
            current, size = [], 0
        current.append(e)
        size += e.nbytes
    if current:
        shards.append(current)
    return shards


def shard_name(index: int, count: int) -> str:
    return SINGLE if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


@dataclasses.dataclass(frozen=True, kw_only=True)
class FolderOptions:
    """What a folder export is asked for (``export_checkpoint``'s arguments, parsed)."""

    dtype: torch.dtype | None  # floating-point tensors cast to this; None: kept
    max_shard_size: int  # hf: bytes per shard at most
    config: Path | None  # hf: config.json (or its folder); peft: adapter_config.json
    adapter: str  # peft: the adapter exported
    metadata: dict[str, str]  # hf: each shard's __metadata__
    progress: Progress | None


def write_model_folder(
    source: ExportSource, folder: Path, options: FolderOptions
) -> tuple[list[str], int, int]:
    """Write the HF model folder's files into ``folder`` (the partial one).

    Returns:
        (file names written, tensors written, bytes of tensor data).
    """
    fqns = source.model_tensors()
    entries = [source.entry(fqn, fqn, options.dtype) for fqn in fqns]
    shards = split(entries, options.max_shard_size)
    source.count_progress(options.progress, fqns)
    metadata, config = options.metadata, options.config
    files, weight_map, total = [], {}, 0
    for i, shard in enumerate(shards):
        name = shard_name(i, len(shards))
        total += write_file(folder / name, shard, metadata, lambda e: source.read(e.name))
        files.append(name)
        weight_map.update({e.name: name for e in shard})
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        files.append(INDEX)
    if config is not None:
        _copy_json(_config_file(config, CONFIG), folder / CONFIG, "a model config")
        files.append(CONFIG)
    return files, len(entries), total


def adapter_config(source: ExportSource, config: Path | None, adapter: str) -> dict[str, Any]:
    """The adapter's config: from ``config`` if given, else the manifest's ``peft`` field.

    Raises:
        IncompleteCheckpointError: neither holds it.
    """
    if config is not None:
        return read_json(_config_file(config, ADAPTER_CONFIG), "an adapter config")
    recorded = source.doc.get("peft") or {}
    if adapter not in recorded:
        known = f" (it records {', '.join(map(repr, sorted(recorded)))})" if recorded else ""
        raise IncompleteCheckpointError(
            f"{source.folder} records no config for adapter {adapter!r}{known}; pass "
            "--config with the adapter's adapter_config.json (config= in Python), or "
            "--adapter NAME"
        )
    return dict(recorded[adapter])


def write_adapter_folder(
    source: ExportSource, folder: Path, options: FolderOptions
) -> tuple[list[str], int, int]:
    """Write ``adapter_model.safetensors`` and ``adapter_config.json`` into ``folder``.

    Returns:
        (file names written, tensors written, bytes of tensor data).
    """
    adapter = options.adapter
    cfg = adapter_config(source, options.config, adapter)
    names = peft_names.file_names(source.fqns, adapter, cfg)
    if not names:
        found = sorted(peft_names.adapters_in(source.fqns))
        raise StateMismatchError(
            f"{source.folder} holds no tensor of adapter {adapter!r}"
            + (f"; its adapters: {', '.join(found)}: pass --adapter NAME" if found else "")
        )
    by_name = {name: fqn for fqn, name in names.items()}
    entries = [source.entry(name, by_name[name], options.dtype) for name in sorted(by_name)]
    source.count_progress(options.progress, sorted(names))
    total = write_file(
        folder / ADAPTER_WEIGHTS, entries, {"format": "pt"}, lambda e: source.read(by_name[e.name])
    )
    cfg["inference_mode"] = True  # as peft's save_pretrained writes it
    (folder / ADAPTER_CONFIG).write_text(json.dumps(cfg, indent=2, sort_keys=True))
    return [ADAPTER_WEIGHTS, ADAPTER_CONFIG], len(entries), total


@contextlib.contextmanager
def partial_folder(to: Path) -> Iterator[Path]:
    """A fresh folder beside ``to``, renamed to ``to`` when the block ends without error
    and removed when it raises.

    Raises:
        CheckpointError: ``to`` exists and is not an empty folder.
    """
    if to.exists() and not (to.is_dir() and not any(to.iterdir())):
        raise CheckpointError(
            f"{to} already exists and is not an empty folder; an export writes a new "
            "folder: pass a path that does not exist (or remove it first)"
        )
    to.parent.mkdir(parents=True, exist_ok=True)
    partial = to.with_name(f".{to.name}.partial-{uuid.uuid4().hex[:8]}")
    partial.mkdir()
    try:
        yield partial
        for name in os.listdir(partial):
            with open(partial / name, "rb") as f:
                os.fsync(f.fileno())
        os.replace(partial, to)  # onto an empty folder too (rename(2))
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def _config_file(config: Path, name: str) -> Path:
    """``config`` itself, or ``config/name`` for a folder."""
    return config / name if config.is_dir() else config


def _copy_json(src: Path, dst: Path, what: str) -> None:
    """Copy ``src`` byte for byte once it is known to be a JSON object."""
    try:
        read_json(src, what)
    except CorruptCheckpointError as exc:
        raise ValueError(f"--config: {exc}") from None
    shutil.copyfile(src, dst)
