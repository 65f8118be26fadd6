"""`unbroken verify`: exit 0 only when every byte, fingerprint and entry checks out."""

from __future__ import annotations

import json
import shutil

import pytest

import tamper

from .conftest import flip_bit, run_cli, run_json


def test_sound_checkpoint(single_run):
    info = run_json("verify", single_run)
    assert info["ok"] is True
    (report,) = info["checkpoints"]
    assert report["step"] == 4 and report["failures"] == []
    assert report["tensors_checked"] == 19
    assert report["bytes_read"] == (single_run / "step_00000004" / "rank_00000.bin").stat().st_size
    result = run_cli("verify", single_run, "--step", 2)
    assert result.exit_code == 0 and "OK step 2" in result.stdout


def test_all_steps(single_run):
    info = run_json("verify", single_run, "--all")
    assert [r["step"] for r in info["checkpoints"]] == [2, 4]


@pytest.mark.parametrize(
    ("damage", "where", "match"),
    [
        (
            lambda d: (d / "rank_00000.bin").write_bytes((d / "rank_00000.bin").read_bytes()[:-9]),
            "rank_00000.bin",
            "truncated",
        ),
        (lambda d: flip_bit(d / "rank_00000.bin", 100), "rank_00000.bin", "fail their checksum"),
        (lambda d: (d / "rank_00000.bin").unlink(), "rank_00000.bin", "is missing"),
        (lambda d: (d / "stray.bin").write_bytes(b"x"), "stray.bin", "not listed"),
        (
            lambda d: tamper.alter(d, '"world_size": 1', '"world_size": 2'),
            "manifest.json",
            "altered",
        ),
    ],
    ids=["truncated", "bit-flip", "missing", "extra-file", "manifest-altered"],
)
def test_damage_fails_naming_the_file(run, damage, where, match):
    damage(run / "step_00000004")
    result = run_cli("verify", run, "--json")
    assert result.exit_code == 1
    info = json.loads(result.stdout)
    failures = info["checkpoints"][0]["failures"]
    assert any(f["where"] == where or where in f["message"] for f in failures), failures
    assert any(match in f["message"] for f in failures), failures
    human = run_cli("verify", run)
    assert human.exit_code == 1 and "FAILED" in human.stdout and where in human.stdout
    assert run_cli("verify", run, "--step", 2).exit_code == 0  # the older one is sound
    assert run_cli("verify", run, "--all").exit_code == 1


def _rewrite(folder, edit):
    tamper.edit(folder, edit)  # a consistent manifest checksum over the edited content


def test_fingerprint_mismatch_is_found(run):
    folder = run / "step_00000004"
    _rewrite(folder, lambda d: d["tensors"]["model/out.bias"].update(fingerprint="0" * 16))
    info = run_json("verify", run, code=1)
    failures = info["checkpoints"][0]["failures"]
    assert [f["where"] for f in failures] == ["model/out.bias"]
    assert "fingerprint" in failures[0]["message"]


def test_orphaned_optimizer_state_is_found(run):
    def rename(doc):
        state = doc["components"]["optimizer"]["state"]["state"]
        state["renamed.bias"] = state.pop("out.bias")

    _rewrite(run / "step_00000004", rename)
    info = run_json("verify", run, code=1)
    messages = [f["message"] for f in info["checkpoints"][0]["failures"]]
    assert any("'renamed.bias' belongs to no param group" in m for m in messages), messages


def test_unreferenced_tensor_is_found(run):
    def drop(doc):
        del doc["components"]["model"]["state"]["out.bias"]

    _rewrite(run / "step_00000004", drop)
    info = run_json("verify", run, code=1)
    wheres = [f["where"] for f in info["checkpoints"][0]["failures"]]
    assert "model/out.bias" in wheres


def test_fsdp_checkpoint_and_a_flipped_bit_on_rank_1(fsdp_run, tmp_path):
    root, _ = fsdp_run
    info = run_json("verify", root)
    assert info["ok"] and info["checkpoints"][0]["files_checked"] == 2
    copy = tmp_path / "run"
    shutil.copytree(root, copy)
    flip_bit(copy / "step_00000003" / "rank_00001.bin", 50)
    result = run_cli("verify", copy)
    assert result.exit_code == 1 and "rank_00001.bin" in result.stdout


def test_usage_errors(single_run, tmp_path):
    both = run_cli("verify", single_run, "--step", 2, "--all")
    assert both.exit_code == 2 and "exclude each other" in both.stderr
    assert run_cli("verify", single_run, "--step", 3).exit_code == 2
    assert run_cli("verify", tmp_path).exit_code == 2
    assert run_cli("verify", tmp_path / "absent").exit_code == 2
