"""async_save="overlap": the copy of the state runs while training goes on, and the saved
state is still exactly the state at save(step).

The bug class is the torn checkpoint: tensors from two steps (weights of step N, moments
of N+1), which load without an error onto a trajectory no run ever took. The copy here is
held back on purpose (a controllable slow copy), so each test sees the window in which
training and the copy overlap; no test asserts a duration.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import unbroken as ub
from conftest import Problem, assert_same_training_state
from unbroken.core import staging


@pytest.fixture
def held_copy(monkeypatch):
    """The background copy (only it: the one run off the main thread) waits for
    ``release``; ``log`` records its start and end."""
    state = {"release": threading.Event(), "started": threading.Event(), "log": []}
    original = staging.StagingBuffers.copy

    def held(self, flat, **kwargs):
        if threading.current_thread() is threading.main_thread():
            return original(self, flat, **kwargs)
        state["log"].append("copy started")
        state["started"].set()
        assert state["release"].wait(30)
        out = original(self, flat, **kwargs)
        state["log"].append("copy done")
        return out

    monkeypatch.setattr(staging.StagingBuffers, "copy", held)
    return state


def _release_soon(held: dict) -> threading.Timer:
    timer = threading.Timer(0.05, held["release"].set)
    timer.start()
    return timer


def test_save_returns_before_the_copy_and_the_next_step_waits_for_it(ckpt_dir, held_copy):
    p = Problem()
    p.step()
    ckpt = p.checkpointer(ckpt_dir, async_save="overlap")
    ckpt.save(1)  # returns while the copy is held back
    late = ckpt._saver._copy.live  # copied in the background: parameters, optimizer state
    assert {"model/inp.weight", "optimizer/state/inp.weight/exp_avg"} <= late.keys()
    assert "model/seen" not in late  # a buffer the forward pass changes: copied in save()
    assert held_copy["started"].wait(30)
    assert held_copy["log"] == ["copy started"]
    p.opt.register_step_post_hook(lambda *a: held_copy["log"].append("step"))
    _release_soon(held_copy)
    p.step()  # its optimizer step waits in the pre-hook until the copy is done
    assert held_copy["log"] == ["copy started", "copy done", "step"]
    ckpt.close()
    assert ckpt.steps() == [1]
    assert not p.opt._optimizer_step_pre_hooks  # hooks removed


def test_training_right_after_save_does_not_leak_into_the_checkpoint(ckpt_dir, held_copy):
    p = Problem()
    for _ in range(3):
        p.step()
    snapshot = copy.deepcopy(p)
    ckpt = p.checkpointer(ckpt_dir, async_save="overlap")
    ckpt.save(3)
    _release_soon(held_copy)
    for _ in range(2):  # forward (changes the `seen` buffer), step, scheduler step
        p.step()
    ckpt.close()
    fresh = Problem(seed=4)
    fresh.checkpointer(ckpt_dir).restore()
    assert_same_training_state(snapshot, fresh)
    assert fresh.sched.state_dict() == snapshot.sched.state_dict()


def test_a_first_save_held_on_the_device_lets_training_go_on_and_stays_exact(
    ckpt_dir, held_copy, monkeypatch
):
    """Issue 27: the first "overlap" save allocated its pinned host buffers while the next
    optimizer step waited (1.02 s for 3.2 GB on an H200). Now, where buffers are still to
    be made, the state is first copied beside itself on the device and the step goes on
    while the host copy is made. Guards the torn checkpoint (the held copy is taken
    after save() and before any step changes the state) and the step not waiting. Run on
    the CPU with CPU tensors counted as on a device."""
    monkeypatch.setattr(staging, "on_device", lambda t: True)
    p = Problem()
    for _ in range(3):
        p.step()
    at_save = copy.deepcopy(p)
    ckpt = p.checkpointer(ckpt_dir, async_save="overlap")
    p.opt.register_step_post_hook(lambda *a: held_copy["log"].append("step"))
    ckpt.save(3)
    assert held_copy["started"].wait(30)  # the host copy is held back; the hold is done
    p.step()  # does not wait for the host copy
    assert held_copy["log"] == ["copy started", "step"]
    held_copy["release"].set()
    ckpt.wait()
    assert held_copy["log"] == ["copy started", "step", "copy done"]
    fresh = Problem(seed=4)
    fresh.checkpointer(ckpt_dir).restore()
    assert_same_training_state(at_save, fresh)

    # The buffers exist now: the next save copies into them, and the step waits for it.
    held_copy["release"].clear()
    held_copy["started"].clear()
    held_copy["log"].clear()
    _save_and_step_after_the_copy(p, ckpt, 4, copy.deepcopy(p), held_copy, ckpt_dir, seed=5)


def _save_and_step_after_the_copy(p, ckpt, step, at_save, held_copy, ckpt_dir, seed) -> None:
    """Save ``step``, then step while the host copy is held back: the step waits for the
    copy; closed, the checkpoint restores into a fresh Problem(``seed``) as ``at_save``."""
    ckpt.save(step)
    assert held_copy["started"].wait(30)
    _release_soon(held_copy)
    p.step()
    assert held_copy["log"] == ["copy started", "copy done", "step"]
    ckpt.close()
    fresh = Problem(seed=seed)
    fresh.checkpointer(ckpt_dir).restore()
    assert_same_training_state(at_save, fresh)


def test_no_room_on_the_device_for_the_hold_falls_back_to_waiting(ckpt_dir, held_copy, monkeypatch):
    """Without room on the device for the held copy, the first save copies straight into
    new host buffers and the next step waits for that copy, as before: still exact."""
    monkeypatch.setattr(staging, "on_device", lambda t: True)

    def no_room(part):
        raise torch.OutOfMemoryError("no room (test)")

    monkeypatch.setattr(staging, "device_copy", no_room)
    p = Problem()
    p.step()
    at_save = copy.deepcopy(p)
    ckpt = p.checkpointer(ckpt_dir, async_save="overlap")
    p.opt.register_step_post_hook(lambda *a: held_copy["log"].append("step"))
    _save_and_step_after_the_copy(p, ckpt, 1, at_save, held_copy, ckpt_dir, seed=4)


class TwoOptimizers:
    """One model, two optimizers (AdamW on the first layer, SGD with momentum on the
    second), a BatchNorm whose statistics the forward pass changes."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))
        self.opts = {
            "adam": torch.optim.AdamW(self.model[0].parameters(), lr=1e-2),
            "sgd": torch.optim.SGD(
                [*self.model[1].parameters(), *self.model[3].parameters()], lr=1e-2, momentum=0.9
            ),
        }

    def step(self) -> None:
        x = torch.randn(16, 4)
        loss = (self.model(x) - torch.sin(x).sum(1, keepdim=True)).pow(2).mean()
        for o in self.opts.values():
            o.zero_grad()
        loss.backward()
        for o in self.opts.values():
            o.step()

    def state(self) -> dict:
        out = {f"model/{k}": v.clone() for k, v in self.model.state_dict().items()}
        for name, o in self.opts.items():
            for i, st in o.state_dict()["state"].items():
                out.update({f"{name}/{i}/{k}": v.clone() for k, v in st.items()})
        return out


@pytest.mark.parametrize("held", [True, False], ids=["copy-held", "copy-free"])
def test_several_optimizers_all_wait_and_the_checkpoint_is_the_saved_step(ckpt_dir, held, request):
    held_copy = request.getfixturevalue("held_copy") if held else None
    t = TwoOptimizers()
    for _ in range(2):
        t.step()
    want = t.state()
    ckpt = ub.Checkpointer(ckpt_dir, model=t.model, optimizer=t.opts, async_save="overlap")
    ckpt.save(2)
    if held_copy is not None:
        _release_soon(held_copy)
    t.step()
    t.step()
    ckpt.close()
    assert all(not o._optimizer_step_pre_hooks for o in t.opts.values())
    fresh = TwoOptimizers(seed=5)
    ub.Checkpointer(ckpt_dir, model=fresh.model, optimizer=fresh.opts).restore()
    got = fresh.state()
    assert got.keys() == want.keys()
    for k in want:
        assert want[k].dtype == got[k].dtype and torch.equal(want[k], got[k]), k


@pytest.mark.parametrize("when", ["during the copy", "after the copy, before the step"])
def test_an_in_place_edit_outside_a_step_refuses_the_save(ckpt_dir, held_copy, when):
    p = Problem()
    p.step()
    ckpt = p.checkpointer(ckpt_dir, async_save="overlap")
    held_copy["release"].set()
    ckpt.save(1)
    ckpt.wait()
    held_copy["release"].clear()
    ckpt.save(2)
    if when != "during the copy":
        held_copy["release"].set()
    with torch.no_grad():
        p.model.inp.weight.mul_(2)  # weight surgery, an EMA update: no optimizer step
    held_copy["release"].set()
    p.step()
    with pytest.raises(ub.CheckpointError, match=r"step 2 was not saved: 'model/inp.weight'"):
        ckpt.wait()
    assert ckpt.steps() == [1]
    assert [x.name for x in ckpt_dir.iterdir() if x.name.startswith(".partial")] == []
    ckpt.save(3)  # the next save is unaffected
    ckpt.close()
    assert ckpt.steps() == [1, 3]


def test_edits_after_wait_or_after_the_step_are_allowed(ckpt_dir):
    p = Problem()
    p.step()
    ema = copy.deepcopy(p.model)
    ckpt = ub.Checkpointer(
        ckpt_dir, model={"net": p.model, "ema": ema}, optimizer=p.opt, async_save="overlap"
    )
    ckpt.save(1)
    ckpt.wait()
    with torch.no_grad():
        p.model.out.bias.add_(1)  # after wait(): the save is done
    ckpt.save(2)
    p.step()
    with torch.no_grad():  # an EMA update after the optimizer step: the copy is settled
        for e, q in zip(ema.parameters(), p.model.parameters(), strict=True):
            e.lerp_(q, 0.1)
    ckpt.close()
    assert ckpt.steps() == [1, 2]


def test_resume_from_an_overlapped_save_is_exact(tmp_path):
    straight = Problem()
    want = [straight.step() for _ in range(8)]

    p = Problem()
    ckpt = p.checkpointer(tmp_path / "c", async_save="overlap")
    for step in range(1, 7):
        p.step()
        if step in (2, 4):
            ckpt.save(step)
    ckpt.close()

    resumed = Problem(seed=7)
    report = resumed.checkpointer(tmp_path / "c").restore()
    assert report.step == 4 and report.verified
    got = [resumed.step() for _ in range(4)]
    assert got == want[4:]
    assert_same_training_state(straight, resumed)


def test_async_save_rejects_unknown_values(ckpt_dir):
    with pytest.raises(ValueError, match='async_save must be False, True or "overlap"'):
        Problem().checkpointer(ckpt_dir, async_save="background")


@pytest.mark.parametrize("mode", ["'overlap'", "True"])
def test_exit_without_close_still_commits(tmp_path, mode):
    """The copy is settled at the next optimizer step, wait() or close(); a script that
    saves and exits without any of them must neither hang nor lose the checkpoint (with
    True too: the write's thread pool refused work once the interpreter was exiting)."""
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent.parent)!r})
        from conftest import Problem
        p = Problem()
        p.step()
        ckpt = p.checkpointer({str(tmp_path / "c")!r}, async_save={mode})
        ckpt.save(1)
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    assert ub.Checkpointer(tmp_path / "c", model=nn.Linear(1, 1)).steps() == [1]
