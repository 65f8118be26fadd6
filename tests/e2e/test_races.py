"""Readers and a writer side by side, for real: separate processes on one folder.

A training job saves (keep_last=2, so it prunes all the time, and re-saves a step now
and then) while other processes restore and run `unbroken verify` / `inspect`. The
verdict must not depend on timing: zero false failures, however the runs interleave.
The suite runs it for a few seconds; `make reliability` runs it for a minute
(``UNBROKEN_RACE_SECONDS``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
SCRIPT = Path(__file__).parent / "scripts" / "race_roles.py"
SECONDS = float(os.environ.get("UNBROKEN_RACE_SECONDS", "6"))


def _start(role: str, folder: Path, *args: object) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(SCRIPT), role, str(folder), *map(str, args)]
    log = open(folder.parent / f"{role}.log", "w")  # noqa: SIM115 - the child's stderr
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    log.close()
    return proc


def _summary(proc: subprocess.Popen, log: Path) -> dict:
    out, _ = proc.communicate(timeout=SECONDS + 900)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}: {log.read_text()[-4000:]}"
    return json.loads(lines[-1])


def test_readers_never_fail_saves_nor_report_pruned_steps_as_damage(tmp_path):
    """Case: restore() and verify/inspect in other processes while a job saves, prunes
    and re-saves: no save fails ('another save is in progress'), no reader reports a
    missing file, a traceback or 'no committed checkpoint is sound', and every restore
    loads exactly the state of the step it names."""
    folder = tmp_path / "ckpts"
    roles = ("restorer", "verifier")
    writer = _start("writer", folder, SECONDS, len(roles))
    procs = [writer]
    try:
        first = writer.stdout.readline()
        assert first.startswith("saved 1"), (tmp_path / "writer.log").read_text()[-4000:]
        procs += [_start(role, folder) for role in roles]
        logs = [tmp_path / f"{role}.log" for role in ("writer", *roles)]
        summaries = [_summary(proc, log) for proc, log in zip(procs, logs, strict=True)]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for s in summaries:  # the figures of docs/reliability.md, and what failed
        print("race:", json.dumps(s))
    assert all(s["runs"] > 0 and s["failed"] == 0 for s in summaries), summaries
