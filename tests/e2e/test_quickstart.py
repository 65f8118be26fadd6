"""The README quickstart, copied verbatim around a small model with dropout, a schedule, a
GradScaler and a shuffled StatefulDataLoader, passes `unbroken resume-test` (issue 11):
stopped mid-epoch, resumed across epoch ends, bit for bit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
SCRIPT = Path(__file__).parent / "scripts" / "quickstart.py"


def test_readme_quickstart_resumes_exactly(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "unbroken.cli", "resume-test", "--stop-at", "15",
         "--workdir", str(tmp_path), "--parallel", "--", sys.executable, str(SCRIPT), "{dir}",
         "40"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "IDENTICAL" in result.stdout and "compared 25 steps" in result.stdout
