"""The Hugging Face Trainer resumes through unbroken bit for bit (issue 13, item 5).

Most runs happen in this process (the Trainer seeds itself in ``__init__``), built by
``examples/hf_trainer_train.py``: 512 shuffled rows, 32 batches an epoch, dropout, AdamW,
linear warm-up. One test runs the real ``unbroken resume-test`` command on the example.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers.trainer
from transformers import Trainer

import unbroken as ub
from unbroken.integrations.transformers import UnbrokenCallback, UnbrokenTrainerMixin
from unbroken.testing import compare

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
import hf_trainer_train as example  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
STEPS = 40


def train(folder: Path, *, stop_at: int | None = None, patch=None, **overrides):
    """One in-process run; returns the trainer and the input batch of every forward."""
    with pytest.MonkeyPatch.context() as env:
        env.delenv("UNBROKEN_STOP_AT", raising=False)
        if stop_at is not None:
            env.setenv("UNBROKEN_STOP_AT", str(stop_at))
        if patch is not None:
            patch(env)
        trainer = example.build_trainer(str(folder), STEPS, 10, **overrides)
        seen: list[torch.Tensor] = []
        trainer.model.register_forward_pre_hook(
            lambda m, a, kw: seen.append(kw["x"].clone()), with_kwargs=True
        )
        trainer.train()
    return trainer, seen


class Runs:
    """Straight and stopped runs, each made once per module and copied by the tests."""

    def __init__(self, root: Path) -> None:
        self.root, self.cache = root, {}

    def straight(self, **overrides):
        key = ("straight", *sorted(overrides.items()))
        if key not in self.cache:
            folder = self.root / f"straight-{len(self.cache)}"
            self.cache[key] = (folder, *train(folder, **overrides))
        return self.cache[key]

    def stopped(self, stop_at: int, **overrides) -> Path:
        key = ("stopped", stop_at, *sorted(overrides.items()))
        if key not in self.cache:
            folder = self.root / f"stopped-{len(self.cache)}"
            trainer, _ = train(folder, stop_at=stop_at, **overrides)
            assert trainer.state.global_step == stop_at
            self.cache[key] = folder
        return self.cache[key]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("hf-runs"))


def straight_and_resumed(runs: Runs, tmp_path: Path, stop_at: int, bug=None, **overrides):
    """The straight run, and a copy of the run stopped at ``stop_at`` resumed to the end."""
    folder, straight, seen_a = runs.straight(**overrides)
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(runs.stopped(stop_at, **overrides), resumed_dir)
    resumed, seen_b = train(resumed_dir, patch=bug, **overrides)
    return folder, straight, seen_a, resumed_dir, resumed, seen_b


def progress(state) -> dict:
    """The TrainerState of a finished run, less the end-of-run summary (timings)."""
    logs = [entry for entry in state.log_history if "loss" in entry]
    return {"global_step": state.global_step, "epoch": state.epoch, "logs": logs,
            "total_flos": state.total_flos, "tokens": state.num_input_tokens_seen}  # fmt: skip


@pytest.mark.parametrize(
    ("stop_at", "overrides"),
    [(20, {}), (32, {}), (20, {"gradient_accumulation_steps": 2})],
    ids=["mid-epoch-0", "epoch-boundary", "grad-accumulation-mid-epoch-1"],
)
def test_state_and_data_position_match_the_straight_run(runs, tmp_path, stop_at, overrides, caplog):
    """Bug classes F3 (a component silently fresh) and lost RNG/data position: after the
    resume, the batches drawn, every logged loss/grad norm/LR (bit for bit), global_step,
    epoch and the log history are the straight run's, and the final checkpoints agree.
    The log says that it resumed, from where, at the Trainer's default verbosity (issue
    36, item 11)."""
    with caplog.at_level("WARNING", logger="unbroken"):
        folder, straight, seen_a, resumed_dir, resumed, seen_b = straight_and_resumed(
            runs, tmp_path, stop_at, **overrides
        )
    assert f"unbroken: resumed from step {stop_at}, verified bit for bit, from " in caplog.text
    per_step = overrides.get("gradient_accumulation_steps", 1)
    after = seen_a[stop_at * per_step :]
    assert len(seen_b) == len(after)
    assert all(torch.equal(a, b) for a, b in zip(after, seen_b, strict=True))
    assert progress(resumed.state) == progress(straight.state)
    result = compare(folder, resumed_dir, stop_at=stop_at)
    assert result.passed, str(result)
    assert set(restore_report(resumed).components.values()) == {"restored"}


def restore_report(trainer) -> ub.RestoreReport:
    (cb,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, UnbrokenCallback)]
    return cb.report


def _no_rng_put_back(patch) -> None:
    patch.setattr(UnbrokenTrainerMixin, "_load_rng_state", lambda self, checkpoint: None)


def _no_data_skip(patch) -> None:
    patch.setattr(transformers.trainer, "skip_first_batches", lambda loader, n: loader)


@pytest.mark.parametrize("bug", [_no_rng_put_back, _no_data_skip], ids=["rng", "data-skip"])
def test_a_wrong_resume_is_caught(runs, tmp_path, bug):
    """Lost RNG state and lost data position (the silent bugs of a DIY resume): with the
    RNG put back before the Trainer draws its epoch iterator's seed, or without the skip
    of seen batches, the same comparison the tests above pass reports a difference at the
    first step after the resume."""
    folder, _, _, resumed_dir, _, _ = straight_and_resumed(runs, tmp_path, 20, bug=bug)
    result = compare(folder, resumed_dir, stop_at=20)
    assert not result.passed
    assert result.first_difference_step == 21


def test_changed_data_settings_are_refused_before_anything_changes(runs, tmp_path, monkeypatch):
    """A resume that would land at another data position (here: another batch size) is a
    StateMismatchError naming the setting, raised before any live object changed."""
    shutil.copytree(runs.stopped(20), tmp_path, dirs_exist_ok=True)
    monkeypatch.delenv("UNBROKEN_STOP_AT", raising=False)
    trainer = example.build_trainer(str(tmp_path), STEPS, 10, per_device_train_batch_size=8)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(ub.StateMismatchError, match="per_device_train_batch_size was 16, is 8"):
        trainer.train()
    after = trainer.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert ub.Checkpointer(tmp_path, model=trainer.model).steps() == [10, 20]


@pytest.mark.parametrize(
    ("setup", "error", "match"),
    [
        ("ignore_data_skip", ValueError, "ignore_data_skip=True"),
        ("plain_trainer", RuntimeError, "Use unbroken.integrations.transformers.UnbrokenTrainer"),
        ("resume_from_checkpoint", ValueError, "leave it unset"),
    ],
)
def test_unsupported_setups_are_refused(tmp_path, monkeypatch, setup, error, match):
    """No silent fresh start or inexact resume: settings under which the Trainer cannot
    resume exactly, and a callback the Trainer cannot resume through, are errors naming
    the setting and the fix."""
    monkeypatch.delenv("UNBROKEN_STOP_AT", raising=False)
    overrides = {"ignore_data_skip": True} if setup == "ignore_data_skip" else {}
    trainer = example.build_trainer(str(tmp_path), STEPS, 10, **overrides)
    kwargs = {}
    if setup == "plain_trainer":
        trainer = Trainer(model=trainer.model, args=trainer.args,
                          train_dataset=trainer.train_dataset,
                          callbacks=[UnbrokenCallback(tmp_path)])  # fmt: skip
    if setup == "resume_from_checkpoint":
        kwargs["resume_from_checkpoint"] = str(tmp_path / "checkpoint-20")
    with pytest.raises(error, match=match):
        trainer.train(**kwargs)
    assert not list(tmp_path.glob("step_*"))


def test_resume_test_command_on_the_example(tmp_path):
    """The user-facing proof: ``unbroken resume-test`` runs the example straight, stopped
    mid-epoch at 20 and resumed, in fresh processes, and finds every tracked metric and
    the final state bit-identical (exit 0)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "unbroken.cli", "resume-test", "--stop-at", "20",
         "--workdir", str(tmp_path), "--parallel", "--", sys.executable,
         str(ROOT / "examples" / "hf_trainer_train.py"), "{dir}"],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "IDENTICAL" in done.stdout
