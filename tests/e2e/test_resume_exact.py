"""The GPT example, stopped and resumed, is bit for bit the run that never stopped.

For each setup (one process; two ranks with FSDP2) a straight run and a run stopped at
``stop_at`` are made once per module; each test resumes its own copy of the stopped run
in a fresh process and compares metrics (``==`` on floats) and final state (bits).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from . import example_runs as runs

pytestmark = pytest.mark.e2e


@dataclasses.dataclass(frozen=True)
class Baseline:
    setup: runs.Setup
    straight: runs.Run
    stopped: runs.Run
    data_dir: Path

    def resume(self, dest: Path, env: dict[str, str] | None = None) -> runs.Run:
        """Resume a copy of the stopped run in ``dest`` and train it to the end."""
        run = runs.copy_run(self.stopped, dest)
        return runs.train(self.setup, run, data_dir=self.data_dir, env=env)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="module", params=runs.SETUPS, ids=lambda s: s.name)
def baseline(request, tmp_path_factory, data_dir) -> Baseline:
    setup: runs.Setup = request.param
    root = tmp_path_factory.mktemp(setup.name)
    straight = runs.Run(root / "straight", root / "straight.jsonl", root / "straight.pt")
    stopped = runs.Run(root / "stopped", root / "stopped.jsonl")
    runs.train(setup, straight, data_dir=data_dir)
    runs.train(setup, stopped, data_dir=data_dir, env={"UNBROKEN_STOP_AT": str(setup.stop_at)})
    return Baseline(setup, straight, stopped, data_dir)


def first_difference(a: dict[int, dict], b: dict[int, dict], steps: range) -> int | None:
    return next((s for s in steps if a.get(s) != b.get(s)), None)


def test_straight_run_learns(baseline):
    """Guard for the comparisons below: a flat loss would hide a reset optimizer."""
    losses = [r["loss"] for _, r in sorted(baseline.straight.metrics().items())]
    assert len(losses) == baseline.setup.steps
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.6 * first, losses


def test_stopped_run_saves_at_the_stop_step_and_exits(baseline):
    k, setup = baseline.setup.stop_at, baseline.setup
    stopped, straight = baseline.stopped.metrics(), baseline.straight.metrics()
    assert max(stopped) == k
    assert (baseline.stopped.ckpt_dir / f"step_{k:08d}" / "manifest.json").is_file()
    assert first_difference(straight, stopped, range(1, k + 1)) is None
    assert f"stopped after saving step {k}" in baseline.stopped.stderr
    assert setup.steps > k


def test_resume_is_exact(baseline, tmp_path):
    k, steps = baseline.setup.stop_at, baseline.setup.steps
    resumed = baseline.resume(tmp_path)
    assert f"restored step {k} from" in resumed.stderr
    assert "verified: yes" in resumed.stderr

    straight, got = baseline.straight.metrics(), resumed.metrics()
    after = range(k + 1, steps + 1)
    assert sorted(got) == list(range(1, steps + 1))
    step = first_difference(straight, got, after)
    assert step is None, f"step {step}: straight {straight[step]}, resumed {got[step]}"

    differences = runs.tree_differences(
        runs.load_state(baseline.straight.final_state), runs.load_state(resumed.final_state)
    )
    assert differences == []


def test_lost_optimizer_state_is_caught(baseline, tmp_path):
    """Negative control: a fresh AdamW after the restore (the classic silent bug) must
    make the comparison fail, although the LR schedule and everything else continue."""
    k, steps = baseline.setup.stop_at, baseline.setup.steps
    resumed = baseline.resume(tmp_path, env={"EXAMPLE_RESET_OPTIMIZER": "1"})
    assert "optimizer state thrown away" in resumed.stderr

    straight, got = baseline.straight.metrics(), resumed.metrics()
    after = range(k + 1, steps + 1)
    assert [got[s]["lr"] for s in after] == [straight[s]["lr"] for s in after]
    # Step k+1's loss and gradient come before the fresh optimizer's first update.
    assert first_difference(straight, got, after) == k + 2
    assert any(got[s]["loss"] != straight[s]["loss"] for s in after)

    differences = runs.tree_differences(
        runs.load_state(baseline.straight.final_state), runs.load_state(resumed.final_state)
    )
    assert any("/optimizer/state/" in d for d in differences), differences
    assert any(d.startswith("/model/") for d in differences), differences
