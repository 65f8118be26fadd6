"""``unbroken.integrations.accelerate``: an Accelerator's prepared objects, resumed exactly.

The resume tests run the real ``unbroken resume-test`` command on
``examples/accelerate_train.py``, in one process and under ``accelerate launch`` with two
(DDP on gloo). On a CPU-only machine two processes need ``--multi_gpu``: with ``--cpu``,
``accelerate launch`` starts one process whatever ``--num_processes`` says (accelerate 1.15,
``simple_launcher``; several CPU processes there mean ``mpirun``).
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

from processes import accelerate_launch
from unbroken.integrations.accelerate import checkpointer_for
from unbroken.testing import compare

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "accelerate_train.py"
LOST_EPOCH = Path(__file__).parent / "scripts" / "accelerate_lost_epoch.py"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
STEPS = ["--steps", "24"]


def _resume_test(
    workdir: Path, stop_at: int, *command: str, parallel: bool = False
) -> subprocess.CompletedProcess:
    # --parallel only for one process: two launches side by side would share a port.
    cli = [sys.executable, "-m", "unbroken.cli", "resume-test", "--stop-at", str(stop_at)]
    cli += ["--workdir", str(workdir), "--json", "--timeout", "120"]
    cli += ["--parallel"] if parallel else []
    return subprocess.run(
        [*cli, "--", *command], capture_output=True, text=True, timeout=400, env=ENV, cwd=ROOT
    )


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    """``unbroken resume-test`` on the example in one process, stopped at step 16: the
    last batch of epoch 0 (32 batches, 2 per step), whose saved position says "epoch
    finished", so the resumed run must begin epoch 1 with epoch 1's shuffle."""
    work = tmp_path_factory.mktemp("accelerate-1")
    done = _resume_test(work, 16, sys.executable, str(EXAMPLE), "{dir}", *STEPS, parallel=True)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout)
    assert result["passed"] and result["compared_steps"] == 8, result
    return work


def test_one_process_resumes_bit_exact(one_process):
    """Bug classes F1/F3 (state silently fresh: optimizer moments, scheduler, RNG, data
    position) and F5 (dtypes), for a plain ``Accelerator`` run: after a stop at an epoch's
    end, every tracked loss and grad norm and every final tensor are bit-identical."""
    report = (one_process / "resume-test-report.txt").read_text()
    assert "IDENTICAL" in report and "every tensor's fingerprint identical" in report


def test_two_processes_under_accelerate_launch_resume_bit_exact(tmp_path):
    """F1/F3 under DDP (``accelerate launch``, 2 processes, gloo): stopped mid-epoch
    (step 13 of 8-step epochs, so inside epoch 1), each rank's loader position, epoch and
    RNG and the shared model/optimizer/scheduler come back exactly."""
    done = _resume_test(tmp_path, 13, *accelerate_launch(2, EXAMPLE, "{dir}", *STEPS))
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout)
    assert result["passed"] and result["compared_steps"] == 11, result
    manifest = json.loads(next((tmp_path / "resumed").glob("step_*/manifest.json")).read_text())
    assert manifest["world_size"] == 2


def test_a_resume_without_the_loader_epoch_is_caught(one_process, tmp_path):
    """F3, the Accelerate-specific form: ``DataLoaderShard.state_dict()`` (all that
    ``accelerator.save_state`` keeps of a stateful loader) lacks the epoch counter that
    seeds the shuffle. Restoring the position without it replays epoch 0's order in
    epoch 1; the comparison with the straight run names the first step after the stop.
    The stop is at step 18, inside epoch 1 (a stop on epoch 0's last batch resumes in
    epoch 0, at its end, where the counter says nothing yet)."""
    command = [sys.executable, str(LOST_EPOCH), str(tmp_path), *STEPS]
    stopped = subprocess.run(
        command, env={**ENV, "UNBROKEN_STOP_AT": "18"}, capture_output=True, text=True, timeout=120
    )
    assert stopped.returncode == 0, stopped.stderr
    resumed = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    result = compare(one_process / "straight", tmp_path, stop_at=18, exact=True)
    assert not result.passed
    assert result.first_difference_step == 19, result.first_difference
    assert result.state_differences


@pytest.fixture
def accelerator_factory():
    """Accelerators in this process; Accelerate's shared state is reset afterwards."""
    made = []

    def make(**config) -> Accelerator:
        made.append(Accelerator(cpu=True, **config))
        return made[-1]

    yield make
    AcceleratorState._reset_state(True)


def _prepared(accelerator: Accelerator, *, shuffle: bool):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 2))
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=shuffle)
    return accelerator.prepare(model, opt, loader, sched)


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({}, "was prepared without use_stateful_dataloader=True"),
        ({"use_stateful_dataloader": True}, "shuffles with a torch RandomSampler"),
    ],
    ids=["not-stateful", "unseeded-shuffle"],
)
def test_a_loader_that_cannot_resume_exactly_is_refused(
    accelerator_factory, tmp_path, config, named
):
    """F3 (a silent fresh start): a prepared loader whose position cannot be saved, or
    whose mid-epoch order cannot be drawn again, is refused when the Checkpointer is
    made, naming it and the configuration to use, never restored approximately."""
    acc = accelerator_factory(dataloader_config=DataLoaderConfiguration(**config))
    _prepared(acc, shuffle=True)
    with pytest.raises(TypeError) as caught:
        checkpointer_for(acc, tmp_path)
    message = str(caught.value)
    assert "accelerator._dataloaders[0]" in message and named in message
    assert "use_seedable_sampler=True" in message and "dataloaders=[...]" in message
    ckpt = checkpointer_for(acc, tmp_path, dataloaders=[])  # left out on purpose: allowed
    assert "dataloader" not in [c.name for c in ckpt._components]
    ckpt.close()


def test_custom_objects_and_accumulation_counter_round_trip(accelerator_factory, tmp_path):
    """F3 for what only Accelerate knows about: objects given to
    ``register_for_checkpointing`` and ``accelerator.step`` (which decides the next
    gradient-accumulation sync) are components, restored exactly, named in the report."""

    class Counter:
        def __init__(self) -> None:
            self.seen = torch.zeros(3)

        def state_dict(self):
            return {"seen": self.seen.clone()}

        def load_state_dict(self, state):
            self.seen = state["seen"].clone()

    acc = accelerator_factory(
        gradient_accumulation_steps=3,
        dataloader_config=DataLoaderConfiguration(
            use_stateful_dataloader=True, use_seedable_sampler=True
        ),
    )
    model, opt, loader, sched = _prepared(acc, shuffle=True)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    batches = iter(loader)
    for _ in range(4):  # 4 micro-batches: one optimizer step, then one of the next three
        x, y = next(batches)
        with acc.accumulate(model):
            acc.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            sched.step()
            opt.zero_grad()
        counter.seen += 1
    with checkpointer_for(acc, tmp_path) as ckpt:
        ckpt.save(1)
    expected = {"weight": model.weight.detach().clone(), "next": next(batches)[0]}
    saved_step, saved_lr = acc.step, sched.get_last_lr()
    counter.seen.zero_()
    acc.step = 0
    with torch.no_grad():
        model.weight.zero_()
    batches = None  # a new process would hold no iterator either
    with checkpointer_for(acc, tmp_path) as ckpt:
        report = ckpt.restore()
    names = ["model", "optimizer", "scheduler", "accelerator", "custom_0", "dataloader", "rng"]
    assert report.components == dict.fromkeys(names, "restored")
    assert acc.step == saved_step == 4 and sched.get_last_lr() == saved_lr
    assert torch.equal(counter.seen, torch.full((3,), 4.0))
    assert torch.equal(model.weight, expected["weight"])
    assert torch.equal(next(iter(loader))[0], expected["next"])  # the 5th batch, as before


def test_extra_may_not_take_a_name_the_integration_uses(accelerator_factory, tmp_path):
    """F3 by name collision: a user's ``extra`` under a name this adds would replace
    (and silently drop) one of the prepared components; it is refused."""
    acc = accelerator_factory()
    acc.prepare(nn.Linear(2, 2))
    taken = {"accelerator": nn.Linear(1, 1)}
    with pytest.raises(ValueError, match=r"extra reuses the component name\(s\) \['accelerator'\]"):
        checkpointer_for(acc, tmp_path, extra=taken)


def test_processes_the_accelerator_did_not_join_are_refused(
    accelerator_factory, tmp_path, monkeypatch
):
    """A torn run: launched as 2 processes (``accelerate launch --use_fsdp`` on a machine
    without GPUs) while each Accelerator runs alone, both would save into one folder as
    rank 0 of 1. Refused, naming the launch and the fix."""
    acc = accelerator_factory()
    acc.prepare(nn.Linear(2, 2))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"launched as 2 processes .* runs 1 .*--multi_gpu"):
        checkpointer_for(acc, tmp_path)
