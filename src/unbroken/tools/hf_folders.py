"""Hugging Face weight folders, read safely: a sharded model through its index, a single
``model.safetensors``, a PEFT adapter, or any folder of ``.safetensors`` files.

What ``transformers`` writes (``save_pretrained``, checked against 5.24): a model that
fits one shard is ``model.safetensors`` alone; a larger one is
``model-00001-of-0000N.safetensors``... with ``model.safetensors.index.json``,
``{"metadata": {"total_size": ...}, "weight_map": {tensor name: file name}}``. A PEFT
adapter is ``adapter_model.safetensors`` beside ``adapter_config.json``.

Opening a folder checks all of it before any tensor is read: the index is a JSON object
whose ``weight_map`` names plain files of the folder; every shard's header is sound
(``safetensors_files.read_header``); every name in the index is held by the shard it
names, every tensor a shard holds is named in the index for that shard, and no name is
held by two files. Each failure is a :class:`~unbroken.CorruptCheckpointError` naming
the file and the tensor.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointNotFoundError, CorruptCheckpointError
from .safetensors_files import FileHeader, load, read_header

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
CONFIG = "config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def is_model_folder(path: Path) -> bool:
    """Whether ``path`` is an HF model folder (an index, or a single model.safetensors)."""
    return path.is_dir() and ((path / INDEX).is_file() or (path / SINGLE).is_file())


def is_adapter_folder(path: Path) -> bool:
    """Whether ``path`` is a PEFT adapter folder."""
    return path.is_dir() and (path / ADAPTER_WEIGHTS).is_file()


class WeightFiles:
    """The tensors of one or more checked safetensors files, by name.

    Attributes:
        where: what was opened (a folder or a file), for messages.
        headers: tensor name -> the checked header of the file holding it.
    """

    def __init__(self, where: Path, headers: dict[str, FileHeader]) -> None:
        self.where = where
        self.headers = headers

    def shapes(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return {name: h.tensors[name] for name, h in self.headers.items()}

    def read(self, name: str) -> torch.Tensor:
        """The tensor ``name`` (CPU, as stored)."""
        return load(self.headers[name], [name])[name]

    def read_all(self) -> dict[str, torch.Tensor]:
        """Every tensor, one file at a time."""
        by_file: dict[Path, list[str]] = {}
        for name, h in self.headers.items():
            by_file.setdefault(h.path, []).append(name)
        out: dict[str, torch.Tensor] = {}
        for names in by_file.values():
            out.update(load(self.headers[names[0]], names))
        return out


def open_model(folder: Path) -> WeightFiles:
    """An HF model folder: through its index if it has one, else its model.safetensors.

    Raises:
        CorruptCheckpointError: see the module docstring.
    """
    if not (folder / INDEX).is_file():
        return open_files(folder, [folder / SINGLE])
    index_path = folder / INDEX
    weight_map = _weight_map(index_path)
    files = sorted(set(weight_map.values()))
    headers = {name: read_header(folder / name) for name in files}
    for tensor, file in sorted(weight_map.items()):
        if tensor not in headers[file].tensors:
            raise CorruptCheckpointError(
                f"{index_path} maps tensor {tensor!r} to {folder / file}, which does not "
                "hold it; the folder is incomplete or its files come from different saves: "
                "copy or export it again"
            )
    out = _by_name(folder, headers.values())
    for tensor, header in out.items():
        if weight_map.get(tensor) != header.path.name:
            raise CorruptCheckpointError(
                f"{header.path} holds tensor {tensor!r}, which {index_path} does not name "
                "for that file; the folder mixes files of different saves: copy or export "
                "it again"
            )
    return WeightFiles(folder, out)


def open_files(where: Path, paths: list[Path]) -> WeightFiles:
    """Several safetensors files read as one (no name held twice)."""
    return WeightFiles(where, _by_name(where, [read_header(p) for p in paths]))


def open_base(path: Path) -> WeightFiles:
    """A base model: an HF model folder, one ``.safetensors`` file, or a folder of them.

    Raises:
        CheckpointNotFoundError: ``path`` is none of these.
        CorruptCheckpointError: a file fails the checks of the module docstring.
    """
    if path.is_file():
        return open_files(path, [path])
    if is_model_folder(path):
        return open_model(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        raise CheckpointNotFoundError(
            f"{path} is not a base model: pass an HF model folder, a .safetensors file, or "
            "a folder holding .safetensors files"
        )
    return open_files(path, files)


def read_json(path: Path, what: str) -> dict[str, Any]:
    """A JSON object file (an index, a config), or a clear error naming it."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path} is missing: {what} is needed") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpointError(
            f"{path} is not readable JSON ({exc}); {what} is damaged: copy or write it again"
        ) from None
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{path} holds a {type(doc).__name__}, not {what}")
    return doc


def _weight_map(index_path: Path) -> dict[str, str]:
    index = read_json(index_path, "a model.safetensors index (a JSON object)")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CorruptCheckpointError(
            f"{index_path} has no 'weight_map' object of tensor name -> file name; the index "
            "is damaged: copy or export the folder again"
        )
    for tensor, file in weight_map.items():
        if Path(file).name != file or file in ("", ".", ".."):
            raise CorruptCheckpointError(
                f"{index_path} maps tensor {tensor!r} to {file!r}, not a file name of the "
                "folder; refusing to read outside it"
            )
    return weight_map


def _by_name(where: Path, headers: Any) -> dict[str, FileHeader]:
    out: dict[str, FileHeader] = {}
    for header in headers:
        for tensor in header.tensors:
            if tensor in out:
                raise CorruptCheckpointError(
                    f"tensor {tensor!r} is held by both {out[tensor].path} and {header.path} "
                    f"in {where}; the folder mixes files of different saves: copy or export "
                    "it again"
                )
            out[tensor] = header
    return out
