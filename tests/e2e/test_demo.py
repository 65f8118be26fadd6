"""``make demo`` in a short form: the correct example passes, the buggy one is caught."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
DEMO = Path(__file__).parents[2] / "examples" / "demo.py"


def test_demo_short(tmp_path):
    out = tmp_path / "demo"
    done = subprocess.run(
        [sys.executable, str(DEMO), "--steps", "28", "--stop-at", "20", "--out", str(out),
         "--parallel"],
        capture_output=True, text=True, timeout=400, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "IDENTICAL" in done.stdout and "optimizer reset: caught" in done.stdout, done.stdout
    assert "lost optimizer state suspected" in done.stdout, done.stdout
    for run in ("correct", "buggy"):
        assert (out / run / "resume-test.png").stat().st_size > 10_000
