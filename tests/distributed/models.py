"""Small models and training steps shared by the distributed tests."""

from __future__ import annotations

import copy

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(self.norm(x)))


class Net(nn.Module):
    """Uneven sizes on purpose, so shards differ in length across world sizes."""

    def __init__(self, width: int = 13, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(seed: int = 0, *, fsdp_mesh=None) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    if fsdp_mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, mesh=fsdp_mesh)
        fully_shard(model, mesh=fsdp_mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt


def train_steps(model, opt, steps: int, *, rank: int = 0, start: int = 0) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(4, 13, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def full_state(model, opt) -> dict:
    """Gathered, unsharded model and optimizer state keyed by FQN (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(
        model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    # Deep copy: CPU tensors such as AdamW's ``step`` come back as the live objects.
    return copy.deepcopy({"model": msd, "optimizer": osd.get("state", {})})


def save_trained_fsdp(rank: int, world: int, path: str) -> dict | None:
    """Worker: FSDP2 on ``world`` ranks, 3 steps, saved as step 3; rank 0 returns the
    full (gathered) state to compare against."""
    from torch.distributed.device_mesh import init_device_mesh

    import unbroken as ub

    mesh = init_device_mesh("cpu", (world,))
    model, opt = build(fsdp_mesh=mesh)
    train_steps(model, opt, 3, rank=rank)
    ub.Checkpointer(path, model=model, optimizer=opt).save(3)
    full = full_state(model, opt)
    return full if rank == 0 else None
