"""`inspect` and `verify` on swapped step folders and on a lost manifest (issue 10.6)."""

from __future__ import annotations

import os
import shutil

import pytest

from .conftest import run_cli, run_json


@pytest.fixture
def run(single_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(single_run, copy)
    return copy


def _swap(run):
    a, b = run / "step_00000002", run / "step_00000004"
    os.rename(a, run / "tmp")
    os.rename(b, a)
    os.rename(run / "tmp", b)


def test_verify_fails_on_swapped_step_folders(run):
    """step_00000004 holds step 2's checkpoint and vice versa: verify fails (exit 1)
    naming the folder and both steps, where it used to say OK."""
    _swap(run)
    info = run_json("verify", run, code=1)
    (report,) = info["checkpoints"]
    assert report["step"] == 4
    (failure,) = report["failures"]
    assert failure["where"] == "manifest.json"
    assert "step_00000004" in failure["message"]
    assert "step 4" in failure["message"] and "step 2" in failure["message"]
    assert run_cli("verify", run, "--all").exit_code == 1
    listing = run_json("inspect", run, code=1)
    assert [bool(c["error"]) for c in listing["checkpoints"]] == [True, True]


def test_verify_reports_a_step_folder_that_lost_its_manifest(run):
    """step_00000002/manifest.json deleted: `verify DIR` (latest is 4, sound) also reports
    step 2 as damaged and exits 1; `verify --all` too; step 4 alone still verifies."""
    (run / "step_00000002" / "manifest.json").unlink()
    info = run_json("verify", run, code=1)
    reports = {r["step"]: r for r in info["checkpoints"]}
    assert sorted(reports) == [2, 4]
    assert reports[4]["failures"] == []
    (failure,) = reports[2]["failures"]
    assert failure["where"] == "manifest.json" and "damaged" in failure["message"]
    human = run_cli("verify", run)
    assert human.exit_code == 1 and "FAILED step 2" in human.stdout and "OK step 4" in human.stdout
    assert run_json("verify", run, "--all", code=1)["ok"] is False
    assert run_cli("verify", run, "--step", 4).exit_code == 0
    named = run_cli("verify", run, "--step", 2)
    assert named.exit_code == 1 and "damaged" in named.stderr


def test_inspect_lists_a_step_folder_that_lost_its_manifest(run):
    """The listing shows the manifest-less step folder as DAMAGED instead of leaving it
    out (exit 0: only a committed checkpoint's unreadable manifest fails inspect)."""
    (run / "step_00000002" / "manifest.json").unlink()
    listing = run_json("inspect", run)
    rows = {c["step"]: c for c in listing["checkpoints"]}
    assert sorted(rows) == [2, 4]
    assert rows[4]["error"] is None and rows[4]["committed"] is True
    assert rows[2]["committed"] is False and "damaged" in rows[2]["error"]
    human = run_cli("inspect", run)
    assert human.exit_code == 0 and "DAMAGED" in human.stdout
