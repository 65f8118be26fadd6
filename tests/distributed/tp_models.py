"""A small transformer-like MLP stack under torchtitan's layouts: tensor parallelism
(Colwise/Rowwise) inside each FSDP2 group, and the layouts it reshards to."""

from __future__ import annotations

import torch
from torch import nn

WIDTH, HIDDEN = 8, 16


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MLP() for _ in range(2))
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build(seed: int, *, dp: int = 1, tp: int = 1) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The stack on a ("dp", "tp") mesh of ``dp * tp`` ranks: TP (up colwise, down
    rowwise) over "tp" where ``tp > 1``, then FSDP2 over "dp" where ``dp > 1`` (FSDP2
    shards TP-sharded weights again: ``_StridedShard``); plain with ``dp = tp = 1``."""
    torch.manual_seed(seed)
    model = Stack()
    if dp * tp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        if tp > 1:
            from torch.distributed.tensor.parallel import (
                ColwiseParallel,
                RowwiseParallel,
                parallelize_module,
            )

            for layer in model.layers:
                parallelize_module(
                    layer, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()}
                )
        if dp > 1:
            from torch.distributed.fsdp import fully_shard

            for layer in model.layers:
                fully_shard(layer, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def batch(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable batch (y = sum of sin(x)), the same on every rank of a TP group."""
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    x = torch.randn(4, WIDTH, generator=g)
    return x, torch.sin(x).sum(1, keepdim=True).expand(4, 3)


def train(model, opt, steps: int, *, start: int, dp_rank: int) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        x, y = batch(step, dp_rank)
        loss = (model(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
