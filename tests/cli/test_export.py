"""`unbroken export`: consolidated safetensors weights, streamed one tensor at a time."""

from __future__ import annotations

import weakref

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import unbroken as ub
from conftest import Problem
from unbroken.format import tensor_reader

from .conftest import run_cli, run_json


def test_export_matches_the_model(tmp_path):
    p = Problem()
    p.step()
    ub.Checkpointer(tmp_path / "run", model=p.model, optimizer=p.opt).save(7)
    out = tmp_path / "weights.safetensors"
    info = run_json("export", tmp_path / "run", "--to", out)
    assert info["tensors"] == 5 and info["step"] == 7
    got = load_file(str(out))
    want = p.model.state_dict()
    assert got.keys() == want.keys()  # FQNs, no "model/" prefix, no optimizer state
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    with safe_open(str(out), framework="pt") as f:
        meta = f.metadata()
    assert meta["step"] == "7" and meta["unbroken_version"] == ub.__version__
    assert meta["source"] == str((tmp_path / "run" / "step_00000007").resolve())
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]


def test_dtype_cast_keeps_integer_buffers(single_run, tmp_path):
    out = tmp_path / "w.safetensors"
    result = run_cli("export", single_run, "--to", out, "--dtype", "bf16", "--step", 2)
    assert result.exit_code == 0 and "step 2" in result.stdout
    got = load_file(str(out))
    assert got["inp.weight"].dtype == torch.bfloat16
    assert got["seen"].dtype == torch.int64 and int(got["seen"]) == 32


def test_fsdp_shards_are_consolidated(fsdp_run, tmp_path):
    root, full = fsdp_run
    out = tmp_path / "fsdp.safetensors"
    assert run_cli("export", root, "--to", out).exit_code == 0
    got = load_file(str(out))
    assert got.keys() == full["model"].keys()
    for k, v in full["model"].items():
        assert torch.equal(got[k], v), k


def test_one_tensor_in_memory_at_a_time(single_run, tmp_path, monkeypatch):
    alive: list[weakref.ref] = []
    original = tensor_reader.TensorReader.read

    def read(self, key):
        assert all(r() is None for r in alive), "an earlier tensor is still held"
        t = original(self, key)
        alive.append(weakref.ref(t))
        return t

    monkeypatch.setattr(tensor_reader.TensorReader, "read", read)
    assert run_cli("export", single_run, "--to", tmp_path / "w.safetensors").exit_code == 0
    assert len(alive) == 5


def test_damaged_checkpoint_writes_nothing(single_run, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(single_run, run)
    shard = run / "step_00000004" / "rank_00000.bin"
    data = bytearray(shard.read_bytes())
    data[3] ^= 0xFF  # inside the first model tensor
    shard.write_bytes(bytes(data))
    out = tmp_path / "w.safetensors"
    result = run_cli("export", run, "--to", out)
    assert result.exit_code == 1 and "rank_00000.bin" in result.stderr
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["run"]


@pytest.mark.parametrize("where", ["inside", "missing"])
def test_usage_errors(single_run, tmp_path, where):
    if where == "inside":
        result = run_cli("export", single_run, "--to", single_run / "step_00000004" / "w.st")
        assert result.exit_code == 1 and "inside the checkpoint" in result.stderr
    else:
        result = run_cli("export", tmp_path / "nope", "--to", tmp_path / "w.st")
        assert result.exit_code == 2
    assert not (single_run / "step_00000004" / "w.st").exists()
