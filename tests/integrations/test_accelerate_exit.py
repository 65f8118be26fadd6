"""Two-process ``accelerate launch`` runs of the documented recipe exit by themselves.

Testers saw 2 of 4 such runs hang after their last commit (one for 9 minutes). The
likeliest cause, fixed with issue 29: a gloo worker thread could drop, during interpreter
shutdown, the last reference to a tensor one of our collectives had handed it, and needs
the GIL for that while the main thread finalizes (seen here as an abort in 3 of 20 torchrun
runs). Our collectives now keep every tensor until gloo has let go of it
(core/collective.py). The hang itself was not reproduced here: 0 in 49 two-process runs of
three script variants, at this code and at the commit before that fix.

Issue 36 item 19: the 20th of 20 runs here still ended in "terminate called without an
active exception" (SIGABRT) after its work: the same race, through a collective that is
not ours (``accelerator.gather`` in the recipe's evaluation, DDP's all-reduce), whose
tensors no one waited for. The Checkpointer now registers an exit hook
(core/process_exit.py) that destroys the default group the script left and waits until
every gloo worker thread is idle before the interpreter finalizes.

The script is docs/integrations/accelerate.md's recipe as printed (it ends with
``ckpt.close()`` and no teardown of its own), launched several times in a row; each run
must exit 0 within its time bound, without an abort, its last save (step 10 of 12)
committed. The suite launches it 5 times (each launch is three processes, ~10 s on two
cores); ``make reliability`` launches it 20 times (``UNBROKEN_EXIT_RUNS``), the count
that showed the abort above.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from processes import accelerate_launch

from .recipes import write_recipe

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]
RUNS = int(os.environ.get("UNBROKEN_EXIT_RUNS", "5"))
BOUND_S = 120  # one run takes 6-10 s on 2 idle cores
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _launch(script: Path, folder: Path) -> subprocess.CompletedProcess:
    """One 2-process run; on overrunning its bound, the launcher and its workers (one
    process group) are killed and the test fails naming the run."""
    command = accelerate_launch(2, script, folder)
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=ENV,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{folder.name} did not exit within {BOUND_S} s:\n{out[-3000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, out, None)


def test_two_process_runs_in_a_row_exit_cleanly(tmp_path):
    script = write_recipe("accelerate.md", "accelerate", tmp_path)
    for i in range(1, RUNS + 1):
        folder = tmp_path / f"run{i:02d}"
        done = _launch(script, folder)
        assert done.returncode == 0, f"run {i} of {RUNS} exited {done.returncode}:\n{done.stdout}"
        assert "terminate called" not in done.stdout, done.stdout
        assert (folder / "step_00000010" / "manifest.json").is_file(), sorted(folder.iterdir())
