"""Accelerate with the loaders a real script has: a training loader and an evaluation loader.

Bug class F3 (state silently fresh) in two forms found by testers on accelerate 1.15:

- A prepared ``StatefulDataLoader`` makes its first iterator when it is prepared, so its
  first pass draws no seed from torch's RNG and every later pass draws one. A loader left
  out of the checkpoint (the documented way to keep an evaluation loader starting over)
  was back on its "first pass" after a resume, skipped that draw, and shifted every
  random number after it: the dropout masks, from the first evaluation after the resume.
- A loader saved after its pass had ended came back one epoch ahead (its ``for`` loop had
  already counted the epoch; the restore counted it again), so with a seeded shuffle the
  next epoch came in another order.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DataLoaderConfiguration
from torch import nn

from unbroken.integrations.accelerate import checkpointer_for

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).parent / "scripts" / "accelerate_eval_loader.py"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


@pytest.mark.parametrize(
    ("loaders", "stop_at", "options"),
    [
        ("train", 30, []),
        ("train", 16, []),
        ("all", 16, []),
        ("all", 16, ["--save-in-loop"]),
    ],
    ids=[
        "eval-left-out-mid-epoch",
        "eval-left-out-epoch-end",
        "all-loaders-epoch-end",
        "all-loaders-saved-before-the-epochs-evaluation",
    ],
)
def test_a_script_with_an_evaluation_loader_resumes_bit_exact(tmp_path, loaders, stop_at, options):
    """Both bugs above, end to end: step 30 falls mid-epoch after three evaluations; step
    16 is an epoch's last step, whose evaluation runs before the save. The resumed run's
    training and evaluation losses and its final state equal the straight run's.

    Issue 36 item 15, the last case: saved and stopped inside the training loop on an
    epoch's last step, as Accelerate's ``examples/by_feature/checkpointing.py`` saves,
    before that epoch's evaluation. The restored loader resumed in the next epoch, so the
    resumed run skipped that evaluation (its loader's new iterator draws a seed from
    torch's RNG): DIFFERENT from step 17, ``dataloader/1/unbroken:next_epoch: 2 vs 1``.
    Now its next pass ends the interrupted epoch, and the evaluation runs as it did."""
    cli = [sys.executable, "-m", "unbroken.cli", "resume-test", "--stop-at", str(stop_at)]
    cli += ["--workdir", str(tmp_path), "--json", "--timeout", "120", "--parallel"]
    command = [*cli, "--", sys.executable, str(SCRIPT), "{dir}", "--loaders", loaders, *options]
    done = subprocess.run(command, capture_output=True, text=True, timeout=400, env=ENV, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout)
    assert result["passed"] and result["compared_steps"] > 0, result


@pytest.fixture
def fresh_accelerator():
    """A new Accelerator (Accelerate's shared state reset first) each time it is called."""

    def make() -> Accelerator:
        AcceleratorState._reset_state(True)
        return Accelerator(
            cpu=True,
            dataloader_config=DataLoaderConfiguration(
                use_stateful_dataloader=True, use_seedable_sampler=True
            ),
        )

    yield make
    AcceleratorState._reset_state(True)


def _prepare(accelerator: Accelerator, *, evaluation: bool = False):
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.arange(24.0).reshape(12, 2))
    loaders = [torch.utils.data.DataLoader(data, batch_size=3, shuffle=True)]
    if evaluation:
        loaders.append(torch.utils.data.DataLoader(data, batch_size=6))
    return accelerator.prepare(model, opt, *loaders)


def _one_pass(loader) -> list[torch.Tensor]:
    return [x for (x,) in loader]


def _resumes_in_epoch_1(fresh_accelerator, tmp_path, straight: list[torch.Tensor]) -> None:
    """A fresh Accelerator's loader restored from ``tmp_path`` is in epoch 1, and its
    next pass is ``straight`` (the straight loader's epoch 1)."""
    _, _, resumed = _prepare(acc := fresh_accelerator())
    ckpt = checkpointer_for(acc, tmp_path)
    ckpt.restore()
    assert resumed.iteration == 1
    assert all(map(torch.equal, _one_pass(resumed), straight))
    ckpt.close()


def test_a_loader_saved_after_its_pass_ended_resumes_in_the_next_epoch(fresh_accelerator, tmp_path):
    """The epoch counted once: saved after the ``for`` loop ran to its end, the restored
    loader's next pass is the straight loader's next pass (epoch 1's shuffle), not epoch 2's."""
    _, _, loader = _prepare(acc := fresh_accelerator())
    _one_pass(loader)
    ckpt = checkpointer_for(acc, tmp_path)
    ckpt.save(1)
    ckpt.close()
    _resumes_in_epoch_1(fresh_accelerator, tmp_path, straight=_one_pass(loader))


def test_a_loader_saved_on_its_last_batch_ends_its_epoch_then_goes_on(fresh_accelerator, tmp_path):
    """Saved inside the loop on the pass's last batch (Accelerate has not counted the epoch
    yet), then the loop goes on to its end. The restored loader is where the saved one
    was: in epoch 0, its next pass hands out nothing and counts the epoch (so the code
    after a resumed loop runs, issue 36 item 15), and the pass after it is the straight
    loader's epoch 1. A save made before that empty pass keeps the same position."""
    _, _, loader = _prepare(acc := fresh_accelerator())
    ckpt = checkpointer_for(acc, tmp_path)
    for _ in loader:
        if acc.gradient_state.end_of_dataloader:
            ckpt.save(1)
    ckpt.close()
    straight = _one_pass(loader)

    for step in (1, 2):  # step 2: saved by the first resumed run before its empty pass
        _, _, resumed = _prepare(acc := fresh_accelerator())
        ckpt = checkpointer_for(acc, tmp_path)
        assert ckpt.restore().step == step
        assert resumed.iteration == 0
        if step == 1:
            ckpt.save(2)
        assert _one_pass(resumed) == [] and resumed.iteration == 1
        assert all(map(torch.equal, _one_pass(resumed), straight))
        assert resumed.iteration == 2
        ckpt.close()


def test_a_left_out_loader_keeps_the_random_draws_of_its_passes(fresh_accelerator, tmp_path):
    """An evaluation loader left out after its first pass: its next pass draws a seed from
    torch's RNG in the straight run, so the resumed one must too, or every later random
    number (here the one drawn after the pass) shifts."""
    _, _, train, evaluation = _prepare(acc := fresh_accelerator(), evaluation=True)
    _one_pass(evaluation)
    ckpt = checkpointer_for(acc, tmp_path, dataloaders=[train])
    ckpt.save(1)
    ckpt.close()
    torch.manual_seed(7)
    straight = (_one_pass(evaluation), torch.rand(4))

    _, _, train, evaluation = _prepare(acc := fresh_accelerator(), evaluation=True)
    ckpt = checkpointer_for(acc, tmp_path, dataloaders=[train])
    ckpt.restore()
    torch.manual_seed(7)
    batches, after = _one_pass(evaluation), torch.rand(4)
    assert all(map(torch.equal, batches, straight[0]))
    assert torch.equal(after, straight[1])
    ckpt.close()
