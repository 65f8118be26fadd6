"""Re-saving a step that exists (a plain re-save: same run, no resume) never loses it.

A process re-saving step 2 is killed (``os._exit`` inside a patched rename or exchange)
before or after each renaming step of the commit; the folder, opened anew, still has
step 2, and it loads exactly: the old copy, or the new one once the swap was complete.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import Problem, assert_same_training_state

CHILD = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, {tests!r})
    from conftest import Problem
    from unbroken.storage import local_medium

    folder, when, at, exchange = {folder!r}, {when!r}, {at!r}, {exchange!r}
    p = Problem(seed=1)
    p.step()
    p.step()
    ckpt = p.checkpointer(folder, keep_last=None)
    # The same run re-saving its step 2: it takes the folder over from its last save
    # without loading anything (every component reset), so the new copy is this state.
    ckpt.restore(reset={{"model", "optimizer", "scheduler", "rng"}})
    calls = [0]

    def dying(real):
        def call(*args):
            calls[0] += 1
            if calls[0] == at and when == "before":
                os._exit(9)
            result = real(*args)
            if calls[0] == at and when == "after":
                os._exit(9)
            return result
        return call

    local_medium.os.rename = dying(os.rename)
    real = local_medium.posix.exchange  # the atomic exchange of a re-save
    local_medium.posix.exchange = dying(real) if exchange else (lambda a, b: False)
    ckpt.save(2)
    os._exit(0)  # the kill point was never reached
    """
)


def _trained(seed: int) -> Problem:
    p = Problem(seed=seed)
    p.step()
    p.step()
    return p


# (atomic exchange available, kill before/after, which call, the copy that must survive)
KILL_POINTS = [
    (False, "before", 1, "old"),
    (False, "after", 1, "old"),  # between the two renames: the old copy is aside
    (False, "after", 2, "new"),
    (True, "before", 1, "old"),
    (True, "after", 1, "new"),
]


def test_a_resave_killed_at_any_rename_keeps_the_step(tmp_path):
    """Case: a plain re-save of step 2 killed before, between and after the renames of
    its commit (two renames where the file system has no atomic exchange, else one
    exchange): opened anew, step 2 is committed and loads exactly the old copy or the
    complete new one; no leftover remains after the restore; the next save works."""
    for i, point in enumerate(KILL_POINTS):
        _kill_and_reopen(tmp_path / f"run{i}" / "ckpts", *point)


def _kill_and_reopen(folder: Path, exchange: bool, when: str, at: int, survivor: str) -> None:
    where = f"{'exchange' if exchange else 'renames'}, killed {when} call {at}"
    old = _trained(seed=0)
    ckpt = old.checkpointer(folder, keep_last=None)
    ckpt.save(1)
    ckpt.save(2)
    ckpt.close()
    code = CHILD.format(
        tests=str(Path(__file__).parents[1]), folder=str(folder), when=when, at=at,
        exchange=exchange,
    )  # fmt: skip
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert child.returncode == 9, f"{where}: {child.stderr[-3000:]}"

    q = Problem(seed=5)
    reopened = q.checkpointer(folder, keep_last=None)
    report = reopened.restore()
    assert (report.step, report.warnings) == (2, []), where
    assert_same_training_state(q, old if survivor == "old" else _trained(seed=1))
    names = sorted(x.name for x in folder.iterdir() if x.is_dir())
    assert names == ["step_00000001", "step_00000002"], where
    reopened.save(3)
    assert reopened.steps() == [1, 2, 3], where
    reopened.close()
    assert json.loads((folder / "step_00000002" / "manifest.json").read_text())["step"] == 2
