"""Damaged or inconsistent HF folders given to `unbroken import`: one clear error each
(CorruptCheckpointError naming the file and the tensor, exit 1), nothing written at the
destination. The safetensors headers are parsed and checked before safetensors reads."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

import unbroken as ub

from .conftest import run_cli
from .factories import model_only


def _folder(tmp_path):
    """A valid two-shard HF folder for factories.Small."""
    state = model_only().state_dict()
    folder = tmp_path / "hf"
    folder.mkdir()
    first = {k: v for k, v in state.items() if k.startswith("inp.")}
    second = {k: v for k, v in state.items() if not k.startswith("inp.")}
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    save_file(first, str(folder / names[0]), metadata={"format": "pt"})
    save_file(second, str(folder / names[1]), metadata={"format": "pt"})
    weight_map = {k: names[0] for k in first} | {k: names[1] for k in second}
    _write_index(folder, weight_map)
    return folder, weight_map


def _write_index(folder, weight_map):
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _rewrite_header(path, edit):
    """Apply ``edit(header dict)`` to a safetensors file's header, data kept."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    head = json.loads(raw[8 : 8 + n])
    edit(head)
    text = json.dumps(head).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


def _import_fails(tmp_path, folder, *patterns):
    dest = tmp_path / "imported"
    with pytest.raises(ub.CorruptCheckpointError) as info:
        ub.import_checkpoint(folder, dest, model_only(), step=1)
    for p in patterns:
        assert p in str(info.value), str(info.value)
    assert not dest.exists()
    return str(info.value)


def _shard(folder, k):
    return folder / f"model-0000{k}-of-00002.safetensors"


def test_the_valid_folder_imports(tmp_path):
    """The baseline the damaged copies below start from."""
    folder, _ = _folder(tmp_path)
    assert ub.import_checkpoint(folder, tmp_path / "ok", model_only(), step=1).model_tensors == 5


def test_an_index_naming_a_tensor_no_shard_holds(tmp_path):
    """Guards against a tensor silently left at the factory's value."""
    folder, weight_map = _folder(tmp_path)
    _write_index(folder, weight_map | {"extra.weight": _shard(folder, 2).name})
    _import_fails(tmp_path, folder, "'extra.weight'", str(_shard(folder, 2)), "does not hold")


def test_a_shard_holding_a_tensor_the_index_does_not_name(tmp_path):
    """Guards against a shard from another save mixed into the folder."""
    folder, weight_map = _folder(tmp_path)
    del weight_map["out.bias"]
    _write_index(folder, weight_map)
    _import_fails(tmp_path, folder, str(_shard(folder, 2)), "'out.bias'", "does not name")


def test_two_shards_holding_one_name(tmp_path):
    """Guards against one of two values of a tensor being picked silently."""
    folder, _ = _folder(tmp_path)
    save_file(
        {"out.bias": torch.zeros(2), "inp.weight": torch.zeros(6, 4), "inp.bias": torch.zeros(6)},
        str(_shard(folder, 1)),
    )
    _import_fails(tmp_path, folder, "'out.bias'", "held by both", str(_shard(folder, 1)))


def test_a_missing_shard(tmp_path):
    folder, _ = _folder(tmp_path)
    _shard(folder, 2).unlink()
    _import_fails(tmp_path, folder, str(_shard(folder, 2)), "missing")


def test_a_malformed_index(tmp_path):
    folder, _ = _folder(tmp_path)
    (folder / "model.safetensors.index.json").write_text('{"weight_map": {')
    _import_fails(tmp_path, folder, "model.safetensors.index.json", "not readable JSON")


def test_an_index_pointing_outside_the_folder(tmp_path):
    """A weight_map entry like ../x.safetensors is refused, not followed."""
    folder, weight_map = _folder(tmp_path)
    _write_index(folder, weight_map | {"out.bias": "../elsewhere.safetensors"})
    _import_fails(tmp_path, folder, "'../elsewhere.safetensors'", "outside")


def test_a_truncated_shard(tmp_path):
    """Offsets past the end of the file (a truncated copy)."""
    folder, _ = _folder(tmp_path)
    path = _shard(folder, 1)
    path.write_bytes(path.read_bytes()[:-20])
    _import_fails(tmp_path, folder, str(path), "'inp.", "truncated")


@pytest.mark.parametrize(
    ("edit", "patterns"),
    [
        (lambda h: h["inp.weight"].update(data_offsets=[0, 96]), ["overlapping", "'inp.weight'"]),
        (lambda h: h["inp.bias"].update(data_offsets=[-24, 0]), ["'inp.bias'", ">= 0"]),
        (lambda h: h["inp.bias"].update(shape=[5]), ["'inp.bias'", "needs 20"]),
        (lambda h: h["inp.bias"].update(dtype="F7"), ["'inp.bias'", "'F7'", "does not know"]),
        (lambda h: h.update({"inp.bias": [1]}), ["'inp.bias'", "no dtype"]),
    ],
    ids=["overlapping", "negative", "mis-sized", "unknown-dtype", "no-entry"],
)
def test_a_bad_header_entry(tmp_path, edit, patterns):
    """Byte ranges that overlap, are negative or do not fit shape * itemsize, and dtypes
    safetensors does not know, are named before safetensors reads the file."""
    folder, _ = _folder(tmp_path)
    _rewrite_header(_shard(folder, 1), edit)
    _import_fails(tmp_path, folder, str(_shard(folder, 1)), *patterns)


def test_the_command_exits_1_and_writes_nothing(tmp_path):
    folder, _ = _folder(tmp_path)
    _shard(folder, 2).unlink()
    result = run_cli(
        "import", folder, tmp_path / "imported", "--model", "cli.factories:model_only",
        "--step", "1",
    )  # fmt: skip
    assert result.exit_code == 1 and str(_shard(folder, 2)) in result.stderr
    assert not (tmp_path / "imported").exists()
