"""The real console command, and the promise that read commands never write."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from . import factories
from .conftest import REPO, run_cli, tree_digest


def _console(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "unbroken.cli", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
    )


def test_console_verify_json_and_errors(single_run, tmp_path):
    ok = _console("verify", single_run, "--all", "--json")
    assert ok.returncode == 0, ok.stderr
    assert [r["step"] for r in json.loads(ok.stdout)["checkpoints"]] == [2, 4]
    script = Path(sys.executable).parent / "unbroken"  # the installed console script
    missing = subprocess.run([str(script), "inspect", str(tmp_path / "none")],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert missing.returncode == 2 and missing.stdout == ""
    assert (
        missing.stderr.startswith("CheckpointNotFoundError:") and "does not exist" in missing.stderr
    )


def test_console_import_with_a_local_factory_module(tmp_path):
    model, opt = factories.model_and_adamw()
    factories.train(model, opt, range(2))
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 2},
               tmp_path / "c.pt")  # fmt: skip
    result = _console("import", tmp_path / "c.pt", tmp_path / "run", "--model",
                      "cli.factories:model_and_adamw", cwd=REPO / "tests")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "as step 2" in result.stdout and "pickles" not in result.stdout
    assert run_cli("verify", tmp_path / "run").exit_code == 0
    help_text = run_cli("import", "--help").stdout
    assert "pickle" in help_text and "trust" in help_text


def test_read_commands_never_write(single_run, fsdp_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(single_run, run)
    (run / ".partial-step_00000006-abc").mkdir()  # a restore would clean these up
    (run / ".partial-step_00000006-abc" / "rank_00000.bin").write_bytes(b"half")
    (run / "step_00000008").mkdir()  # uncommitted
    damaged = run / "step_00000002" / "rank_00000.bin"
    damaged.write_bytes(damaged.read_bytes()[:-3])
    before = {p: tree_digest(p) for p in (run, fsdp_run[0])}
    commands = [
        ("inspect", run), ("inspect", run, "--step", 4), ("inspect", run, "--json"),
        ("inspect", run, "--step", 2, "--json"), ("verify", run, "--all"),
        ("verify", run, "--all", "--json"), ("verify", fsdp_run[0]),
        ("diff", run, fsdp_run[0]), ("diff", run / "step_00000002", run, "--json", "--full"),
        ("inspect", fsdp_run[0], "--step", 3), ("export", run, "--to", tmp_path / "w.st"),
    ]  # fmt: skip
    codes = [run_cli(*c).exit_code for c in commands]
    assert codes == [0, 0, 0, 0, 1, 1, 0, 1, 1, 0, 0]
    after = {p: tree_digest(p) for p in (run, fsdp_run[0])}
    assert after == before
