"""Gathers across a process group that move tensors as raw bytes: whatever the dtype,
every value arrives bit for bit (nothing is cast or reduced on the way). The
integrations use them to put whole tensors together from the shards a framework keeps."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def gather_bytes(local: torch.Tensor, group: Any, world: int) -> list[torch.Tensor]:
    """Every rank's ``local`` (same size and dtype everywhere), as bytes moved unchanged."""
    if world == 1:
        return [local.detach().reshape(-1)]
    raw = _bytes(local)
    out = [torch.empty_like(raw) for _ in range(world)]
    dist.all_gather(out, raw, group=group)
    return [o.view(local.dtype) for o in out]


def gather_uneven(local: torch.Tensor, group: Any, world: int) -> list[torch.Tensor]:
    """Every rank's 1-D ``local`` of the same dtype, sizes that may differ by rank."""
    if world == 1:
        return [local.detach().reshape(-1)]
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([local.numel()], dtype=torch.int64), group=group)
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=local.dtype)
    padded[: local.numel()] = local.detach().reshape(-1).cpu()
    parts = gather_bytes(padded, group, world)
    return [p[: int(n)] for p, n in zip(parts, sizes, strict=True)]
