"""``unbroken import`` of a DeepSpeed checkpoint folder (``engine.save_checkpoint``).

Two torchrun launches of ``scripts/deepspeed_train.py`` (2 ranks, bf16, ZeRO-2 and ZeRO-3)
each write DeepSpeed's own checkpoint (``--own``), unbroken's (``checkpointer_for``) and
DeepSpeed's own gathered view (``--dump``) at step 4. The import of DeepSpeed's folder must
equal unbroken's checkpoint of the same step, tensor for tensor, bit for bit.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import unbroken as ub
from processes import torchrun
from unbroken.errors import IncompleteCheckpointError, StateMismatchError
from unbroken.tools import deepspeed_folders

pytest.importorskip("deepspeed")
pytest.importorskip("torchdata")
pytestmark = [pytest.mark.distributed, pytest.mark.e2e]
SCRIPTS = Path(__file__).parent / "scripts"
SCRIPT = SCRIPTS / "deepspeed_train.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
STAGES = (2, 3)
CLIENT = ("step", "loader", "rng")  # the script's client_state: no place in ours


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, Path]:
    """Per ZeRO stage, the folder holding ``ds/`` (DeepSpeed's), ``ub/`` (unbroken's) and
    ``dump.4`` (DeepSpeed's gathered view), all of step 4."""
    out = {}
    for stage in STAGES:
        work = tmp_path_factory.mktemp(f"zero{stage}")
        args = ["--stage", str(stage), "--opt", "torch", "--bf16", "--steps", "4", "--every", "4"]
        args += ["--own", work / "ds", "--dump", work / "dump"]
        done = subprocess.run(
            torchrun(2, SCRIPT, work / "ub", *args),
            env=ENV,
            capture_output=True,
            text=True,
            timeout=400,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        out[stage] = work
    return out


@pytest.mark.parametrize("stage", STAGES)
def test_import_equals_unbroken_checkpoint_of_the_same_step(runs, stage, tmp_path, monkeypatch):
    from cli.conftest import run_json

    work = runs[stage]
    monkeypatch.syspath_prepend(str(SCRIPTS))
    source = work / "ds" if stage == 2 else work / "ds" / "global_step4"
    args = ["--model", "deepspeed_train:Net", *(f"--ignore={k}" for k in CLIENT)]
    result = run_json("import", source, tmp_path / "imported", *args)
    assert (result["source_kind"], result["step"], result["model_tensors"]) == ("deepspeed", 4, 8)
    assert result["ignored"] == sorted(CLIENT)
    report = ub.diff_checkpoints(
        tmp_path / "imported", work / "ub", full=True, ignore={"rng", "dataloader"}
    )
    status = {c.name: (c.status, c.equal) for c in report.components}
    assert report.identical, status
    assert status["model"] == ("identical", 8)
    assert status["optimizer"] == ("identical", 32)  # fp32_master, exp_avg, exp_avg_sq, step
    assert status["deepspeed"][0] == "identical"


@pytest.mark.parametrize("stage", STAGES)
def test_reader_matches_deepspeeds_own_views(runs, stage):
    """Every tensor read equals DeepSpeed's live gathered view at the save and, for the
    fp32 masters, its offline ``zero_to_fp32``."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    work = runs[stage]
    read = deepspeed_folders.read(work / "ds", ignore=CLIENT)
    dump = torch.load(work / "dump.4", weights_only=True)
    for key, value in dump.items():
        kind, name = key.split("/", 1)
        got = read.model[name] if kind == "model" else read.state[name][kind]
        assert got.dtype == value.dtype and torch.equal(got, value), key
    offline = get_fp32_state_dict_from_zero_checkpoint(str(work / "ds"))
    assert offline.keys() == read.state.keys()
    for name, value in offline.items():
        assert torch.equal(read.state[name][deepspeed_folders.MASTER], value), name


def test_an_import_restores_onto_another_stage_and_world_size(runs, tmp_path):
    """ZeRO-2 on 2 ranks, imported, restored by ``checkpointer_for`` on a ZeRO-3 engine
    of one process: DeepSpeed's own view of the restored engine is the source's, and the
    engine saves again what unbroken saved in the source run."""
    work = runs[2]
    ub.import_checkpoint(work / "ds", tmp_path / "imported", _net(), ignore=CLIENT)
    command = [sys.executable, SCRIPTS / "deepspeed_restore.py", tmp_path / "imported"]
    command += [tmp_path / "resaved", "--stage", "3", "--dump", work / "dump.4"]
    command += ["--out", tmp_path / "out.json"]
    done = subprocess.run(
        list(map(str, command)), env=ENV, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["mismatches"] == [] and out["step"] == 4
    assert out["counters"] == {"global_steps": 4, "global_samples": 32, "micro_steps": 4}
    report = ub.diff_checkpoints(
        tmp_path / "resaved", work / "ub", full=True, ignore={"rng", "dataloader"}
    )
    assert report.identical, [(c.name, c.status) for c in report.components]


def _net():
    sys.path.insert(0, str(SCRIPTS))
    try:
        from deepspeed_train import Net
    finally:
        sys.path.remove(str(SCRIPTS))
    return Net()


def test_client_state_is_left_out_only_by_name(runs, tmp_path):
    with pytest.raises(StateMismatchError, match=r"client_state.*: loader, step; pass --ignore"):
        ub.import_checkpoint(runs[3] / "ds", tmp_path / "imported", _net(), ignore={"rng"})
    assert not (tmp_path / "imported").exists()


def test_a_missing_rank_file_is_named(runs, tmp_path):
    folder = tmp_path / "global_step4"
    shutil.copytree(runs[2] / "ds" / "global_step4", folder)
    (folder / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(IncompleteCheckpointError, match="bf16_zero_pp_rank_1_mp_rank_00_optim"):
        deepspeed_folders.read(folder, ignore=CLIENT)


def test_muon_is_refused_by_name(runs, tmp_path):
    folder = tmp_path / "global_step4"
    shutil.copytree(runs[2] / "ds" / "global_step4", folder)
    states = folder / "mp_rank_00_model_states.pt"
    meta = torch.load(states, weights_only=True)
    meta["ds_config"]["optimizer"] = {"type": "Muon", "params": {"lr": 0.02}}
    torch.save(meta, states)
    with pytest.raises(StateMismatchError, match="Muon"):
        deepspeed_folders.read(folder, ignore=CLIENT)
