"""``UnbrokenCallback``: a Lightning ``Trainer.fit`` stopped mid-epoch resumes bit for bit.

The resume tests run ``examples/lightning_train.py`` in fresh processes (one process, and
``strategy="ddp"`` on two); the loop-state and bug tests run the same example's Trainer in
this process, recording what the Trainer shows at every batch.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import signal
import sys
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from torch.utils.data import RandomSampler
from torchdata.stateful_dataloader import StatefulDataLoader

import unbroken as ub
from unbroken.integrations import lightning as lightning_ext
from unbroken.testing import assert_resumes_exactly

pytestmark = pytest.mark.e2e
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lightning_train.py"
STEPS, STOP_AT = 40, 20  # one process: 32 batches an epoch, so the resumed run crosses one


def _load_example():
    spec = importlib.util.spec_from_file_location("lightning_train", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example = _load_example()


@pytest.mark.parametrize("devices", [1, 2], ids=["1-process", "ddp-2-processes"])
def test_example_resumes_exactly_mid_epoch(tmp_path, devices):
    """Every bug class at once (lost optimizer moments F1/F3, lost RNG or data position,
    loop state, schedulers): ``resume-test`` on the example, stopped at step 20 (mid-epoch
    on one process; on two, 16 batches an epoch, mid-way through the second), compares
    every tracked loss and grad norm after it and the final state, bit for bit."""
    command = [sys.executable, str(EXAMPLE), "{dir}", "--steps", str(STEPS),
               "--devices", str(devices)]  # fmt: skip
    result = assert_resumes_exactly(  # in parallel alone: two DDP jobs would share a port
        command, stop_at=STOP_AT, workdir=tmp_path, plot=False, parallel=devices == 1
    )
    assert result.compared_steps == STEPS - STOP_AT
    assert {"loss", "grad_norm"} <= set(result.metrics)


class Recorder(L.Callback):
    """What the Trainer shows at each batch: counters, loop state, the batch, the loss."""

    def __init__(self) -> None:
        self.seen: dict[int, dict] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        loop = trainer.fit_loop
        self.seen[trainer.global_step + 1] = {
            "global_step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "batch_idx": batch_idx,
            "total_batch_idx": loop.total_batch_idx,
            "batches_that_stepped": loop.epoch_loop._batches_that_stepped,
            "fit_loop": _progress(loop.state_dict()),
            "lr": trainer.optimizers[0].param_groups[0]["lr"],
            "batch": [t.numpy().tobytes() for t in batch],
        }

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen[trainer.global_step]["loss"] = outputs["loss"].numpy().tobytes()


def _progress(state: dict) -> dict:
    return {k: v for k, v in state.items() if not k.endswith("state_dict")}


def _fit(folder: Path, *, stop_at: int | None = None) -> dict[int, dict]:
    recorder = Recorder()
    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if stop_at is None:
            mp.delenv("UNBROKEN_STOP_AT", raising=False)
        else:
            mp.setenv("UNBROKEN_STOP_AT", str(stop_at))
        logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
        example.seed()
        trainer = example.make_trainer(str(folder), steps=STEPS, callbacks=[recorder])
        trainer.fit(example.Regressor())
    return recorder.seen


def _differences(straight: dict[int, dict], resumed: dict[int, dict]) -> list[str]:
    """Every (step, field) where the resumed run differs from the straight one after K."""
    assert sorted(resumed) == list(range(STOP_AT + 1, STEPS + 1)), sorted(resumed)
    return [
        f"step {step}: {field}"
        for step in resumed
        for field in straight[step]
        if resumed[step][field] != straight[step][field]
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The straight run's records, and the folder the run stopped at ``STOP_AT`` left."""
    root = tmp_path_factory.mktemp("lightning")
    straight = _fit(root / "straight")
    stopped = _fit(root / "stopped", stop_at=STOP_AT)
    assert max(stopped) == STOP_AT  # trainer.should_stop honoured right after the save
    return straight, root / "stopped"


def _resume_copy(runs, tmp_path) -> tuple[dict, dict]:
    straight, stopped = runs
    folder = tmp_path / "resumed"
    shutil.copytree(stopped, folder)
    return straight, _fit(folder)


def test_trainer_loop_state_after_restore_equals_straight(runs, tmp_path):
    """Loop state and data position (the bug class of a resume that restarts the epoch,
    or counts steps and epochs from zero): from the first batch after the restore, the
    resumed Trainer's global_step, epoch, batch index, whole fit-loop progress, learning
    rate, the batch itself and the loss equal the straight run's, across an epoch end.
    Lightning's own log says that it resumed, from where (issue 36, item 11)."""
    said: list[str] = []
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: said.append(record.getMessage())
    rank_zero.addHandler(handler)
    level = rank_zero.level
    rank_zero.setLevel(logging.INFO)  # _fit quiets lightning.pytorch below errors
    try:
        straight, resumed = _resume_copy(runs, tmp_path)
    finally:
        rank_zero.removeHandler(handler)
        rank_zero.setLevel(level)
    line = f"unbroken: resumed from step {STOP_AT}, verified bit for bit, from "
    assert any(s.startswith(line) for s in said), said
    assert resumed[STOP_AT + 1]["global_step"] == STOP_AT
    assert resumed[STOP_AT + 1]["batch_idx"] == STOP_AT  # mid-epoch: not batch 0
    assert _differences(straight, resumed) == []


@pytest.mark.parametrize(
    ("bug", "first"),
    [
        ("data_position", f"step {STOP_AT + 1}: batch"),
        ("loop_bookkeeping", f"step {STOP_AT + 1}: batch_idx"),
    ],
)
def test_a_wrong_resume_is_caught(runs, tmp_path, monkeypatch, bug, first):
    """The comparison above is not vacuous: two ways to restore at ``on_train_start``
    wrongly are each caught. ``data_position`` keeps the iterator Lightning made before
    the restore (the epoch starts over: the lost data position bug class);
    ``loop_bookkeeping`` loads the loop state without Lightning's restart reset (epoch
    and batch counters drift: the lost loop state bug class)."""
    fit_class = lightning_ext._Fit
    if bug == "data_position":
        monkeypatch.setattr(fit_class, "resume_loops", lambda self: self.loop.reset())
    else:
        monkeypatch.setattr(fit_class, "resume_loops", lambda self: iter(self.loop._data_fetcher))
    straight, resumed = _resume_copy(runs, tmp_path)
    found = _differences(straight, resumed)
    assert found and found[0].startswith(first), found[:5]


class InitInOnTrainStart(example.Regressor):
    """Lightning's ModelParallelStrategy example: ``init_weights()`` in the module's
    ``on_train_start``, which Lightning runs after the callbacks' (where the restore is)."""

    def on_train_start(self):
        for p in self.parameters():
            torch.nn.init.normal_(p)


def test_an_init_in_on_train_start_fails_the_first_step(runs, tmp_path):
    """Issue 36, item 2: training went on from fresh weights with the restored optimizer,
    step and data position, and nothing said so. The first optimizer step now raises,
    naming the parameters and Lightning's on_train_start."""
    _, stopped = runs
    folder = tmp_path / "resumed"
    shutil.copytree(stopped, folder)
    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mp.delenv("UNBROKEN_STOP_AT", raising=False)
        logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
        example.seed()
        trainer = example.make_trainer(str(folder), steps=STEPS)
        with pytest.raises(ub.StateMismatchError, match="on_train_start") as info:
            trainer.fit(InitInOnTrainStart())
    assert "after restore() and before the first optimizer step" in str(info.value)
    assert trainer.global_step == STOP_AT  # no step was taken from the fresh weights


class PlainLoader(example.Regressor):
    def train_dataloader(self):
        return torch.utils.data.DataLoader(super().train_dataloader().dataset, batch_size=16)


class WrappedSampler(example.Regressor):
    """What Lightning makes of ``StatefulDataLoader(shuffle=True)`` under DDP."""

    def train_dataloader(self):
        data = super().train_dataloader().dataset
        sampler = DistributedSamplerWrapper(RandomSampler(data), num_replicas=1, rank=0)
        return StatefulDataLoader(data, batch_size=16, sampler=sampler)


class OwnCheckpointHook(example.Regressor):
    def on_save_checkpoint(self, checkpoint):
        checkpoint["mine"] = 1


@pytest.mark.parametrize(
    ("module", "error", "words"),
    [
        (PlainLoader, TypeError, ["dataloader", "StatefulDataLoader"]),
        (WrappedSampler, ub.CheckpointError, ["DistributedSamplerWrapper", "seed="]),
        (OwnCheckpointHook, ub.CheckpointError, ["on_save_checkpoint", "extra="]),
    ],
    ids=["plain-DataLoader", "sampler-shuffled-by-global-RNG", "on_save_checkpoint"],
)
def test_unsupported_state_is_refused(tmp_path, module, error, words):
    """State that cannot be saved exactly (the bug classes of a silent fresh start and a
    lost data position): a plain DataLoader (no position to save), a sampler whose order
    comes from the global RNG outside the loader's state (Lightning's wrapper under DDP;
    checked on one process here), or a module's own ``on_save_checkpoint`` state is
    refused when training starts, naming the object and the fix, before any step."""
    example.seed()
    trainer = example.make_trainer(str(tmp_path / "run"), steps=STEPS)
    with pytest.raises(error) as caught, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module())
    assert all(w in str(caught.value) for w in words), str(caught.value)
    assert trainer.global_step == 0
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").glob("step_*"))


class Preempt(L.Callback):
    """Sends this process SIGTERM while step ``at`` trains, as a cluster's preemption does."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step + 1 == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_saves_and_stops(tmp_path):
    """Preemption (the bug class of work lost, or a half-written checkpoint, on SIGTERM):
    the step that was training when SIGTERM came is finished, saved and committed, and
    ``trainer.should_stop`` ends the fit there; the process's handler is put back."""
    before = signal.getsignal(signal.SIGTERM)
    example.seed()
    trainer = example.make_trainer(str(tmp_path / "run"), steps=STEPS, callbacks=[Preempt(13)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(example.Regressor())
    assert trainer.global_step == 13
    assert signal.getsignal(signal.SIGTERM) == before
    with ub.Checkpointer(tmp_path / "run", model=torch.nn.Linear(1, 1)) as ckpt:
        assert ckpt.steps() == [10, 13]


def test_frozen_is_passed_to_the_checkpointer(tmp_path):
    """``frozen="verify"`` reaches the Checkpointer the callback builds (checked when the
    callback is made: a wrong value is refused at once, not at training start)."""
    callback = lightning_ext.UnbrokenCallback(tmp_path / "ckpts", frozen="verify")
    assert callback._options["frozen"] == "verify"
    with pytest.raises(ValueError, match='frozen must be "save" or "verify"'):
        lightning_ext.UnbrokenCallback(tmp_path / "ckpts", frozen="yes")
