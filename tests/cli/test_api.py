"""The offline tools from Python: `ub.inspect_checkpoint`, `verify_checkpoint`,
`diff_checkpoints`, `export_checkpoint`, `import_checkpoint`.

Each returns a documented dataclass whose `to_dict()` is exactly what the matching
command prints with `--json`; errors are the library's (not a checkpoint:
`CheckpointNotFoundError`; damage: reported, or raised as the command reports it).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from safetensors.torch import load_file

import tamper
import unbroken as ub
from conftest import Problem

from . import factories
from .conftest import flip_bit, run_cli, run_json


def _progress():
    calls: list[tuple[int, int]] = []
    return calls, lambda done, total: calls.append((done, total))


def _counted_to_the_end(calls):
    """Called with done = 0 first, never backwards, ending at the total."""
    assert calls and calls[0][0] == 0
    assert all(a[0] <= b[0] for a, b in itertools.pairwise(calls))
    assert calls[-1][0] == calls[-1][1] > 0


# inspect ----------------------------------------------------------------------------------


def test_inspect_a_run_folder(single_run):
    found = ub.inspect_checkpoint(single_run)
    assert isinstance(found, ub.RunInspection)
    assert [c.step for c in found.checkpoints] == [2, 4]
    newest = found.checkpoints[-1]
    assert newest.world_size == 1 and newest.error is None and newest.committed
    assert newest.versions["torch"] == torch.__version__
    on_disk = sum(f.stat().st_size for f in (single_run / "step_00000004").iterdir())
    assert newest.size_bytes == on_disk
    assert found.branch == newest.lineage and found.branch[0]["event"] == "start"
    assert found.retired == [] and found.unreadable == []
    assert found.to_dict() == run_json("inspect", single_run)


def test_inspect_one_checkpoint(single_run):
    found = ub.inspect_checkpoint(single_run, step=4)
    assert isinstance(found, ub.CheckpointInspection)
    assert found.step == 4 and found.world_size == 1 and found.path.endswith("step_00000004")
    assert {c.name for c in found.components} == {"model", "optimizer", "scheduler", "rng"}
    tensors = {t.key: t for t in found.tensors}
    assert tensors["model/inp.weight"].shape == [8, 4] and tensors["model/inp.weight"].bytes == 128
    assert tensors["model/seen"].dtype == "int64"
    assert [p.step for p in found.optimizer.params] == [4.0] * 4
    assert found.optimizer.failures == [] and len(found.metrics) == 4
    assert found.to_dict() == run_json("inspect", single_run, "--step", 4)
    step_folder = ub.inspect_checkpoint(single_run / "step_00000002")
    assert isinstance(step_folder, ub.CheckpointInspection) and step_folder.step == 2


def test_inspect_errors_and_damage(run, tmp_path):
    with pytest.raises(ub.CheckpointNotFoundError, match="does not exist"):
        ub.inspect_checkpoint(tmp_path / "nowhere")
    with pytest.raises(ub.CheckpointNotFoundError, match="step 3 is not a committed"):
        ub.inspect_checkpoint(run, step=3)
    tamper.alter(run / "step_00000004", '"world_size": 1', '"world_size": 2')
    listing = ub.inspect_checkpoint(run)  # listed, not raised
    assert [s.step for s in listing.unreadable] == [4]
    assert "fails its checksum" in listing.unreadable[0].error
    assert listing.branch == listing.checkpoints[0].lineage  # the newest readable one
    assert listing.to_dict() == run_json("inspect", run, code=1)
    with pytest.raises(ub.CorruptCheckpointError, match="fails its checksum"):
        ub.inspect_checkpoint(run, step=4)
    assert run_cli("inspect", run, "--step", 4).exit_code == 1


# verify -----------------------------------------------------------------------------------


def test_verify_a_sound_run(single_run):
    calls, progress = _progress()
    report = ub.verify_checkpoint(single_run, all=True, progress=progress)
    assert isinstance(report, ub.VerifyReport) and report.ok
    assert [c.step for c in report.checkpoints] == [2, 4]
    for c in report.checkpoints:
        assert isinstance(c, ub.CheckpointVerification) and c.ok and c.failures == []
        assert c.tensors_checked == 19 and c.files_checked == 1
    _counted_to_the_end(calls)
    assert calls[-1][0] == sum(c.bytes_read for c in report.checkpoints)
    assert report.to_dict() == run_json("verify", single_run, "--all")
    latest = ub.verify_checkpoint(single_run)
    assert [c.step for c in latest.checkpoints] == [4]
    assert latest.to_dict() == run_json("verify", single_run)


def test_verify_reports_damage_and_refuses_what_is_not_a_checkpoint(run, tmp_path):
    flip_bit(run / "step_00000004" / "rank_00000.bin", 100)
    report = ub.verify_checkpoint(run, step=4)
    assert not report.ok and report.to_dict()["ok"] is False
    (checked,) = report.checkpoints
    (failure,) = checked.failures  # named by the tensor whose bytes fail
    assert failure.where.startswith("model/") and "rank_00000.bin" in failure.message
    assert "fail their checksum" in failure.message
    assert report.to_dict() == run_json("verify", run, "--step", 4, code=1)
    with pytest.raises(ValueError, match="step and all"):
        ub.verify_checkpoint(run, step=4, all=True)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ub.CheckpointNotFoundError, match="no committed unbroken checkpoint"):
        ub.verify_checkpoint(tmp_path / "empty")


# diff -------------------------------------------------------------------------------------


def test_diff_two_steps(single_run):
    a, b = single_run / "step_00000002", single_run / "step_00000004"
    calls, progress = _progress()
    report = ub.diff_checkpoints(a, b, progress=progress)
    assert isinstance(report, ub.DiffReport) and not report.identical
    assert report.a["step"] == 2 and report.b["step"] == 4
    status = {t.key: t.status for t in report.tensors}
    assert status["model/inp.weight"] == "values" and status["model/seen"] == "values"
    components = {c.name: c.status for c in report.components}
    assert components["model"] == components["optimizer"] == "different"
    _counted_to_the_end(calls)
    assert calls[-1][1] == len(report.tensors)
    serialized = report.to_dict()
    assert serialized["identical"] is False
    assert serialized == run_json("diff", a, b, code=1)


def test_diff_a_checkpoint_with_itself_and_errors(single_run, tmp_path):
    report = ub.diff_checkpoints(single_run, single_run / "step_00000004", full=True)
    assert report.identical and all(t.status == "equal" for t in report.tensors)
    ignored = ub.diff_checkpoints(single_run, single_run, ignore={"rng"})
    assert {c.name: c.status for c in ignored.components}["rng"] == "skipped"
    assert not any(t.component == "rng" for t in ignored.tensors)
    assert ignored.to_dict() == run_json("diff", single_run, single_run, "--ignore", "rng")
    with pytest.raises(ub.CheckpointNotFoundError):
        ub.diff_checkpoints(single_run, tmp_path / "nowhere")


# export -----------------------------------------------------------------------------------


def test_export_the_model_weights(tmp_path):
    p = Problem()
    p.step()
    ub.Checkpointer(tmp_path / "run", model=p.model, optimizer=p.opt).save(7)
    out = tmp_path / "w.safetensors"
    calls, progress = _progress()
    result = ub.export_checkpoint(tmp_path / "run", out, dtype="bf16", progress=progress)
    assert isinstance(result, ub.ExportResult)
    assert result.path == str(out) and result.step == 7 and result.tensors == 5
    assert result.metadata["step"] == "7" and result.skipped == [] and result.tied == {}
    got, want = load_file(str(out)), p.model.state_dict()
    assert got.keys() == want.keys()
    assert got["inp.weight"].dtype == torch.bfloat16
    assert torch.equal(got["inp.weight"], want["inp.weight"].to(torch.bfloat16))
    assert got["seen"].dtype == torch.int64  # integer buffers keep their dtype
    assert result.bytes == sum(t.numel() * t.element_size() for t in got.values())
    _counted_to_the_end(calls)
    assert result.to_dict() == run_json("export", tmp_path / "run", "--to", out, "--dtype", "bf16")
    half = ub.export_checkpoint(tmp_path / "run", tmp_path / "h.safetensors", dtype=torch.float16)
    assert load_file(half.path)["out.weight"].dtype == torch.float16


def test_export_errors(run, tmp_path):
    out = tmp_path / "w.safetensors"
    for dtype in ("int8", torch.int32):
        with pytest.raises(ValueError, match="dtype must be a floating-point"):
            ub.export_checkpoint(run, out, dtype=dtype)
    with pytest.raises(ub.CheckpointNotFoundError, match="step 3"):
        ub.export_checkpoint(run, out, step=3)
    flip_bit(run / "step_00000004" / "rank_00000.bin", 100)
    with pytest.raises(ub.CorruptCheckpointError, match="checksum"):
        ub.export_checkpoint(run, out)
    assert not out.exists() and run_cli("export", run, "--to", out).exit_code == 1


# import -----------------------------------------------------------------------------------


def test_import_a_torch_save_file(tmp_path):
    model, opt = factories.model_and_adamw()
    factories.train(model, opt, range(3))
    src = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 3}, src)
    live_model, live_opt = factories.model_and_adamw()
    result = ub.import_checkpoint(src, tmp_path / "run", live_model, live_opt)
    assert isinstance(result, ub.ImportResult)
    assert result.step == 3 and result.path.endswith("step_00000003")
    assert result.source_kind == "torch.save" and result.model_tensors == 5
    assert result.optimizer == "factory" and result.optimizer_params == 4
    assert not result.scheduler and result.ignored == []
    for k, v in model.state_dict().items():
        assert torch.equal(live_model.state_dict()[k], v), k
    assert ub.verify_checkpoint(tmp_path / "run").ok
    cli = run_json("import", src, tmp_path / "cli-run", "--model", "cli.factories:model_and_adamw")
    assert {**result.to_dict(), "path": None} == {**cli, "path": None}
    with pytest.raises(ValueError, match="already holds a checkpoint of step 3"):
        ub.import_checkpoint(src, tmp_path / "run", *factories.model_and_adamw())
    with pytest.raises(ub.CheckpointNotFoundError, match="does not exist"):
        ub.import_checkpoint(tmp_path / "none.pt", tmp_path / "r2", *factories.model_and_adamw())
