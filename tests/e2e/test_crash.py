"""Processes killed with SIGKILL at random instants of save(), and real preemption
signals to a 2-process torchrun job: the last committed checkpoint always restores."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import unbroken as ub
from processes import children, free_port, torchrun
from unbroken.testing import compare

pytestmark = pytest.mark.e2e
SCRIPTS = Path(__file__).parent / "scripts"


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def _wait_for_line(proc: subprocess.Popen, prefix: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(prefix):
            return line
        if not line and proc.poll() is not None:
            raise AssertionError(f"process exited with {proc.returncode} before {prefix!r}")
    raise AssertionError(f"no {prefix!r} within {timeout}s")


def _assert_latest_restores_exactly(folder: Path) -> int:
    model = nn.Sequential(*(nn.Linear(256, 256) for _ in range(16)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    report = ub.Checkpointer(folder, model=model, optimizer=opt).restore(reset={"rng"})
    assert report.restored and report.verified
    for p in model.parameters():
        assert torch.equal(p, torch.full_like(p, report.step))
        assert torch.equal(opt.state[p]["exp_avg"], torch.full_like(p, report.step))
    assert not [x for x in folder.iterdir() if x.name.startswith(".partial")]
    return report.step


def test_sigkill_at_random_instants_of_save(tmp_path):
    rng = random.Random(20261122)
    folder = tmp_path / "ckpts"
    restored = []
    for _ in range(6):
        command = [sys.executable, str(SCRIPTS / "save_forever.py"), str(folder)]
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=_env())
        _wait_for_line(proc, "saved")
        time.sleep(rng.uniform(0.0, 0.4))
        proc.kill()
        proc.wait()
        restored.append(_assert_latest_restores_exactly(folder))
    assert restored == sorted(restored)  # every restart went on from the latest


def test_sigkill_of_one_rank_of_two_during_save(tmp_path):
    rng = random.Random(7)
    folder = tmp_path / "ckpts"
    for _ in range(3):
        port = str(free_port())
        procs = [
            subprocess.Popen(
                [sys.executable, str(SCRIPTS / "save_forever.py"), str(folder)],
                stdout=subprocess.PIPE,
                text=True,
                env=_env(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
            )
            for r in range(2)
        ]
        _wait_for_line(procs[0], "saved")
        time.sleep(rng.uniform(0.0, 0.4))
        procs[1].kill()  # one rank dies mid-save; the job then goes down
        time.sleep(0.2)
        procs[0].kill()
        for p in procs:
            p.wait()
        _assert_latest_restores_exactly(folder)


@pytest.fixture
def jobs():
    """Started jobs; whatever still runs when the test ends (a failure) is killed."""
    started: list[subprocess.Popen] = []
    yield started
    for job in started:
        if job.poll() is None:
            for pid in children(job.pid):
                os.kill(pid, signal.SIGKILL)
            job.kill()
            job.wait()


def _torchrun(folder: Path, steps: int, jobs: list, **env: str) -> subprocess.Popen:
    command = torchrun(2, SCRIPTS / "tiny_train.py", folder, "--steps", str(steps))
    job = subprocess.Popen(
        command, env=_env(**env), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    jobs.append(job)
    return jobs[-1]


def test_sigterm_to_a_torchrun_job_saves_and_resumes_exactly(tmp_path, jobs):
    """Preemption: SIGTERM reaches both ranks mid-step; they agree, save at the next step
    boundary, exit cleanly; the resumed run matches an uninterrupted one bit for bit."""
    straight, preempted = tmp_path / "straight", tmp_path / "preempted"
    job = _torchrun(straight, 30, jobs)
    assert job.wait(timeout=180) == 0, job.stderr.read()
    job = _torchrun(preempted, 30, jobs, TINY_SLEEP="0.1")
    deadline = time.monotonic() + 120
    while (
        not (preempted / "metrics.jsonl").exists()
        or not ub.Checkpointer(preempted, model=nn.Linear(1, 1)).steps()
    ):
        assert time.monotonic() < deadline and job.poll() is None
        time.sleep(0.1)  # wait for the first checkpoint (step 10)
    time.sleep(0.35)
    for pid in children(job.pid):
        os.kill(pid, signal.SIGTERM)
    assert job.wait(timeout=120) == 0, job.stderr.read()
    stopped_at = ub.Checkpointer(preempted, model=nn.Linear(1, 1)).latest_step()
    assert 10 < stopped_at < 30
    job = _torchrun(preempted, 30, jobs)
    assert job.wait(timeout=180) == 0, job.stderr.read()
    result = compare(straight, preempted, stop_at=stopped_at)
    assert result.passed, str(result)


def test_crash_after_async_save_returned_keeps_the_previous_latest(tmp_path):
    folder = tmp_path / "ckpts"
    command = [sys.executable, str(SCRIPTS / "async_crash.py"), str(folder)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=_env())
    _wait_for_line(proc, "returned")
    proc.kill()  # save(2) returned, its background write has not committed
    proc.wait()
    model = nn.Linear(64, 64)
    report = ub.Checkpointer(folder, model=model).restore()
    assert report.step == 1 and torch.equal(model.weight, torch.ones(64, 64))
    assert not [x for x in folder.iterdir() if x.name.startswith(".partial")]
