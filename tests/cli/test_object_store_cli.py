"""The commands on checkpoints in object stores: a URL is never mangled into a local path.

In-process on ``memory://`` (fast), and once as the real ``unbroken`` command on an
``s3://`` URL served by moto on loopback (the bug this fixes: ``s3://bucket/run1`` was
reported as "s3:/bucket/run1 does not exist").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from safetensors.torch import load_file

from cli.conftest import run_cli, run_json
from conftest import Problem, save_steps

TINY = Path(__file__).parents[1] / "e2e" / "scripts" / "tiny_train.py"


@pytest.fixture(scope="module")
def mem_run() -> str:
    url = f"memory://unbroken-cli/{uuid.uuid4().hex[:8]}/run"
    save_steps(url)
    return url


def test_inspect_lists_and_details_a_url(mem_run):
    """Guarantee: inspect lists a store's committed steps and shows one of them."""
    listed = run_json("inspect", mem_run)
    assert [c["step"] for c in listed["checkpoints"]] == [1, 2]
    assert all(c["size_bytes"] > 0 for c in listed["checkpoints"])
    detail = run_json("inspect", mem_run, "--step", 1)
    assert detail["step"] == 1 and detail["path"].endswith("step_00000001")


def test_verify_reads_every_byte_of_a_url(mem_run):
    """Guarantee: verify checks every chunk of a checkpoint on a store."""
    out = run_json("verify", mem_run, "--all")
    assert out["ok"] and len(out["checkpoints"]) == 2
    assert all(c["tensors_checked"] > 0 for c in out["checkpoints"])


def test_diff_and_export_take_urls(mem_run, tmp_path):
    """Guarantee: diff compares two steps on a store; export writes their weights."""
    diff = run_cli("diff", f"{mem_run}/step_00000001", f"{mem_run}/step_00000002")
    assert diff.exit_code == 1, diff.stdout + diff.stderr  # trained a step: they differ
    target = tmp_path / "w.safetensors"
    assert run_cli("export", mem_run, "--to", target).exit_code == 0
    assert "out.weight" in load_file(target)


@pytest.fixture(scope="module")
def s3(s3_server):
    """The module's S3 server (moto on loopback) with a bucket ``cli``."""
    s3_server.bucket("cli")
    return s3_server


def test_missing_url_is_named_as_given(mem_run):
    """Guarantee: a URL that holds nothing is named as a URL, exit code 2."""
    result = run_cli("inspect", mem_run + "-nothing")
    assert result.exit_code == 2
    assert "memory:///unbroken-cli/" in result.stderr and "does not exist" in result.stderr


def test_real_command_on_s3(s3):
    """Guarantee: the installed command on an s3:// URL (moto on loopback) lists and
    verifies the checkpoint, and names a missing prefix as the URL it is."""
    with s3.environment() as env:
        p = Problem()
        p.step()
        p.checkpointer("s3://cli/run1").save(1)
    cmd = [sys.executable, "-m", "unbroken.cli"]
    full = {**os.environ, **env}
    listed = subprocess.run(
        [*cmd, "inspect", "s3://cli/run1", "--json"], env=full, capture_output=True, text=True
    )
    assert listed.returncode == 0, listed.stderr
    assert [c["step"] for c in json.loads(listed.stdout)["checkpoints"]] == [1]
    ok = subprocess.run([*cmd, "verify", "s3://cli/run1"], env=full, capture_output=True)
    assert ok.returncode == 0, ok.stderr
    gone = subprocess.run(
        [*cmd, "inspect", "s3://cli/nope"], env=full, capture_output=True, text=True
    )
    assert gone.returncode == 2 and "s3://cli/nope does not exist" in gone.stderr


def test_resume_test_and_plot_on_s3(tmp_path, s3):
    """Guarantee: ``resume-test --store`` runs the training with its checkpoints and
    metrics record on S3 (moto on loopback) and proves the resume identical over the
    steps recorded there; ``plot`` draws a run straight from its URL."""
    with s3.environment() as env:
        full = {**os.environ, **env}
        work = tmp_path / "work"
        cmd = [sys.executable, "-m", "unbroken.cli", "resume-test", "--stop-at", "13"]
        cmd += ["--workdir", str(work), "--json", "--store", "s3://cli/rt", "--parallel"]
        cmd += ["--", sys.executable, str(TINY), "{dir}", "--steps", "25"]
        done = subprocess.run(cmd, env=full, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        result = json.loads(done.stdout)
        assert result["passed"] and result["compared_steps"] == 12
        assert result["resumed_dir"] == "s3://cli/rt/resumed"
        assert not (work / "resumed").exists()  # the checkpoints went to the store
        png = tmp_path / "m.png"  # the rest in-process: no interpreter start-ups
        plotted = run_cli("plot", "s3://cli/rt/resumed", "--out", png)
        assert plotted.exit_code == 0, plotted.stdout + plotted.stderr
        assert "1 resume(s)" in plotted.stdout and png.stat().st_size > 10_000
        store = ["--workdir", tmp_path / "w2", "--store", "s3://cli/rt"]
        again = run_cli(
            "resume-test", "--stop-at", "13", *store, "--", sys.executable, TINY, "{dir}"
        )
        assert again.exit_code == 2 and "is not empty" in again.stderr
        nothing = run_cli("plot", "s3://cli/none")
        assert nothing.exit_code == 2 and "s3://cli/none/metrics/" in nothing.stderr
