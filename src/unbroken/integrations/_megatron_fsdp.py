"""Megatron-FSDP (the ``megatron-fsdp`` package): its model and optimizer as the torch
objects a ``Checkpointer`` saves, keyed by the model's parameter FQNs.

Megatron-FSDP keeps each parameter as rows of flat per-group buffers sharded over the
data-parallel ranks: the fp32 main weight (what the torch optimizer steps, a ``DTensor``
``Shard(0)`` whose local rows are *uneven*: whatever rows of the parameter fell into this
rank's slice of the buffer, often none) and the bf16 compute weight (the same rows of the
model-weight buffer). Torch's ``Shard(0)`` means even blocks (``torch.chunk``), so those
DTensors do not say which rows a rank holds; saved as they are they would land at the
wrong offsets. Here each tensor is moved to an even ``Shard(0)`` DTensor over the same
data-parallel mesh to save, and back to Megatron-FSDP's rows to restore (an all-gather of
the one parameter on the data-parallel group, then this rank's block).

``ModelView`` gives the compute weights; ``OptimizerView`` the torch optimizer's state per
parameter (``exp_avg``, ``exp_avg_sq``, ``step``) and the fp32 main weight
(``main_param``): the same names and layout as ``unbroken.integrations.megatron`` uses for
Megatron's DDP; being even DTensors, they restore at another data-parallel size. Both
weights are written back before the first step, and the Checkpointer's recapture after
the install fingerprints both (DESIGN.md F4).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ..checkpointer import Checkpointer
from ._byte_gather import gather_bytes
from ._megatron_state import MAIN_PARAM, RNGTrackerState

# The vendored copy inside megatron-core: its optimizer state_dict() is the empty dict it
# captured when the optimizer was wrapped, and Megatron-LM drives it through its own
# DistributedOptimizer; neither is what this maps.
_VENDORED = "megatron.core."


def is_megatron_fsdp(model: Any) -> bool:
    """Whether ``model`` (or the one model in a list, as Megatron's ``get_model`` returns)
    is a Megatron-FSDP wrapper (the package's or megatron-core's)."""
    model = _one(model)
    return any(
        cls.__name__ in ("MegatronFSDP", "FullyShardedDataParallel")
        and cls.__module__.startswith(("megatron_fsdp", "megatron.core.distributed.fsdp"))
        for cls in type(model).__mro__
    )


def checkpointer_for(
    given: Any, optimizer: Any, path: str, extra: dict[str, Any], **args: Any
) -> Checkpointer:
    """The Checkpointer over a ``megatron_fsdp.MegatronFSDP`` model and the torch
    optimizer wrapped by ``megatron_fsdp.fully_shard_optimizer`` (see
    ``unbroken.integrations.megatron.checkpointer_for``)."""
    model = _one(given)
    _check_wrapper(model)
    layout = Layout(model)
    model_view = ModelView(model, layout)
    optimizer_view = OptimizerView(optimizer, model_view)
    if _is_megatron_core_model(layout.chunk):
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        extra["megatron_rng"] = RNGTrackerState(get_cuda_rng_tracker)
        extra["megatron_rng"].state_dict()  # refuses a tracker it cannot save, now
    user_probe = args.pop("probe", None)
    if user_probe is not None:
        args["probe"] = lambda _view: user_probe(given)
    return Checkpointer(path, model=model_view, optimizer=optimizer_view, extra=extra, **args)


def _one(model: Any) -> Any:
    if isinstance(model, list | tuple) and len(model) == 1:
        return model[0]
    return model


def _check_wrapper(model: nn.Module) -> None:
    kind = type(model)
    if kind.__module__.startswith(_VENDORED):
        raise TypeError(
            f"model is megatron-core's vendored Megatron-FSDP ({kind.__module__}."
            f"{kind.__qualname__}); checkpointer_for saves the separate megatron-fsdp "
            "package's MegatronFSDP: pip install megatron-fsdp==0.6.1 and wrap the model "
            "with megatron_fsdp.MegatronFSDP and the optimizer with "
            "megatron_fsdp.fully_shard_optimizer (the vendored copy's optimizer "
            "state_dict() is empty, so its own checkpoints lose the optimizer state)"
        )
    strategy = model.ddp_config.data_parallel_sharding_strategy
    if strategy != "optim_grads_params":
        raise ValueError(
            f"Megatron-FSDP sharding strategy {strategy!r} is not supported: only "
            "'optim_grads_params' (ZeRO-3, the default) keeps the compute and main weights "
            "as the same rows of each rank's buffers. Wrap with zero_dp_strategy=3 "
            "(fully_shard_model) or data_parallel_sharding_strategy='optim_grads_params' "
            "(MegatronFSDP's DistributedDataParallelConfig)"
        )


def _is_megatron_core_model(module: nn.Module) -> bool:
    return any(c.__module__.startswith("megatron.core.") for c in type(module).__mro__)


class Layout:
    """Where each parameter's rows live: the fp32 main weight (a DTensor whose local rows
    are this rank's uneven share), the compute weight (the same rows of the model-weight
    buffer), and how many rows every rank of the data-parallel group holds."""

    def __init__(self, model: nn.Module) -> None:
        buffer = model.param_and_grad_buffer
        # FQNs are the innermost model's: Megatron's Float16Module adds a ``module.``.
        self.chunk = model.module
        while type(self.chunk).__name__ == "Float16Module":
            self.chunk = self.chunk.module
        prefix = next(n for n, m in model.module.named_modules() if m is self.chunk)
        prefix = prefix + "." if prefix else ""
        self.stepped: dict[str, nn.Parameter] = {}  # FQN -> the parameter the optimizer steps
        self.compute: dict[str, torch.Tensor] = {}  # FQN -> this rank's compute rows
        self.mains: set[str] = set()  # FQNs with an fp32 main weight apart from compute
        for name, param in buffer.optimizer_named_parameters:
            fqn = name.removeprefix(prefix)
            self._check(fqn, param)
            group = buffer.parameter_groups[buffer.param_to_param_group[param.orig_param]]
            self.stepped[fqn] = param
            self.compute[fqn] = self._compute_rows(fqn, param, group)
            if group.main_weight_buffer is not None:
                self.mains.add(fqn)
        self.mesh: DeviceMesh = next(iter(self.stepped.values())).device_mesh
        self.group = self.mesh.get_group()
        rows = [p.to_local().shape[0] for p in self.stepped.values()]
        everyone: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, rows, group=self.group)
        self.rows = {fqn: [theirs[i] for theirs in everyone] for i, fqn in enumerate(self.stepped)}

    @staticmethod
    def _check(fqn: str, param: torch.Tensor) -> None:
        if not isinstance(param, DTensor) or tuple(param.placements) != (Shard(0),):
            where = getattr(param, "placements", "a plain tensor")
            raise ValueError(
                f"parameter {fqn} is {where} under Megatron-FSDP, not sharded on one "
                "data-parallel mesh dimension: tensor parallelism and hybrid (HSDP) meshes "
                "are not supported; wrap with a 1-D data-parallel mesh (tp size 1)"
            )

    @staticmethod
    def _compute_rows(fqn: str, param: DTensor, group: Any) -> torch.Tensor:
        local = param.to_local()
        wbuf = group.model_weight_buffer
        if wbuf is None:
            return local
        rows = wbuf.get_item(wbuf.param_idx[param.orig_param], only_shard=True)
        if rows.numel() != local.numel():
            raise ValueError(
                f"parameter {fqn}: its compute weight holds {rows.numel()} elements on this "
                f"rank, its main weight {local.numel()}; they are not the same rows, so "
                "this cannot save them"
            )
        return rows.view(local.shape)

    def even(self, fqn: str, local: torch.Tensor) -> DTensor:
        """``local`` (this rank's uneven rows of parameter ``fqn``, or of a tensor shaped
        like it) as an even ``Shard(0)`` DTensor over the data-parallel mesh."""
        whole = self._gather(local, self.rows[fqn])
        block = self._block(whole)
        shape, stride = whole.shape, whole.stride()
        return DTensor.from_local(
            block, self.mesh, [Shard(0)], run_check=False, shape=shape, stride=stride
        )

    def uneven(self, fqn: str, value: torch.Tensor) -> torch.Tensor:
        """``value`` (parameter ``fqn``'s shape, an even ``Shard(0)`` DTensor or a whole
        tensor) as this rank's uneven rows."""
        if isinstance(value, DTensor):
            local = value.to_local()
            n = value.shape[0]
            spans = [self._span(n, r) for r in range(self.mesh.size())]
            whole = self._gather(local, [end - start for start, end in spans])
        else:
            whole = value
        rows = self.rows[fqn]
        start = sum(rows[: self._rank()])
        return whole[start : start + rows[self._rank()]]

    def _rank(self) -> int:
        return dist.get_rank(self.group)

    def _span(self, n: int, rank: int) -> tuple[int, int]:
        """Rows ``[start, end)`` torch's ``Shard(0)`` gives ``rank`` of ``n`` rows."""
        size = math.ceil(n / self.mesh.size()) if n else 0
        start = min(rank * size, n)
        return start, min(start + size, n)

    def _block(self, whole: torch.Tensor) -> torch.Tensor:
        start, end = self._span(whole.shape[0], self._rank())
        return whole[start:end].clone()

    def _gather(self, local: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The whole tensor from every rank's rows (``counts[r]`` on rank ``r``), bit for
        bit: sent as bytes, so no dtype is cast or summed on the way."""
        tail = tuple(local.shape[1:])
        most = max(counts)
        padded = torch.zeros((most, *tail), dtype=local.dtype, device=local.device)
        padded[: local.shape[0]] = local
        parts = gather_bytes(padded, self.group, len(counts))
        rows = [part.view(most, *tail)[:count] for part, count in zip(parts, counts, strict=True)]
        return torch.cat(rows).contiguous()


class ModelView(nn.Module):
    """The compute weights of a Megatron-FSDP model, keyed by the innermost model's FQNs,
    each an even ``Shard(0)`` DTensor; ``load_state_dict`` writes restored values into
    Megatron-FSDP's buffers (compute weight, and the fp32 main weight from it, so a restore
    with a reset optimizer starts from the restored weights; a restored optimizer then
    overwrites the main weight with its saved fp32 value). Every call is collective."""

    def __init__(self, model: nn.Module, layout: Layout) -> None:
        super().__init__()
        for name, child in layout.chunk.named_children():
            self.add_module(name, child)
        self.layout = layout
        # Megatron-FSDP shards parameters only: buffers stay whole on every rank.
        self._kept = {
            name: b
            for name, b in layout.chunk.named_buffers()
            if name.rpartition(".")[2] not in _owner(layout.chunk, name)._non_persistent_buffers_set
        }
        # Stand-ins made once: the optimizer view's param groups name them by identity.
        self.faces: dict[str, nn.Parameter] = {
            fqn: nn.Parameter(layout.even(fqn, rows), requires_grad=False)
            for fqn, rows in layout.compute.items()
        }

    def named_parameters(  # type: ignore[override]
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        for fqn, face in self.faces.items():
            yield prefix + fqn, face

    def named_buffers(  # type: ignore[override]
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        return ((prefix + name, b) for name, b in self._kept.items())

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        out = {fqn: self.layout.even(fqn, rows) for fqn, rows in self.layout.compute.items()}
        out.update((name, b.detach()) for name, b in self._kept.items())
        return out

    def load_state_dict(  # type: ignore[override]
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> nn.modules.module._IncompatibleKeys:
        live = {**self.layout.compute, **self._kept}
        missing = [fqn for fqn in live if fqn not in state_dict]
        unexpected = [fqn for fqn in state_dict if fqn not in live]
        if strict and (missing or unexpected):
            raise RuntimeError(f"missing keys {missing}, unexpected keys {unexpected}")
        with torch.no_grad():
            for name, b in self._kept.items():
                if name in state_dict:
                    b.copy_(_local(state_dict[name]))
            for fqn, rows in self.layout.compute.items():
                if fqn not in state_dict:
                    continue
                restored = self.layout.uneven(fqn, state_dict[fqn])
                rows.copy_(restored)
                if fqn in self.layout.mains:
                    self.layout.stepped[fqn].to_local().copy_(restored)
        return nn.modules.module._IncompatibleKeys(missing, unexpected)


class OptimizerView(torch.optim.Optimizer):
    """The torch optimizer Megatron-FSDP steps, as one over ``ModelView``'s stand-ins.

    ``state_dict()`` gives, per parameter, each state tensor shaped like the parameter as
    an even ``Shard(0)`` DTensor, each scalar (``step``) as a plain tensor (the same on
    every rank: a rank whose share of a parameter is empty has no state for it, and takes
    the value of a rank that has), and ``main_param``. ``load_state_dict`` puts them back
    as Megatron-FSDP keeps them (DTensors of this rank's rows, no state where the share is
    empty), each in its saved dtype (DESIGN.md F5). Not for ``step()``. Every call is
    collective.
    """

    def __init__(self, optimizer: Any, model: ModelView) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer is a {type(optimizer).__name__}; for Megatron-FSDP pass the torch "
                "optimizer wrapped by megatron_fsdp.fully_shard_optimizer"
            )
        self.defaults: dict[str, Any] = {}
        self.state: dict[Any, Any] = {}
        self._inner = optimizer
        self._model = model
        layout = model.layout
        fqn_of = {id(p): fqn for fqn, p in layout.stepped.items()}
        self._fqns: list[list[str]] = []
        for g, group in enumerate(optimizer.param_groups):
            fqns = []
            for j, p in enumerate(group["params"]):
                if id(p) not in fqn_of:
                    raise ValueError(
                        f"the optimizer steps a parameter (group {g}, position {j}, shape "
                        f"{tuple(p.shape)}) that is not one of the Megatron-FSDP model's "
                        "distributed parameters: build it on the wrapped model's "
                        "parameters() and pass it through fully_shard_optimizer"
                    )
                fqns.append(fqn_of[id(p)])
            self._fqns.append(fqns)

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return [
            {**_hyper(group), "params": [self._model.faces[f] for f in fqns]}
            for group, fqns in zip(self._inner.param_groups, self._fqns, strict=True)
        ]

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        layout = self._model.layout
        kinds = self._kinds()
        state: dict[int, dict[str, Any]] = {}
        groups = []
        index = 0
        for group, fqns in zip(self._inner.param_groups, self._fqns, strict=True):
            ids = []
            for fqn in fqns:
                param = layout.stepped[fqn]
                held = self._inner.state.get(param, {})
                entry: dict[str, Any] = {}
                for key, kind in kinds[fqn].items():
                    if kind[0] == "rows":
                        rows = _local(held[key]) if key in held else _no_rows(param, kind[1])
                        entry[key] = layout.even(fqn, rows)
                    else:
                        entry[key] = torch.tensor(kind[2], dtype=_DTYPES[kind[1]])
                if fqn in layout.mains:
                    entry[MAIN_PARAM] = layout.even(fqn, param.to_local())
                if entry:
                    state[index] = entry
                ids.append(index)
                index += 1
            groups.append({**_hyper(group), "params": ids})
        return {"state": state, "param_groups": groups}

    def _kinds(self) -> dict[str, dict[str, tuple[Any, ...]]]:
        """Per FQN, its state's keys as every rank sees them: ("rows", dtype) for a tensor
        shaped like the parameter, ("scalar", dtype, value) for a 0-d tensor."""
        mine: dict[str, dict[str, tuple[Any, ...]]] = {}
        layout = self._model.layout
        for fqn, param in layout.stepped.items():
            kinds: dict[str, tuple[Any, ...]] = {}
            for key, value in self._inner.state.get(param, {}).items():
                if isinstance(value, DTensor) and value.shape == param.shape:
                    kinds[key] = ("rows", str(value.dtype).removeprefix("torch."))
                elif isinstance(value, torch.Tensor) and value.dim() == 0:
                    dtype = str(value.dtype).removeprefix("torch.")
                    kinds[key] = ("scalar", dtype, value.item())
                else:
                    raise ValueError(
                        f"optimizer state {key!r} of parameter {fqn} is a "
                        f"{type(value).__name__} of shape {tuple(getattr(value, 'shape', ()))}"
                        ": neither sharded like the parameter nor a scalar, so it cannot be "
                        "saved exactly"
                    )
            mine[fqn] = kinds
        everyone: list[Any] = [None] * dist.get_world_size(layout.group)
        dist.all_gather_object(everyone, mine, group=layout.group)
        merged: dict[str, dict[str, tuple[Any, ...]]] = {fqn: {} for fqn in layout.stepped}
        for theirs in everyone:
            for fqn, kinds in theirs.items():
                for key, kind in kinds.items():
                    seen = merged[fqn].setdefault(key, kind)
                    if seen != kind:
                        raise ValueError(
                            f"optimizer state {key!r} of parameter {fqn} differs between "
                            f"data-parallel ranks ({seen} and {kind}): it cannot be saved "
                            "as one value"
                        )
        return merged

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        layout = self._model.layout
        saved_state = state_dict["state"]
        index = 0
        for group, fqns, saved_group in zip(
            self._inner.param_groups, self._fqns, state_dict["param_groups"], strict=True
        ):
            group.update(_hyper(saved_group))
            for fqn in fqns:
                param = layout.stepped[fqn]
                entry = dict(saved_state.get(index, {}))
                index += 1
                main = entry.pop(MAIN_PARAM, None)
                if fqn in layout.mains:
                    if main is None:
                        raise KeyError(f"no {MAIN_PARAM!r} for parameter {fqn}")
                    with torch.no_grad():
                        param.to_local().copy_(layout.uneven(fqn, main))
                values = {}
                for key, value in entry.items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        rows = layout.uneven(fqn, value)
                        values[key] = _like(param, rows.clone())
                    else:
                        values[key] = _local(value) if isinstance(value, torch.Tensor) else value
                # A rank whose share is empty keeps no state (Megatron-FSDP gives it no
                # gradient, so the torch optimizer never made any).
                if values and param.to_local().numel():
                    self._inner.state[param] = values
                else:
                    self._inner.state.pop(param, None)

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        raise TypeError("OptimizerView only saves and restores: step the wrapped optimizer")


_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32)
}


def _like(param: DTensor, rows: torch.Tensor) -> DTensor:
    """``rows`` (this rank's share) placed as Megatron-FSDP places ``param``'s."""
    mesh, placements = param.device_mesh, param.placements
    shape, stride = param.shape, param.stride()
    return DTensor.from_local(rows, mesh, placements, run_check=False, shape=shape, stride=stride)


def _owner(chunk: nn.Module, name: str) -> nn.Module:
    return chunk.get_submodule(name.rpartition(".")[0]) if "." in name else chunk


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def _no_rows(param: DTensor, dtype: str) -> torch.Tensor:
    local = param.to_local()
    return torch.empty((0, *param.shape[1:]), dtype=_DTYPES[dtype], device=local.device)


def _hyper(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}
