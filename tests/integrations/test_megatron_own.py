"""Megatron-Core's own resume, caught: its DistributedOptimizer resumed through its
``dist_checkpointing`` (``dp_reshardable``) is reported DIFFERENT by ``resume_test``,
which names the optimizer's ``step`` (megatron-core 0.16.1, torch's AdamW: the load puts
back the step held before it, as one tensor shared by every parameter). The bug class a
resume-test exists for: a resume that runs without an error and trains on wrong state.

One resume test (three one-process launches), on the CPU through ``tests/megatron_cpu.py``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed (extra: megatron)")

from unbroken.testing import resume_test

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).parent / "scripts" / "megatron_own_resume.py"
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "PYTHONWARNINGS": "ignore",
    "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
}


def test_megatrons_own_distributed_optimizer_resume_is_reported_different(tmp_path):
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
        str(SCRIPT), "{dir}",
    ]  # fmt: skip
    result = resume_test(command, stop_at=3, workdir=tmp_path, env=ENV, timeout=300, plot=False)
    assert result.resumed, result.not_resumed
    assert result.verdict == "DIFFERENT", result.report_path
    assert result.first_difference_step == 5  # the first loss after an update with the wrong step
    assert result.state_differences[0].startswith("dist_optimizer/0/step: differs")
