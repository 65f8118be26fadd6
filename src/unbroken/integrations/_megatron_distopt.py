"""Megatron-Core's ``DistributedOptimizer`` seen per parameter (DESIGN.md F3, F4, F5).

The DistributedOptimizer cuts each bucket of Megatron's flat grad buffer into one
contiguous range per data-parallel (DP) rank, whatever the parameter boundaries. A rank
keeps the fp32 main weight and the torch optimizer's state (Adam's ``exp_avg``,
``exp_avg_sq``, ``step``) only for its range: for each parameter it touches, a 1-D piece
(``shard_fp32_from_float16_groups``, or for an fp32 parameter ``shard_fp32_groups``, a
view of the parameter itself), keyed in the torch optimizer by that piece.

:class:`DistOptLeaf` gives, for every parameter of the model chunk, the whole main weight
(under ``main_param``) and whole state entries in their own dtypes: what Megatron's
non-distributed optimizer holds for it, so a checkpoint from either restores into the
other, at any DP size. Capturing is collective over the DP group: one exchange of the
small entries (scalars, which keys each rank holds) and one all-gather of raw bytes per
bucket and state entry, so every value comes back bit for bit. Restoring is local: each
rank writes its own range of each whole tensor into its pieces. A restored compute weight
refreshes this rank's piece of its main weight (``refresh_main``), so a restore with the
optimizer reset starts from the restored weights (F4).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ._byte_gather import gather_bytes
from ._megatron_state import MAIN_PARAM


@dataclasses.dataclass
class _Piece:
    """This rank's range of one parameter."""

    stepped: torch.Tensor  # what the torch optimizer steps: the fp32 main piece, or a view
    has_main: bool  # stepped is a main weight (the parameter is bf16/fp16)
    start: int  # the range in the parameter, flattened
    end: int
    local: int  # where the range starts in this rank's part of its bucket


@dataclasses.dataclass
class _Agreed:
    """What every DP rank holds of a DistributedOptimizer, as exchanged."""

    dtypes: dict[str, torch.dtype]  # shaped entry -> its dtype
    shaped: dict[nn.Parameter, set[str]]  # parameter -> the shaped entries it has
    scalars: dict[nn.Parameter, dict[str, Any]]  # parameter -> its scalar entries


@dataclasses.dataclass
class _Bucket:
    """One bucket of a grad buffer: its parameters' places in it, its DP group."""

    places: dict[nn.Parameter, tuple[int, int]]  # parameter -> (start, end) in the bucket
    share: int  # elements each DP rank owns
    group: Any
    world: int


def check_distributed(leaf: Any, where: str) -> None:
    """Refuse a DistributedOptimizer whose state this cannot capture exactly.

    Raises:
        TypeError: ``leaf`` keeps its state outside torch's optimizer (precision-aware
            optimizer, CPU offload) or uses Megatron-FSDP.
        ValueError: parameters gathered in the background (``overlap_param_gather``).
    """
    config = leaf.config
    ddp = leaf.ddp_config
    if getattr(ddp, "use_megatron_fsdp", False):
        raise TypeError(
            f"{where} is a DistributedOptimizer over Megatron-FSDP (use_megatron_fsdp=True), "
            "whose parameters and state this does not map; build the model with Megatron's "
            "DistributedDataParallel (use_megatron_fsdp=False)"
        )
    if getattr(config, "use_precision_aware_optimizer", False):
        raise TypeError(
            f"{where} keeps its main weights and state in Transformer Engine's fused Adam "
            "(use_precision_aware_optimizer=True), not in a torch optimizer: it cannot be "
            "saved exactly; build it with use_precision_aware_optimizer=False"
        )
    if type(leaf.optimizer).__name__ == "HybridDeviceOptimizer":
        raise TypeError(
            f"{where} offloads its state to the CPU (HybridDeviceOptimizer, "
            "optimizer_cpu_offload=True), which keeps copies this does not map; build it "
            "with optimizer_cpu_offload=False"
        )
    if getattr(ddp, "fp8_param_gather", False):
        raise TypeError(
            f"{where} gathers fp8 parameters (fp8_param_gather=True), whose compute weights "
            "are not the bf16 tensors this saves; build with fp8_param_gather=False"
        )
    if getattr(ddp, "overlap_param_gather", False):
        raise ValueError(
            f"{where} gathers the updated parameters in the background of the next forward "
            "pass (overlap_param_gather=True): at a save, each rank holds only its own range "
            "of the new weights and stale values elsewhere, so the compute weights saved "
            "would be wrong. Build with overlap_param_gather=False"
        )


class DistOptLeaf:
    """One ``DistributedOptimizer`` as per-parameter state over its model parameters.

    Args:
        leaf: the DistributedOptimizer (checked by :func:`check_distributed`).
        names: the model chunk's parameter -> FQN (FQNs name parameters across ranks).
    Raises:
        ValueError: the optimizer steps a parameter not in ``names``, or a parameter of
            the buffers is stepped by no DP rank.
    """

    def __init__(self, leaf: Any, names: Mapping[nn.Parameter, str]) -> None:
        self.leaf = leaf
        self.torch_optimizer: torch.optim.Optimizer = leaf.optimizer
        self._names = dict(names)
        self._group = leaf.data_parallel_group
        self._world = dist.get_world_size(self._group) if dist.is_initialized() else 1
        self._buckets = [
            _Bucket(
                {
                    p: (start - bucket.offset, end - bucket.offset)
                    for p, (start, end, b) in buffer.param_index_map.items()
                    if b == index
                },
                bucket.grad_data.numel() // buffer.data_parallel_group.size(),
                buffer.data_parallel_group,
                buffer.data_parallel_group.size(),
            )
            for buffer in leaf.buffers
            for index, bucket in enumerate(buffer.buckets)
        ]
        # The buffers hold every parameter the optimizer steps, the same on every rank: a
        # foreign one is refused by all ranks alike, before any collective.
        for bucket in self._buckets:
            for p in bucket.places:
                if p not in self._names:
                    raise ValueError(
                        f"the optimizer steps a parameter (shape {tuple(p.shape)}) that is "
                        "not one of the model chunk's: pass the model chunk the optimizer "
                        "was built for"
                    )
        self._pieces: dict[nn.Parameter, _Piece] = {}
        pairs = [
            (model, main, True)
            for models, mains in zip(
                leaf.model_float16_groups, leaf.shard_fp32_from_float16_groups, strict=True
            )
            for model, main in zip(models, mains, strict=True)
        ]
        pairs += [
            (model, shard, False)
            for models, shards in zip(leaf.model_fp32_groups, leaf.shard_fp32_groups, strict=True)
            for model, shard in zip(models, shards, strict=True)
        ]
        for model, stepped, has_main in pairs:
            buffer, dtypes, bucket = leaf.model_param_gbuf_map[model]
            ranges = leaf.gbuf_ranges[buffer][dtypes][bucket]["param_map"][model]
            within, local = ranges["param"], ranges["gbuf_local"]
            if stepped.numel() != within.end - within.start:
                raise ValueError(
                    f"the DistributedOptimizer's piece of {self._names[model]} holds "
                    f"{stepped.numel()} elements, its range {within.end - within.start}: "
                    "a layout this does not know (another megatron-core version?)"
                )
            self._pieces[model] = _Piece(stepped, has_main, within.start, within.end, local.start)
        self.params = [p for p in names if any(p in b.places for b in self._buckets)]
        self._groups = self._group_members()

    @property
    def grad_scaler(self) -> Any:
        return getattr(self.leaf, "grad_scaler", None)

    def _exchange(self, mine: Any) -> list[Any]:
        if self._world == 1:
            return [mine]
        out: list[Any] = [None] * self._world
        dist.all_gather_object(out, mine, group=self._group)
        return out

    def _group_members(self) -> list[list[nn.Parameter]]:
        """Each param group's parameters (of every DP rank), in the chunk's order: a rank's
        torch optimizer holds only the pieces of its own range."""
        index = self.leaf.model_param_group_index_map
        mine = {self._names[p]: index[p][0] for p in self._pieces}
        where: dict[str, int] = {}
        for theirs in self._exchange(mine):
            where.update(theirs)
        by_name = {self._names[p]: p for p in self.params}
        lost = sorted(set(by_name) - set(where))
        if lost:
            raise ValueError(
                f"the DistributedOptimizer steps no range of parameter(s) {lost[:5]} on any "
                "data-parallel rank: they cannot be saved"
            )
        groups: list[list[nn.Parameter]] = [[] for _ in self.torch_optimizer.param_groups]
        for name, p in by_name.items():
            groups[where[name]].append(p)
        return groups

    def groups(self) -> list[tuple[dict[str, Any], list[nn.Parameter]]]:
        return list(zip(self.torch_optimizer.param_groups, self._groups, strict=True))

    def state(self) -> dict[nn.Parameter, dict[str, Any]]:
        """Every parameter's whole main weight and state entries (collective over DP)."""
        agreed = self._agree()
        out: dict[nn.Parameter, dict[str, Any]] = {p: dict(agreed.scalars[p]) for p in self.params}
        for key, dtype in agreed.dtypes.items():
            for bucket in self._buckets:
                self._gather_bucket(bucket, key, dtype, agreed.shaped, out)
        return out

    def _local_entries(self, piece: _Piece) -> dict[str, Any]:
        entries = dict(self.torch_optimizer.state.get(piece.stepped, {}))
        if piece.has_main:
            entries[MAIN_PARAM] = piece.stepped.detach()
        return entries

    def _described(self) -> dict[str, tuple[dict[str, str], dict[str, Any]]]:
        """This rank's entries per parameter FQN: (shaped entry -> dtype name, scalar
        entry -> (value on the CPU, device type))."""
        mine: dict[str, Any] = {}
        for p, piece in self._pieces.items():
            shaped, small = {}, {}
            for key, value in self._local_entries(piece).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    if value.numel() != piece.end - piece.start:
                        raise ValueError(
                            f"optimizer state {key!r} of {self._names[p]} has shape "
                            f"{tuple(value.shape)}, neither this rank's range of it "
                            f"({piece.end - piece.start} elements) nor a scalar: how it "
                            "splits over data-parallel ranks is unknown"
                        )
                    shaped[key] = str(value.dtype).removeprefix("torch.")
                elif isinstance(value, torch.Tensor):
                    small[key] = (value.detach().cpu(), value.device.type)
                else:
                    small[key] = (value, None)
            mine[self._names[p]] = (shaped, small)
        return mine

    def _agree(self) -> _Agreed:
        """What every rank holds, exchanged: shaped entries must be held by every rank
        with a range of the parameter, and scalars (``step``) be equal on all of them."""
        by_name = {self._names[p]: p for p in self.params}
        seen: dict[str, tuple[dict[str, str], dict[str, Any]]] = {}
        for rank, theirs in enumerate(self._exchange(self._described())):
            for name, (shaped, small) in theirs.items():
                first = seen.setdefault(name, (shaped, small))
                if first[0] != shaped or not _same(first[1], small):
                    raise ValueError(
                        f"the DistributedOptimizer's state of {name} differs between "
                        f"data-parallel ranks (rank {rank} holds {sorted(shaped)} "
                        f"{sorted(small)}, another {sorted(first[0])} {sorted(first[1])}): "
                        "it cannot be made whole"
                    )
        agreed = _Agreed({}, {p: set() for p in self.params}, {p: {} for p in self.params})
        for name, (shaped, small) in seen.items():
            p = by_name[name]
            agreed.shaped[p] = set(shaped)
            for key, dtype in shaped.items():
                # One flat tensor per bucket and entry: one dtype for the entry throughout.
                if agreed.dtypes.setdefault(key, getattr(torch, dtype)) != getattr(torch, dtype):
                    raise ValueError(
                        f"optimizer state {key!r} is {dtype} for {name} but "
                        f"{agreed.dtypes[key]} for another parameter: it cannot be gathered "
                        "in one dtype"
                    )
            for key, (value, device) in small.items():
                if device is not None and device != "cpu":
                    value = value.to(p.device)
                agreed.scalars[p][key] = value
        return agreed

    def _gather_bucket(
        self,
        bucket: _Bucket,
        key: str,
        dtype: torch.dtype,
        holders: Mapping[nn.Parameter, set[str]],
        out: dict[nn.Parameter, dict[str, Any]],
    ) -> None:
        """Entry ``key`` of every parameter of ``bucket`` that holds it, whole: this rank's
        part of the bucket filled from its pieces, every rank's part gathered as bytes."""
        if not any(key in holders[p] for p in bucket.places):
            return  # the same on every rank: none gathers
        device = next(iter(bucket.places)).device
        local = torch.zeros(bucket.share, dtype=dtype, device=device)
        for p in bucket.places:
            piece = self._pieces.get(p)
            value = None if piece is None else self._local_entries(piece).get(key)
            if piece is not None and value is not None:
                n = piece.end - piece.start
                local[piece.local : piece.local + n] = value.detach().reshape(-1)
        full = torch.cat(gather_bytes(local, bucket.group, bucket.world))
        for p, (start, end) in bucket.places.items():
            if key in holders[p]:
                out[p][key] = full[start:end].clone().view(p.shape)

    def load(self, param: nn.Parameter, entry: dict[str, Any]) -> None:
        """Put this rank's range of ``param``'s whole main weight and state in place; the
        values keep their saved dtypes (DESIGN.md F5)."""
        piece = self._pieces.get(param)
        if piece is None:
            return  # no range of it here
        entry = dict(entry)
        main = entry.pop(MAIN_PARAM, None)
        if piece.has_main:
            if main is None:
                raise KeyError(f"no {MAIN_PARAM!r} for parameter {self._names[param]}")
            with torch.no_grad():
                piece.stepped.copy_(main.reshape(-1)[piece.start : piece.end])
        values = {k: self._range(param, piece, k, v) for k, v in entry.items()}
        if values:
            self.torch_optimizer.state[piece.stepped] = values
        else:
            self.torch_optimizer.state.pop(piece.stepped, None)

    def _range(self, param: nn.Parameter, piece: _Piece, key: str, value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value
        if value.numel() != param.numel():
            raise ValueError(
                f"saved optimizer state {key!r} of {self._names[param]} has shape "
                f"{tuple(value.shape)}, not the parameter's {tuple(param.shape)}"
            )
        return value.reshape(-1)[piece.start : piece.end].clone()

    def refresh_main(self, param: nn.Parameter) -> None:
        """This rank's range of ``param``'s main weight from its (restored) compute weight."""
        piece = self._pieces.get(param)
        if piece is not None and piece.has_main:
            with torch.no_grad():
                piece.stepped.copy_(param.detach().reshape(-1)[piece.start : piece.end])


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two ranks' scalar entries (name -> (value, device type)) are the same."""
    if set(a) != set(b):
        return False
    for key, (x, x_device) in a.items():
        y, y_device = b[key]
        if x_device != y_device or isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
                return False
        elif x != y:
            return False
    return True
