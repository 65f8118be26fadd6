"""Files the process may not read (permissions) are damage like any other: a
``CorruptCheckpointError`` naming the file, and ``restore()`` falls back to an older step.

Root reads everything (``CAP_DAC_OVERRIDE``), so as root the checks run in a child that
lost root's override: ``CAP_DAC_OVERRIDE`` and ``CAP_DAC_READ_SEARCH`` are dropped from
its capability bounding set before it starts (``prctl(PR_CAPBSET_DROP)``), and files of
mode 000 are then unreadable to it as to any user. (``nobody`` cannot be used here: the
interpreter lives in a folder only root may enter.) Not root: the child runs as is.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import Problem

PR_CAPBSET_DROP, CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 24, 1, 2

CHILD = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {tests!r})
    import unbroken as ub
    from conftest import Problem, assert_same_training_state
    from unbroken.tools.verification import verify_folder as audit

    cases, out = {cases!r}, {{}}
    try:
        open(cases["shard"][1]).close()
        print(json.dumps({{"skip": "this child can still read a file of mode 000"}}))
        sys.exit(0)
    except PermissionError:
        pass
    for case, (folder, _) in cases.items():
        got = out[case] = {{}}
        q = Problem(seed=9)
        report = q.checkpointer(folder, keep_last=None).restore()
        step1 = Problem()
        step1.step()
        assert_same_training_state(q, step1)  # step 1, loaded exactly
        got["step"], got["warnings"] = report.step, report.warnings
        try:
            Problem(seed=9).checkpointer(folder, keep_last=None).restore(step=2)
            got["error"] = None
        except Exception as exc:
            got["error"] = f"{{type(exc).__name__}}: {{exc}}"
        verdict = audit(folder + "/step_00000002")
        got["audit"] = [f.message for f in verdict.failures]
    print(json.dumps(out))
    """
)


def _drop_root_override() -> None:  # runs in the child, before exec
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


def test_unreadable_files_are_damage_named_and_restore_falls_back(tmp_path):
    """Case: step 2's shard file, its manifest, or its whole folder cannot be read
    (permissions, as a process without root's override): restore() falls back to step 1
    (loaded exactly) with a warning naming the file, restore(step=2) raises
    CorruptCheckpointError naming it, and the audit (`unbroken verify`) reports it."""
    cases = {}
    for case, target in (("shard", "rank_00000.bin"), ("manifest", "manifest.json"),
                         ("folder", "")):  # fmt: skip
        folder = tmp_path / case
        p = Problem()
        ckpt = p.checkpointer(folder, keep_last=None)
        p.step()
        ckpt.save(1)
        p.step()
        ckpt.save(2)
        ckpt.close()
        unreadable = folder / "step_00000002" / target
        cases[case] = (str(folder), str(unreadable).rstrip("/"))
    as_root = os.geteuid() == 0
    code = CHILD.format(tests=str(Path(__file__).parents[1]), cases=cases)
    try:
        for _, path in cases.values():
            os.chmod(path, 0)
        child = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            preexec_fn=_drop_root_override if as_root else None,
        )
    finally:
        for _, path in cases.values():
            os.chmod(path, 0o755 if os.path.isdir(path) else 0o644)
    assert child.returncode == 0, child.stderr[-4000:]
    found = json.loads(child.stdout.strip().splitlines()[-1])
    if "skip" in found:
        pytest.skip(found["skip"])
    for case, (_, path) in cases.items():
        got = found[case]
        assert got["step"] == 1, (case, got)
        assert any("skipped the damaged checkpoint of step 2" in w and path in w
                   for w in got["warnings"]), (case, got)  # fmt: skip
        assert got["error"].startswith("CorruptCheckpointError") and path in got["error"], got
        assert got["audit"] and any(path in m for m in got["audit"]), (case, got)
