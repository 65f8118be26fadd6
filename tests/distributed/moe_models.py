"""A small mixture-of-experts layer whose experts are sharded over an expert-parallel mesh
dimension (a DTensor ``Shard(0)`` on the expert dim, as torchtitan does), with FSDP2 over
the data-parallel dimension for the rest (and for the experts again: ``_StridedShard``)."""

from __future__ import annotations

import torch
from torch import nn

EXPERTS, WIDTH = 4, 8


class MoE(nn.Module):
    def __init__(self, ep_mesh=None) -> None:
        super().__init__()
        self.router = nn.Linear(WIDTH, EXPERTS)
        experts = torch.randn(EXPERTS, WIDTH, WIDTH) * 0.1
        if ep_mesh is not None:
            from torch.distributed.tensor import Shard, distribute_tensor

            experts = distribute_tensor(experts, ep_mesh, [Shard(0)])
        self.experts = nn.Parameter(experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        gate = torch.softmax(self.router(x), -1)
        w = self.experts.full_tensor() if isinstance(self.experts, DTensor) else self.experts
        out = torch.einsum("bd,edf->bef", x, w)
        return x + (gate.unsqueeze(-1) * out).sum(1)


def build(seed: int, *, dp: int = 1, ep: int = 1) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The MoE and a head on a ("dp", "ep") mesh of ``dp * ep`` ranks (plain with 1, 1)."""
    torch.manual_seed(seed)
    mesh = None
    if dp * ep > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dp, ep), mesh_dim_names=("dp", "ep"))
    model = nn.Sequential(
        MoE(mesh["ep"] if mesh is not None and ep > 1 else None), nn.Linear(WIDTH, 3)
    )
    if mesh is not None and dp > 1:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model[0], mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train(model, opt, steps: int, *, start: int, dp_rank: int) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 * step + dp_rank)
        x = torch.randn(4, WIDTH, generator=g)
        loss = (model(x) - torch.sin(x).sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
