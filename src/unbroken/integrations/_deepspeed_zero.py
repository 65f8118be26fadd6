"""DeepSpeed's ZeRO optimizers as per-parameter state (F3, F5).

A ZeRO optimizer keeps its fp32 master weights and optimizer state in flat partitions:
stages 1 and 2 (and the bf16 optimizer of stage 0) cut each parameter group's flat
concatenation into one equal slice per data-parallel rank, whatever the parameter
boundaries; stage 3 cuts every parameter on its own. Neither is a layout another world
size or stage can read, and DeepSpeed's per-parameter API leaves state out (Muon's
momentum at stages 1 and 2, which is not shaped like the partition).

:class:`ZeroLayout` turns one rank's partitions into whole tensors keyed by parameter
(every rank gathering the partitions of its data-parallel group: one collective per
group and state entry), and whole tensors back into this rank's slices (no collective).
What a Checkpointer saves is therefore what a plain model's optimizer would hold, plus
the master weight under :data:`MASTER`: it restores at any world size and stage.
Bytes are gathered as bytes, so every value comes back bit for bit, in its own dtype.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import StateMismatchError
from ._byte_gather import gather_bytes, gather_uneven

MASTER = "fp32_master"  # the optimizer's fp32 copy of a parameter, as a state entry
MUON_MOMENTUM = "momentum_buffer"


@dataclasses.dataclass
class _Slot:
    """Where one parameter lies in its group's flat coordinates (stages 0-2), or its own
    partition (stage 3)."""

    param: nn.Parameter
    start: int  # stages 0-2: offset in the group's flat buffer; stage 3: in the rank's flat
    numel: int


class ZeroLayout:
    """One ZeRO optimizer's flat partitions, seen per parameter.

    Args:
        zero: the engine's optimizer (``DeepSpeedZeroOptimizer``,
            ``DeepSpeedZeroOptimizer_Stage3`` or ``BF16_Optimizer``).
    """

    def __init__(self, zero: Any) -> None:
        self.zero = zero
        self.inner: torch.optim.Optimizer = zero.optimizer  # the torch optimizer over flats
        self.stage3 = hasattr(zero, "fp32_partitioned_groups_flat")
        if self.stage3:
            self.group = zero.dp_process_group
            self.flats = list(zero.fp32_partitioned_groups_flat)
            self.params = [list(g) for g in zero.fp16_groups]
        elif hasattr(zero, "single_partition_of_fp32_groups"):  # stages 1 and 2
            self.group = zero.real_dp_process_group[0]
            self.flats = list(zero.single_partition_of_fp32_groups)
            self.params = [list(g) for g in zero.bit16_groups]
            self.lp_flats = list(zero.bit16_groups_flat)
        else:  # BF16_Optimizer (stage 0 with bf16)
            self.group = zero.real_dp_process_group[0]
            self.flats = list(zero.fp32_groups_flat_partition)
            self.params = [list(g) for g in zero.bf16_groups]
            self.lp_flats = list(zero.bf16_groups_flat)
        self.world = dist.get_world_size(self.group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(self.group) if dist.is_initialized() else 0
        self.slots = [self._slots(g) for g in range(len(self.flats))]

    def _slots(self, g: int) -> list[_Slot]:
        if self.stage3:
            out = []
            for p in self.params[g]:
                _, offset, numel = self.zero.grad_position[self.zero.get_param_id(p)]
                out.append(_Slot(p, offset, numel))
            return out
        flat = self.lp_flats[g]
        base = flat.storage_offset()
        out = []
        for p in self.params[g]:
            if p.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr():
                raise StateMismatchError(
                    f"DeepSpeed parameter group {g}: a parameter of shape {tuple(p.shape)} does "
                    "not lie in the group's flat buffer; this DeepSpeed version lays out ZeRO "
                    "state in a way unbroken does not know"
                )
            out.append(_Slot(p, p.data.storage_offset() - base, p.numel()))
        return out

    # -- what a capture reads ---------------------------------------------------------------

    def state_of(self, g: int) -> dict[str, Any]:
        """The torch optimizer's state of group ``g``'s flat partition (may be empty)."""
        return self.inner.state.get(self.flats[g], {})

    def partition_size(self, g: int) -> int:
        return self.flats[g].numel()

    def whole(self, g: int, local: torch.Tensor) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
        """Each parameter of group ``g`` whole, from every rank's ``local`` flat partition
        (a tensor shaped like the partition: the master weights or one state entry)."""
        parts = gather_bytes(local, self.group, self.world)
        if self.stage3:
            for slot in self.slots[g]:
                pieces = [part[slot.start : slot.start + slot.numel] for part in parts]
                whole = torch.cat(pieces)[: slot.param.ds_numel]
                yield slot.param, whole.reshape(slot.param.ds_shape).clone()
            return
        flat = torch.cat(parts)
        for slot in self.slots[g]:
            yield (
                slot.param,
                flat[slot.start : slot.start + slot.numel].reshape(slot.param.shape).clone(),
            )

    def muon_momentum(self, g: int, local: torch.Tensor) -> dict[nn.Parameter, torch.Tensor]:
        """Stages 1 and 2: Muon's momentum, kept whole for each parameter a rank's partition
        touches (in partition order); a parameter across two partitions is held by both
        ranks alike, and taken from the lower one."""
        parts = gather_uneven(local, self.group, self.world)
        out: dict[nn.Parameter, torch.Tensor] = {}
        for r, part in enumerate(parts):
            at = 0
            for slot in self.touching(g, r):
                if slot.param not in out:
                    piece = part[at : at + slot.numel]
                    out[slot.param] = piece.reshape(slot.param.shape).clone()
                at += slot.numel
        return out

    def touching(self, g: int, rank: int) -> list[_Slot]:
        """Stages 1 and 2: the parameters of group ``g`` whose elements lie in ``rank``'s
        partition, in flat order."""
        size = self.partition_size(g)
        lo, hi = rank * size, (rank + 1) * size
        ordered = sorted(self.slots[g], key=lambda s: s.start)
        return [s for s in ordered if s.start < hi and s.start + s.numel > lo and s.numel]

    # -- what an install writes ----------------------------------------------------------------

    def local_slice(self, g: int, slot: _Slot, whole: torch.Tensor) -> tuple[int, torch.Tensor]:
        """(offset in this rank's flat partition, the elements of ``whole`` that belong
        there) for one parameter; an empty piece where none do."""
        values = whole.detach().reshape(-1)
        if self.stage3:
            lo = self.rank * slot.numel
            piece = values[lo : lo + slot.numel]
            return slot.start, piece
        size = self.partition_size(g)
        lo, hi = self.rank * size, (self.rank + 1) * size
        first, last = max(slot.start, lo), min(slot.start + slot.numel, hi)
        if first >= last:
            return 0, values[:0]
        return first - lo, values[first - slot.start : last - slot.start]

    def write(
        self,
        g: int,
        target: torch.Tensor,
        values: Callable[[nn.Parameter], torch.Tensor],
    ) -> None:
        """Fill this rank's flat partition ``target`` of group ``g`` from each parameter's
        whole tensor (``values(param)``); the padding keeps what it holds."""
        for slot in self.slots[g]:
            at, piece = self.local_slice(g, slot, values(slot.param))
            if piece.numel():
                target[at : at + piece.numel()].copy_(piece)
