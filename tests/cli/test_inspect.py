"""`unbroken inspect`: listing, detail, optimizer coverage, and clear usage errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tamper
import unbroken as ub

from .conftest import run_cli, run_json


def test_lists_committed_checkpoints(single_run):
    info = run_json("inspect", single_run)
    steps = [c["step"] for c in info["checkpoints"]]
    assert steps == [2, 4]
    first = info["checkpoints"][0]
    assert first["world_size"] == 1 and first["error"] is None
    assert first["versions"]["torch"] == torch.__version__
    assert first["versions"]["unbroken"] == ub.__version__
    assert first["lineage"][0]["event"] == "start"
    on_disk = sum(f.stat().st_size for f in (single_run / "step_00000002").iterdir())
    assert first["size_bytes"] == on_disk


def test_human_listing_shows_a_table(single_run):
    result = run_cli("inspect", single_run)
    assert result.exit_code == 0, result.stderr
    torch_version = __import__("torch").__version__
    assert "committed checkpoints" in result.stdout and torch_version in result.stdout


def test_detail_lists_components_tensors_and_coverage(single_run):
    info = run_json("inspect", single_run, "--step", 4)
    assert info["step"] == 4 and info["world_size"] == 1
    names = {c["name"]: c for c in info["components"]}
    assert set(names) == {"model", "optimizer", "scheduler", "rng"}
    assert names["rng"]["per_rank"] and names["model"]["tensors"] == 5
    tensors = {t["key"]: t for t in info["tensors"]}
    assert tensors["model/inp.weight"]["shape"] == [8, 4]
    assert tensors["model/inp.weight"]["bytes"] == 8 * 4 * 4
    assert tensors["model/seen"]["dtype"] == "int64"
    cov = info["optimizer"]
    assert [p["fqn"] for p in cov["params"]] == ["inp.weight", "inp.bias", "out.weight", "out.bias"]
    for p in cov["params"]:
        assert p["entries"] == ["exp_avg", "exp_avg_sq", "step"] and p["step"] == 4.0
    assert cov["failures"] == [] and cov["no_state"] == [] and cov["unoptimized"] == []


def test_human_detail(single_run):
    result = run_cli("inspect", single_run / "step_00000002")
    assert result.exit_code == 0, result.stderr
    for text in ("step 2", "components", "optimizer coverage", "model/inp.weight"):
        assert text in result.stdout


def test_flags_parameters_without_state_and_outside_groups(tmp_path):
    model = nn.ModuleDict({"used": nn.Linear(3, 3), "unused": nn.Linear(3, 3)})
    model.frozen = nn.Linear(3, 3).requires_grad_(False)
    opt = torch.optim.AdamW([*model["used"].parameters(), *model["unused"].parameters()])
    model["used"](torch.randn(2, 3)).sum().backward()
    opt.step()  # "unused" gets no gradient, so AdamW keeps no state for it
    ub.Checkpointer(tmp_path, model=model, optimizer=opt).save(1)
    info = run_json("inspect", tmp_path, "--step", 1)
    cov = info["optimizer"]
    assert sorted(cov["no_state"]) == ["unused.bias", "unused.weight"]
    assert sorted(cov["unoptimized"]) == ["frozen.bias", "frozen.weight"]
    assert cov["unoptimized_parameters"] == []  # trainable but unoptimized: none here
    human = run_cli("inspect", tmp_path, "--step", 1).stdout
    assert "no state" in human and "frozen.weight" in human


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda root: root / "nowhere", "does not exist"),
        (lambda root: root / "step_00000002" / "manifest.json", "is a file"),
        (lambda root: root / "step_00000002" / "..", None),  # fine: the run folder itself
    ],
    ids=["missing", "file", "run-folder"],
)
def test_paths(single_run, make, match):
    result = run_cli("inspect", make(single_run))
    if match is None:
        assert result.exit_code == 0
    else:
        assert result.exit_code == 2
        assert result.stderr.startswith("CheckpointNotFoundError:") and match in result.stderr
        assert result.stdout == ""


def test_not_a_checkpoint_and_unknown_step(single_run, tmp_path):
    (tmp_path / "step_00000009").mkdir()  # a save that never committed
    partial = tmp_path / ".partial-step_00000010-abc"
    partial.mkdir()
    (partial / "manifest.json").write_text("{}")  # written just before the commit rename
    for args, match in [
        ((partial,), "not a committed one"),
        ((tmp_path,), "holds no committed unbroken checkpoint"),
        ((tmp_path / "step_00000009",), "not a committed checkpoint"),
        ((single_run, "--step", 3), r"step 3 is not a committed checkpoint"),
        ((single_run / "step_00000002", "--step", 4), "not step 4"),
    ]:
        result = run_cli("inspect", *args)
        assert result.exit_code == 2, (args, result.stdout)
        assert match in result.stderr, result.stderr


def test_damaged_manifest_exits_1(tmp_path, single_run):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(single_run, run)
    tamper.alter(run / "step_00000004", '"step": 4', '"step": 5')
    result = run_cli("inspect", run, "--step", 4)
    assert result.exit_code == 1
    assert result.stderr.startswith("CorruptCheckpointError:") and "manifest.json" in result.stderr
    listing = run_json("inspect", run, code=1)
    damaged = [c for c in listing["checkpoints"] if c["error"]]
    assert [c["step"] for c in damaged] == [4] and "altered" in damaged[0]["error"]


def test_fsdp_checkpoint(fsdp_run):
    root, _ = fsdp_run
    info = run_json("inspect", root, "--step", 3)
    assert info["world_size"] == 2
    tensors = {t["key"]: t for t in info["tensors"]}
    assert tensors["model/blocks.0.fc.weight"]["shape"] == [13, 13]
    assert tensors["model/blocks.0.fc.weight"]["chunks"] == 2  # one shard per rank
    assert {c["name"] for c in info["components"]} == {"model", "optimizer", "rng"}
    assert len(info["optimizer"]["params"]) == len([k for k in tensors if k.startswith("model/")])
    assert all(p["step"] == 3.0 for p in info["optimizer"]["params"])


def test_shows_the_branch_and_the_retired_checkpoints(tmp_path):
    """After a rollback (save 4, 5, 6; restore 4; save 5'), the listing shows the newest
    lineage as a branch (resumed from 4, retired 5 and 6, the replay verdict) and lists the
    retired checkpoints kept aside, in both the table and --json."""
    from conftest import Problem

    p = Problem()
    ckpt = p.checkpointer(tmp_path, keep_last=None)
    for step in range(1, 7):
        ckpt.track(step, loss=p.step())
        if step >= 4:
            ckpt.save(step)
    ckpt.close()
    q = Problem(seed=1)
    ckpt = q.checkpointer(tmp_path, keep_last=None)
    ckpt.restore(step=4)
    for step in (5, 6):
        ckpt.track(step, loss=q.step())
    ckpt.save(6)
    ckpt.close()

    info = run_json("inspect", tmp_path)
    assert [c["step"] for c in info["checkpoints"]] == [4, 6]
    assert [(r["step"], r["path"].split("/")[-1][:22]) for r in info["retired"]] == [
        (5, ".retired-step_00000005"),
        (6, ".retired-step_00000006"),
    ]
    resume = info["branch"][-1]
    assert (resume["from_step"], resume["retired"]) == (4, [5, 6])
    assert resume["replay"]["status"] == "identical"
    human = run_cli("inspect", tmp_path)
    assert human.exit_code == 0, human.stderr
    out = " ".join(human.stdout.split())
    assert "resume from 4" in out and "retired 5, 6" in out and "replay identical" in out
    assert "retired checkpoints" in out and ".retired-step_00000006" in out
