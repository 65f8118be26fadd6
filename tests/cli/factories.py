"""``--model`` factories for the import tests (zero-argument callables)."""

from __future__ import annotations

import torch
from torch import nn


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.out = nn.Linear(6, 2)
        self.register_buffer("scale", torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inp(x))) * self.scale


def model_only() -> nn.Module:
    torch.manual_seed(0)
    return Small()


def model_and_adamw() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = model_only()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def model_and_grouped_adamw() -> tuple[nn.Module, torch.optim.Optimizer]:
    """nanoGPT-style groups: matrices (decayed) first, then vectors; not model order."""
    model = model_only()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    return model, torch.optim.AdamW(groups, lr=1e-2)


def model_and_sgd() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = model_only()
    return model, torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)


def not_a_model() -> int:
    return 3


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, sched=None) -> list[float]:
    losses = []
    for step in steps:
        x, y = batch(step)
        loss = (model(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses
