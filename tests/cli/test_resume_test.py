"""``unbroken resume-test`` and ``unbroken plot``, run as real commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TINY = Path(__file__).parents[1] / "e2e" / "scripts" / "tiny_train.py"


def _unbroken(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "unbroken.cli", *map(str, args)],
        capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})},
    )  # fmt: skip


def test_resume_test_passes_then_plot_shows_the_resume(tmp_path):
    work = tmp_path / "work"
    done = _unbroken("resume-test", "--stop-at", "13", "--workdir", work, "--json",
                     "--", sys.executable, TINY, "{dir}", "--steps", "25")  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["passed"] and result["compared_steps"] == 12
    assert (work / "resume-test.png").stat().st_size > 10_000
    plotted = _unbroken("plot", work / "resumed", "--out", tmp_path / "m.png")
    assert plotted.returncode == 0, plotted.stderr
    assert "1 resume(s)" in plotted.stdout and (tmp_path / "m.png").stat().st_size > 10_000


def test_resume_test_fails_on_a_lost_optimizer_naming_the_step(tmp_path):
    done = _unbroken("resume-test", "--stop-at", "13", "--workdir", tmp_path / "w",
                     "--", sys.executable, TINY, "{dir}", "--steps", "25",
                     env={"TINY_BUG": "optimizer"})  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "DIFFERENT" in done.stdout and "first difference: step 15" in done.stdout
    assert "DIFFERENT" in (tmp_path / "w" / "resume-test-report.txt").read_text()


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--stop-at", "3", "--", "python", "train.py"], "must contain {dir}"),
     (["--stop-at", "3"], "after --")],
)  # fmt: skip
def test_resume_test_usage_errors(args, message):
    done = _unbroken("resume-test", *args)
    assert done.returncode == 2 and message in done.stderr


def test_plot_without_metrics_is_a_usage_error(tmp_path):
    done = _unbroken("plot", tmp_path)
    assert done.returncode == 2 and "metrics.jsonl" in done.stderr
