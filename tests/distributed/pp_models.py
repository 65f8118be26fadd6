"""One model split into pipeline stages, as torchtitan splits it: each stage is the whole
model with the other stages' layers deleted (FQNs kept), trained with
``torch.distributed.pipelining``."""

from __future__ import annotations

import torch
from torch import nn

LAYERS, WIDTH = 4, 8


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp: nn.Module | None = nn.Linear(4, WIDTH)
        self.layers = nn.ModuleDict({str(i): nn.Linear(WIDTH, WIDTH) for i in range(LAYERS)})
        self.out: nn.Module | None = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inp is not None:
            x = self.inp(x)
        for layer in self.layers.values():
            x = torch.tanh(layer(x))
        return self.out(x) if self.out is not None else x


def build(seed: int, stage: int = 0, stages: int = 1) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Stage ``stage`` of ``stages`` (the whole model with 1): the same initial values
    whatever the split (the whole model is built, then the other stages' parts deleted)."""
    torch.manual_seed(seed)
    model = Net()
    per = LAYERS // stages
    for key in list(model.layers):
        if not stage * per <= int(key) < (stage + 1) * per:
            del model.layers[key]
    if stage != 0:
        model.inp = None
    if stage != stages - 1:
        model.out = None
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 4, generator=g)
    return x, torch.sin(x).sum(1, keepdim=True)


def schedule(model: nn.Module, stage: int, stages: int):
    """GPipe over ``stages`` ranks (the default group), two microbatches, MSE loss."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    pipe = PipelineStage(model, stage, stages, device=torch.device("cpu"))
    return ScheduleGPipe(pipe, n_microbatches=2, loss_fn=nn.functional.mse_loss)


def train(model, opt, sched, steps: int, *, start: int, stage: int, stages: int) -> list[float]:
    """Train ``steps`` steps; the last stage returns each step's mean microbatch loss."""
    losses: list[float] = []
    for step in range(start, start + steps):
        x, y = batch(step)
        opt.zero_grad()
        if stages == 1:
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            losses.append(loss.item())
        elif stage == 0:
            sched.step(x)
        elif stage == stages - 1:
            parts: list[torch.Tensor] = []
            sched.step(target=y, losses=parts)
            losses.append(torch.stack(parts).mean().item())
        else:
            sched.step()
        opt.step()
    return losses
