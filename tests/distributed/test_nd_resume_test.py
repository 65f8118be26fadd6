"""``unbroken resume-test`` under torchrun for the layouts beyond one dimension (issue 28):
FSDP2 + tensor parallel and FSDP2 HSDP on (2, 2), and four
pipeline stages, stopped and resumed in the same layout: every tracked loss after the
stop and the final state's fingerprints identical (DESIGN.md F1-F5 seen from the
outside, on a learnable task)."""

from __future__ import annotations

from pathlib import Path

import pytest

from processes import torchrun

pytestmark = pytest.mark.distributed
SCRIPT = Path(__file__).parent / "scripts" / "nd_train.py"


# Expert parallel is resumed bit for bit in test_expert_parallel.py (kept out here for CI time).
@pytest.mark.parametrize("layout", ["tp", "hsdp", "pp"])
def test_resume_test_is_identical_under_torchrun(tmp_path, layout):
    from unbroken.testing import resume_test

    command = torchrun(4, SCRIPT, "{dir}", "--layout", layout, "--steps", "4")
    result = resume_test(command, stop_at=2, workdir=tmp_path, plot=False, timeout=240)
    assert result.exact, str(result)
    assert result.compared_steps == 2
