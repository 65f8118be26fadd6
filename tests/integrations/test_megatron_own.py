"""Megatron-Core's own resume, caught: its DistributedOptimizer resumed through its
``dist_checkpointing`` (``dp_reshardable``) is reported DIFFERENT by ``resume_test``,
which names the optimizer's ``step`` (megatron-core 0.16.1, torch's AdamW: the load puts
back the step held before it, as one tensor shared by every parameter). The bug class a
resume-test exists for: a resume that runs without an error and trains on wrong state.

One resume test (three one-process launches), on the CPU through ``tests/megatron_cpu.py``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed (extra: megatron)")


from .megatron_launch import resume, script

pytestmark = pytest.mark.e2e


def test_megatrons_own_distributed_optimizer_resume_is_reported_different(tmp_path):
    result = resume(script(1, "megatron_own_resume.py", "{dir}"), tmp_path, 3)
    assert result.resumed, result.not_resumed
    assert result.verdict == "DIFFERENT", result.report_path
    assert result.first_difference_step == 5  # the first loss after an update with the wrong step
    assert result.state_differences[0].startswith("dist_optimizer/0/step: differs")
