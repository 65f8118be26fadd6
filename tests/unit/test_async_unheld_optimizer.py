"""async_save="overlap" with an optimizer the Checkpointer does not hold: its step waits
for the background copy too, so the checkpoint is exactly the state at save(step).

A fused kernel (``fused=True``) changes the parameters without bumping their version
counters, so the version check cannot see it: only the wait keeps the copy whole.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn
from torch.optim import optimizer as torch_optimizer

import unbroken as ub
from unbroken.core import staging


def _fused_or_foreach() -> dict:
    """``fused=True`` where this CPU build has fused AdamW, else ``foreach=True``."""
    try:
        p = nn.Parameter(torch.zeros(2))
        p.grad = torch.ones(2)
        torch.optim.AdamW([p], fused=True).step()
    except (RuntimeError, NotImplementedError):
        return {"foreach": True}
    return {"fused": True}


class Unheld:
    """One model; AdamW (held by the Checkpointer) trains the first layer, a second AdamW
    (not held, fused where possible) trains the last one and steps first."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.held = torch.optim.AdamW(self.model[0].parameters(), lr=1e-2)
        self.other = torch.optim.AdamW(self.model[2].parameters(), lr=1e-2, **_fused_or_foreach())

    def step(self) -> None:
        x = torch.randn(16, 4)
        loss = (self.model(x) - torch.sin(x).sum(1, keepdim=True)).pow(2).mean()
        self.held.zero_grad()
        self.other.zero_grad()
        loss.backward()
        self.other.step()  # the unheld optimizer first: nothing held has waited yet
        self.held.step()

    def saved_state(self) -> dict[str, torch.Tensor]:
        out = {f"model/{k}": v.clone() for k, v in self.model.state_dict().items()}
        for i, st in self.held.state_dict()["state"].items():
            out.update({f"held/{i}/{k}": v.clone() for k, v in st.items()})
        return out


@pytest.fixture
def held_copy(monkeypatch):
    """The background copy waits for ``release`` (set by the unheld optimizer's post-step
    hook, or by a timer should the step itself wait for the copy)."""
    release = threading.Event()
    original = staging.StagingBuffers.copy

    def held(self, flat, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            assert release.wait(30)
        return original(self, flat, **kwargs)

    monkeypatch.setattr(staging.StagingBuffers, "copy", held)
    return release


def test_an_unheld_fused_optimizer_waits_for_the_copy(tmp_path, held_copy):
    t = Unheld()
    for _ in range(2):
        t.step()
    want = t.saved_state()
    hooks = getattr(torch_optimizer, "_global_optimizer_pre_hooks", {})  # torch's registry
    hooks_before = len(hooks)
    ckpt = ub.Checkpointer(tmp_path / "c", model=t.model, optimizer=t.held, async_save="overlap")
    ckpt.save(2)
    # Without the wait, the unheld step changes the last layer before the copy runs, and
    # its post-step hook only then lets the copy go: a torn checkpoint, deterministically.
    handle = t.other.register_step_post_hook(lambda *a: held_copy.set())
    timer = threading.Timer(0.2, held_copy.set)  # with the wait, the step is held: go on
    timer.start()
    try:
        t.step()
        t.step()
    finally:
        timer.cancel()
        handle.remove()
    ckpt.close()
    assert ckpt.steps() == [2]
    assert len(hooks) == hooks_before  # no hook left behind

    fresh = Unheld(seed=5)
    report = ub.Checkpointer(tmp_path / "c", model=fresh.model, optimizer=fresh.held).restore()
    assert report.step == 2 and report.verified
    got = fresh.saved_state()
    assert got.keys() == want.keys()
    for k in want:
        assert want[k].dtype == got[k].dtype and torch.equal(want[k], got[k]), k
