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


def build_fsdp1(
    seed: int = 0,
    *,
    use_orig_params: bool = False,
    policy: str = "block",
    checkpointing: bool = False,
    bf16: bool = False,
    sharding: str = "FULL_SHARD",
    hybrid: str | None = None,
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """FSDP1 on the default process group (CPU, gloo). ``policy``: ``"block"`` wraps each
    Block, ``"size"`` wraps by size (each ``fc`` alone), ``"none"`` only the root;
    ``checkpointing`` adds activation checkpointing to each Block after wrapping; ``bf16``
    computes in bf16 over fp32 master parameters (``MixedPrecision``); ``sharding`` names
    the ShardingStrategy. ``hybrid`` (with a hybrid ``sharding``) lays the ranks out as
    (replicas, 2): ``"mesh"`` gives FSDP a 2-D device mesh, ``"groups"`` the process
    groups of :func:`hybrid_groups`."""
    import functools

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy

    torch.manual_seed(seed)
    wrap = {
        "block": ModuleWrapPolicy({Block}),
        "size": functools.partial(size_based_auto_wrap_policy, min_num_params=100),
        "none": None,
    }[policy]
    layout: dict = {}
    if hybrid == "mesh":
        from torch.distributed.device_mesh import init_device_mesh

        world = torch.distributed.get_world_size()
        layout["device_mesh"] = init_device_mesh("cpu", (world // 2, 2))
    elif hybrid == "groups":
        layout["process_group"] = hybrid_groups(2)
    model = FSDP(
        Net(),
        auto_wrap_policy=wrap,
        device_id=torch.device("cpu"),
        use_orig_params=use_orig_params,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16) if bf16 else None,
        sharding_strategy=ShardingStrategy[sharding],
        **layout,
    )
    if checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            apply_activation_checkpointing,
        )

        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt


def hybrid_groups(shard_size: int) -> tuple:
    """FSDP1 hybrid sharding's ``(intra, inter)`` process groups of this rank: ranks
    sharded in consecutive groups of ``shard_size``, replicated across groups (collective:
    every rank creates every group, in the same order)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    replicas = world // shard_size
    intra = [
        dist.new_group(list(range(i * shard_size, (i + 1) * shard_size))) for i in range(replicas)
    ]
    inter = [dist.new_group(list(range(j, world, shard_size))) for j in range(shard_size)]
    return intra[rank // shard_size], inter[rank % shard_size]


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


def full_state(model, opt, *, cpu_offload: bool = True) -> dict:
    """Gathered, unsharded model and optimizer state keyed by FQN (collective).
    ``cpu_offload=False`` for FSDP1 on CPU, whose rank-0-only gather fails there."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(
        model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)
    )
    # Deep copy: CPU tensors such as AdamW's ``step`` come back as the live objects.
    return copy.deepcopy({"model": msd, "optimizer": osd.get("state", {})})


def assert_same_full_state(got: dict, want: dict) -> None:
    """Two :func:`full_state` results equal bit for bit, dtypes and keys included."""
    assert got["model"].keys() == want["model"].keys()
    for fqn, t in want["model"].items():
        assert got["model"][fqn].dtype == t.dtype, fqn
        assert torch.equal(got["model"][fqn], t), fqn
    assert got["optimizer"].keys() == want["optimizer"].keys()
    for fqn, entries in want["optimizer"].items():
        assert got["optimizer"][fqn].keys() == entries.keys(), fqn
        for name, t in entries.items():
            assert got["optimizer"][fqn][name].dtype == t.dtype, (fqn, name)
            assert torch.equal(got["optimizer"][fqn][name], t), (fqn, name)


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
