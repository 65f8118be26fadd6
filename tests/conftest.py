"""Shared fixtures: small learnable training problems built the same way every time."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))


class TinyNet(nn.Module):
    def __init__(self, width: int = 8, dropout: float = 0.1) -> None:
        super().__init__()
        self.inp = nn.Linear(4, width)
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(width, 1)
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += x.shape[0]
        return self.out(self.drop(torch.tanh(self.inp(x))))


class Problem:
    """A learnable regression (y = sum of sin(x)), a model, AdamW and a warm-up schedule."""

    def __init__(self, seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
        torch.manual_seed(seed)
        self.model = TinyNet().to(dtype)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-2, weight_decay=0.01)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / 4))
        self.dtype = dtype

    def step(self) -> float:
        x = torch.randn(16, 4).to(self.dtype)  # draws from the global RNG: resume must restore it
        y = torch.sin(x).sum(dim=1, keepdim=True)
        loss = (self.model(x) - y).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.sched.step()
        return loss.item()

    def checkpointer(self, path, **kwargs):
        import unbroken as ub

        kwargs.setdefault("optimizer", self.opt)
        kwargs.setdefault("scheduler", self.sched)
        return ub.Checkpointer(path, model=self.model, **kwargs)


@pytest.fixture
def problem() -> Problem:
    return Problem()


@pytest.fixture
def ckpt_dir(tmp_path):
    return tmp_path / "ckpts"


def assert_same_training_state(a: Problem, b: Problem) -> None:
    """Model and optimizer state equal bit for bit, dtypes included."""
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    oa, ob = a.opt.state_dict(), b.opt.state_dict()
    assert oa["param_groups"] == ob["param_groups"]
    assert oa["state"].keys() == ob["state"].keys()
    for i in oa["state"]:
        for k, v in oa["state"][i].items():
            w = ob["state"][i][k]
            assert v.dtype == w.dtype and torch.equal(v, w), (i, k)
