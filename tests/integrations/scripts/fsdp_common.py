"""What the FSDP integration scripts share: the model, the data, and the gathered state
rank 0 writes for the tests to compare.

The model's widths are 13: no tensor divides evenly over 2 or 3 ranks, and the head's
one-row weight leaves ranks without a row. The data is a function the model learns
(y = sum(sin(x)) + x0*x1/2), so a lost optimizer state or data position shows.

The gathered state is a reference that does not go through unbroken: torch's own
``get_state_dict`` collects every shard (a collective: every rank calls it).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

WIDTH = 13


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.drop(x))


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(512, 8, generator=g)
    y = torch.sin(x).sum(dim=1, keepdim=True) + 0.5 * x[:, :1] * x[:, 1:2]
    return torch.utils.data.TensorDataset(x, y)


def full_state(model: nn.Module, optimizers: Any) -> dict[str, Any]:
    """Model and optimizer state gathered whole, keyed by FQN (collective).
    ``cpu_offload=False``: FSDP1's rank-0-only gather fails on CPU tensors."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    model_state, optim_state = get_state_dict(model, optimizers, options=options)
    # Deep copy: some tensors (AdamW's ``step``) come back as the live objects.
    return copy.deepcopy({"model": dict(model_state), "optimizer": optim_state})


def write(folder: str | None, name: str, payload: dict[str, Any]) -> None:
    """Rank 0 saves ``payload`` as ``folder/name.pt`` (nothing without ``folder``)."""
    if folder is None or (dist.is_initialized() and dist.get_rank() != 0):
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    path = Path(folder) / f"{name}.pt"
    torch.save(payload, f"{path}.tmp")
    os.replace(f"{path}.tmp", path)


def parameter_kinds(optimizer: torch.optim.Optimizer) -> list[str]:
    """The classes of the parameters ``optimizer`` holds (FSDP1: ``FlatParameter`` or, with
    ``use_orig_params``, ``Parameter``; FSDP2: ``DTensor``), sorted, once each."""
    from torch.distributed.fsdp import FlatParameter  # a Parameter whose isinstance differs

    return sorted(
        {
            "FlatParameter" if isinstance(p, FlatParameter) else type(p).__name__
            for g in optimizer.param_groups
            for p in g["params"]
        }
    )


def report_fields(report: Any) -> dict[str, Any]:
    """The parts of a ``RestoreReport`` the tests check, as plain values."""
    return {
        "step": report.step,
        "restored": report.restored,
        "resharded": report.resharded,
        "verified": report.verified,
        "saved_world_size": report.saved_world_size,
        "world_size": report.world_size,
        "components": dict(report.components),
    }


def differences(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """Where two :func:`full_state` results differ (keys, dtypes, values bit for bit,
    param groups' settings and parameters); empty when they are the same."""
    found = []
    if got["model"].keys() != want["model"].keys():
        found.append(f"model keys: {sorted(got['model'])} != {sorted(want['model'])}")
    for fqn, t in want["model"].items():
        other = got["model"].get(fqn)
        if other is not None and (other.dtype != t.dtype or not torch.equal(other, t)):
            found.append(f"model {fqn}")
    got_state, want_state = got["optimizer"]["state"], want["optimizer"]["state"]
    if got_state.keys() != want_state.keys():
        found.append(f"optimizer state keys: {sorted(got_state)} != {sorted(want_state)}")
    for fqn, entries in want_state.items():
        for name, t in entries.items():
            other = got_state.get(fqn, {}).get(name)
            if other is None or other.dtype != t.dtype or not torch.equal(other, t):
                found.append(f"optimizer {fqn} {name}")

    def groups(state: dict) -> list[tuple[dict, list]]:
        return [({k: v for k, v in g.items() if k != "params"}, sorted(g["params"]))
                for g in state["optimizer"]["param_groups"]]  # fmt: skip

    if groups(got) != groups(want):
        found.append(f"param groups: {groups(got)} != {groups(want)}")
    return found
