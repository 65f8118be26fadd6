"""Parts of a model that no optimizer trains (issue 26, item 16).

An EMA (``torch.optim.swa_utils.AveragedModel``) or a frozen tower in the dict of models is
normal: ``unbroken verify`` passes such a checkpoint, saying so in a warning, and it
resumes bit for bit. Optimizer state that fits no parameter or group still fails.
"""

from __future__ import annotations

import json

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from typer.testing import CliRunner

import unbroken as ub


class EmaRun:
    """A model trained by AdamW and its EMA, both passed to the Checkpointer."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.ema = AveragedModel(self.net, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        self.opt = torch.optim.AdamW(self.net.parameters(), lr=3e-2)

    def step(self) -> float:
        x = torch.randn(16, 4)
        loss = (self.net(x) - torch.sin(x).sum(dim=1, keepdim=True)).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.ema.update_parameters(self.net)
        return loss.item()

    def checkpointer(self, path):
        return ub.Checkpointer(path, model={"net": self.net, "ema": self.ema}, optimizer=self.opt)


def test_verify_passes_an_ema_beside_the_model_with_a_warning(tmp_path):
    """The EMA's parameters are in no param group: a warning naming them, not a failure;
    the command exits 0."""
    run = EmaRun()
    for _ in range(3):
        run.step()
    run.checkpointer(tmp_path).save(3)

    report = ub.verify_checkpoint(tmp_path)
    (checked,) = report.checkpoints
    assert report.ok and checked.failures == []
    (warning,) = [w for w in checked.warnings if "no optimizer param group" in w]
    assert "ema.module.0.weight" in warning and "AveragedModel" in warning

    from unbroken.cli import app

    result = CliRunner().invoke(app, ["verify", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.stdout + result.stderr
    assert json.loads(result.stdout)["ok"] is True


def test_an_ema_beside_the_model_resumes_exactly(tmp_path):
    straight = EmaRun()
    expected = [straight.step() for _ in range(8)]

    first = EmaRun()
    for _ in range(4):
        first.step()
    first.checkpointer(tmp_path).save(4)

    resumed = EmaRun()
    assert resumed.checkpointer(tmp_path).restore().verified
    assert [resumed.step() for _ in range(4)] == expected[4:]
    for name in ("net", "ema"):
        want = getattr(straight, name).state_dict()
        got = getattr(resumed, name).state_dict()
        for k, v in want.items():
            assert v.dtype == got[k].dtype and torch.equal(v, got[k]), (name, k)
