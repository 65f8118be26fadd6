"""`unbroken export --to` never writes inside the run folder: not into the step exported,
nor into another step folder of the run, nor into the run folder itself, links resolved."""

from __future__ import annotations

import pytest

import unbroken as ub
from cli.conftest import run_cli, tree_digest


@pytest.mark.parametrize("source", ["run folder", "step folder"])
@pytest.mark.parametrize("inside", ["another step", "the run folder", "a new subfolder"])
def test_a_target_inside_the_run_folder_is_refused(run, source, inside):
    src = run if source == "run folder" else run / "step_00000004"
    to = {
        "another step": run / "step_00000002" / "w.safetensors",
        "the run folder": run / "w.safetensors",
        "a new subfolder": run / "exports" / "w.safetensors",
    }[inside]
    before = tree_digest(run)
    result = run_cli("export", src, "--to", to)
    assert result.exit_code == 1, result.stdout + result.stderr
    assert f"refusing to write {to}" in result.stderr
    assert f"inside the checkpoint run folder {run.resolve()}" in result.stderr
    assert f"e.g. to {run.resolve().parent / 'w.safetensors'}" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert tree_digest(run) == before  # nothing written, no folder made


def test_a_link_into_the_run_folder_is_refused(run, tmp_path):
    link = tmp_path / "out"
    link.symlink_to(run / "step_00000002", target_is_directory=True)
    before = tree_digest(run)
    with pytest.raises(ub.CheckpointError, match="inside the checkpoint run folder"):
        ub.export_checkpoint(run, link / "w.safetensors", step=4)
    assert tree_digest(run) == before


def test_a_target_beside_the_run_folder_is_written(run):
    to = run.parent / "w.safetensors"
    result = run_cli("export", run / "step_00000002", "--to", to)
    assert result.exit_code == 0, result.stdout + result.stderr
    assert to.is_file()


def test_a_lone_step_folder_protects_itself_only(run, tmp_path):
    lone = tmp_path / "copies" / "ckpt4"  # not named step_*: in no run folder
    lone.parent.mkdir()
    (run / "step_00000004").rename(lone)
    assert run_cli("export", lone, "--to", lone / "w.safetensors").exit_code == 1
    result = run_cli("export", lone, "--to", lone.parent / "w.safetensors")
    assert result.exit_code == 0, result.stdout + result.stderr
