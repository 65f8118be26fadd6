"""A Megatron-Core model and optimizer as the torch objects a ``Checkpointer`` saves.

Megatron keeps a tensor-parallel (TP) parameter as this rank's slice, marked with
``tensor_model_parallel``, ``partition_dim`` and ``partition_stride`` attributes. Here such
a slice becomes a ``DTensor`` sharded on ``partition_dim`` over a 1-D mesh of Megatron's
TP group (one mesh per data-parallel replica, each holding the whole tensor), so the
library saves it sharded, fingerprints the whole tensor and reshards it on restore to any
TP size. Parameters not split by TP stay plain tensors.

``ModelState`` gives the model's compute weights keyed by the model's own FQNs and copies
restored ones in place (Megatron's DDP keeps parameters as views into its buffers).
``OptimizerState`` gives, per parameter, the torch optimizer's state (Adam's ``exp_avg``,
``exp_avg_sq``, ``step``) and, for a bf16/fp16 parameter, its fp32 main weight
(``main_param``), each in its own dtype, and puts them back without torch's casts. It sees
each of Megatron's leaf optimizers through a ``LeafView``: ``PlainLeaf`` here (whole main
weights), ``_megatron_distopt.DistOptLeaf`` for the ``DistributedOptimizer`` (each
data-parallel rank a range of them). Both weights are restored before the first step, and
the Checkpointer's recapture after the install fingerprints both (DESIGN.md F4).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

# The key of a bf16/fp16 parameter's fp32 main weight among its optimizer state.
MAIN_PARAM = "main_param"
GRAD_SCALER = "grad_scaler"


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


class TensorParallel:
    """How this rank's slices of TP-split parameters make whole tensors."""

    def __init__(self, mesh: DeviceMesh | None) -> None:
        self.mesh = mesh  # None: TP size 1, every parameter whole

    def split(self, param: torch.Tensor) -> bool:
        return self.mesh is not None and bool(getattr(param, "tensor_model_parallel", False))

    def whole(self, param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """``value`` (this rank's slice of something shaped like ``param``) as a DTensor
        where ``param`` is TP-split, else as it is."""
        if not self.split(param) or value.shape != param.shape:
            return value
        placement = [Shard(param.partition_dim)]
        return DTensor.from_local(value, self.mesh, placement, run_check=False)


class ModelState(nn.Module):
    """The compute weights of one Megatron model chunk, keyed by its FQNs.

    It holds the chunk's submodules under their own names (so the library maps FQNs as in
    the chunk), yields a whole-tensor stand-in (a ``DTensor`` parameter) for each TP-split
    parameter, gives and takes state with TP-split tensors as ``DTensor``s, and writes
    restored values into the live parameters in place. After a restore it also refreshes
    each parameter's fp32 main weight (through the leaf optimizers' views: the whole
    weight, or this data-parallel rank's range of it) from the restored weight, so a
    restore with a reset optimizer starts from the restored weights; a restored optimizer
    then overwrites it with the saved fp32 value.
    """

    def __init__(self, chunk: nn.Module, tp: TensorParallel, leaves: Sequence[LeafView]) -> None:
        super().__init__()
        self._leaves = list(leaves)
        # The chunk's own children and tensors under their names: FQNs resolve as in it.
        for name, child in chunk.named_children():
            self.add_module(name, child)
        for name, p in chunk._parameters.items():
            if p is not None:
                self.register_parameter(name, p)
        for name, b in chunk._buffers.items():
            if b is not None:
                persistent = name not in chunk._non_persistent_buffers_set
                self.register_buffer(name, b, persistent=persistent)
        self._tp = tp
        self._params = dict(chunk.named_parameters())
        self._buffers_kept = {
            name: b
            for name, b in chunk.named_buffers()
            if name.rpartition(".")[2] not in _non_persistent(chunk, name)
        }
        # The stand-ins, made once: the optimizer's param groups name them by identity.
        self.faces: dict[nn.Parameter, nn.Parameter] = {}
        for p in self._params.values():
            if tp.split(p):
                face = nn.Parameter(tp.whole(p, p.detach()), requires_grad=p.requires_grad)
                self.faces[p] = face
            else:
                self.faces[p] = p

    def named_parameters(  # type: ignore[override]
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        for name, p in self._params.items():
            yield prefix + name, self.faces[p]

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        out: dict[str, Any] = {
            name: self._tp.whole(p, p.detach()) for name, p in self._params.items()
        }
        out.update((name, b.detach()) for name, b in self._buffers_kept.items())
        return out

    def load_state_dict(  # type: ignore[override]
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> nn.modules.module._IncompatibleKeys:
        live = {**self._params, **self._buffers_kept}
        missing = [name for name in live if name not in state_dict]
        unexpected = [name for name in state_dict if name not in live]
        if strict and (missing or unexpected):
            raise RuntimeError(f"missing keys {missing}, unexpected keys {unexpected}")
        with torch.no_grad():
            for name, value in state_dict.items():
                target = live.get(name)
                if target is None:
                    continue
                target.data.copy_(_local(value))
                for leaf in self._leaves:
                    leaf.refresh_main(target)
        return nn.modules.module._IncompatibleKeys(missing, unexpected)


def _non_persistent(chunk: nn.Module, name: str) -> set[str]:
    owner = chunk.get_submodule(name.rpartition(".")[0]) if "." in name else chunk
    return set(owner._non_persistent_buffers_set)


class LeafView(Protocol):
    """One of Megatron's leaf optimizers seen per model parameter: :class:`PlainLeaf`
    (``Float16OptimizerWithFloat16Params``, ``FP32Optimizer``) or
    ``_megatron_distopt.DistOptLeaf`` (``DistributedOptimizer``). Values are this TP
    rank's: shaped like the model parameter, or scalars."""

    torch_optimizer: torch.optim.Optimizer

    @property
    def grad_scaler(self) -> Any: ...

    def groups(self) -> list[tuple[dict[str, Any], list[nn.Parameter]]]:
        """Each torch param group (live: the LR scheduler sets its ``lr``) with the model
        parameters it steps."""
        ...

    def state(self) -> dict[nn.Parameter, dict[str, Any]]:
        """Per model parameter: its optimizer state and, if it has one, its fp32 main
        weight under ``main_param`` (may be collective)."""
        ...

    def load(self, param: nn.Parameter, entry: dict[str, Any]) -> None:
        """Install ``param``'s saved entry (as :meth:`state` gives it), as saved."""
        ...

    def refresh_main(self, param: nn.Parameter) -> None:
        """Set ``param``'s main weight, if any, from its compute weight."""
        ...


class PlainLeaf:
    """A non-distributed leaf optimizer: a ``Float16OptimizerWithFloat16Params`` (each
    bf16/fp16 parameter stepped through a whole fp32 main weight) or an ``FP32Optimizer``
    (parameters stepped as they are)."""

    def __init__(self, leaf: Any) -> None:
        self.leaf = leaf
        self.torch_optimizer: torch.optim.Optimizer = leaf.optimizer
        main_of = _model_params_of_mains(leaf)
        self._stepped = {
            main_of.get(p, p): p for group in leaf.optimizer.param_groups for p in group["params"]
        }
        self._model_of = {stepped: model for model, stepped in self._stepped.items()}

    @property
    def grad_scaler(self) -> Any:
        return getattr(self.leaf, "grad_scaler", None)

    def groups(self) -> list[tuple[dict[str, Any], list[nn.Parameter]]]:
        return [
            (group, [self._model(p) for p in group["params"]])
            for group in self.torch_optimizer.param_groups
        ]

    def _model(self, stepped: torch.Tensor) -> nn.Parameter:
        return self._model_of[stepped]

    def state(self) -> dict[nn.Parameter, dict[str, Any]]:
        out = {}
        for model, stepped in self._stepped.items():
            entry = dict(self.torch_optimizer.state.get(stepped, {}))
            if stepped is not model:
                entry[MAIN_PARAM] = stepped.detach()
            out[model] = entry
        return out

    def load(self, param: nn.Parameter, entry: dict[str, Any]) -> None:
        stepped = self._stepped[param]
        entry = dict(entry)
        main = entry.pop(MAIN_PARAM, None)
        if stepped is not param:
            if main is None:
                raise KeyError(f"no {MAIN_PARAM!r} for a parameter of shape {tuple(param.shape)}")
            with torch.no_grad():
                stepped.data.copy_(main)
        # Set as restored (no cast to the parameter's dtype, unlike torch's
        # Optimizer.load_state_dict): DESIGN.md F5.
        if entry:
            self.torch_optimizer.state[stepped] = entry
        else:
            self.torch_optimizer.state.pop(stepped, None)

    def refresh_main(self, param: nn.Parameter) -> None:
        stepped = self._stepped.get(param)
        if stepped is not None and stepped is not param:
            with torch.no_grad():
                stepped.data.copy_(param.data)


class OptimizerState(torch.optim.Optimizer):
    """Megatron's optimizers (mixed precision, fp32 or distributed; chained or not) as one
    torch optimizer over the model's parameters (``ModelState``'s stand-ins).

    Its ``param_groups`` are the torch optimizers' groups, in order, naming the model's
    parameters; ``state_dict()`` gives torch-format state per parameter, plus
    ``main_param`` for a parameter with an fp32 main weight, and under ``grad_scaler`` the
    state of each leaf optimizer's loss scaler (by its index in the chain). Not for
    ``step()``: train with Megatron's optimizer, save and restore through this.
    """

    def __init__(self, leaves: list[LeafView], model: ModelState, tp: TensorParallel) -> None:
        # No Optimizer.__init__: the groups are Megatron's, read live (the LR scheduler
        # sets their lr every step).
        self.defaults: dict[str, Any] = {}
        self.state: dict[Any, Any] = {}  # the torch optimizers' own state holds it all
        self._leaves = leaves
        self._model = model
        self._tp = tp

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return [
            {**_hyper(group), "params": [self._model.faces[p] for p in params]}
            for leaf in self._leaves
            for group, params in leaf.groups()
        ]

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        state: dict[int, dict[str, Any]] = {}
        groups = []
        index = 0
        for leaf in self._leaves:
            held = leaf.state()
            for group, params in leaf.groups():
                ids = []
                for p in params:
                    entry = {k: self._whole(p, k, v) for k, v in held.get(p, {}).items()}
                    if entry:
                        state[index] = entry
                    ids.append(index)
                    index += 1
                groups.append({**_hyper(group), "params": ids})
        out: dict[str, Any] = {"state": state, "param_groups": groups}
        scalers = {
            str(i): leaf.grad_scaler.state_dict()
            for i, leaf in enumerate(self._leaves)
            if leaf.grad_scaler is not None
        }
        if scalers:
            out[GRAD_SCALER] = scalers
        return out

    def _whole(self, param: nn.Parameter, key: str, value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or not self._tp.split(param):
            return value
        if value.shape == param.shape:
            return self._tp.whole(param, value)
        if value.dim() == 0:
            return value  # a count (``step``): the same on every TP rank
        raise ValueError(
            f"optimizer state {key!r} of a tensor-parallel parameter has shape "
            f"{tuple(value.shape)}, neither the parameter's slice {tuple(param.shape)} "
            "nor a scalar: its split across TP ranks is unknown, so it cannot be saved whole"
        )

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        saved_state = state_dict["state"]
        index = 0
        live = [pair for leaf in self._leaves for pair in leaf.groups()]
        for (group, _), saved_group in zip(live, state_dict["param_groups"], strict=True):
            group.update(_hyper(saved_group))
        for leaf in self._leaves:
            for _, params in leaf.groups():
                for p in params:
                    entry = saved_state.get(index, {})
                    index += 1
                    values = {
                        k: _local(v) if isinstance(v, torch.Tensor) else v for k, v in entry.items()
                    }
                    leaf.load(p, values)
        scalers = state_dict.get(GRAD_SCALER, {})
        for i, leaf in enumerate(self._leaves):
            scaler = leaf.grad_scaler
            if scaler is not None and str(i) in scalers:
                scaler.load_state_dict(dict(scalers[str(i)]))

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        raise TypeError("OptimizerState only saves and restores: step Megatron's optimizer")


class RNGTrackerState:
    """Megatron's model-parallel RNG tracker (``get_cuda_rng_tracker()``): the named CUDA
    generator states its ``fork()`` swaps in, which dropout inside Megatron's attention
    and tensor-parallel regions draws from (the default generators are the ``rng``
    component's). They differ between TP ranks, so they are saved per rank and restore
    onto the same layout; at another one, pass ``reset={"megatron_rng", "rng"}``.

    Args:
        tracker: returns the live tracker (Megatron may replace it, e.g. on a re-seed).
    """

    def __init__(self, tracker: Callable[[], Any]) -> None:
        self._tracker = tracker

    def state_dict(self) -> dict[str, torch.Tensor]:
        states = dict(self._tracker().get_states())
        for name, value in states.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"Megatron's RNG tracker keeps its state {name!r} as a "
                    f"{type(value).__name__}, not a generator-state tensor (a CUDA-graph-safe "
                    "or Transformer Engine tracker): it cannot be saved exactly. Initialize "
                    "Megatron's model-parallel RNG without CUDA-graphable RNG and without "
                    "Transformer Engine's tracker"
                )
        return states

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._tracker().set_states(dict(state))


def _hyper(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def _model_params_of_mains(leaf: Any) -> dict[torch.Tensor, nn.Parameter]:
    """fp32 main weight -> its model parameter, for a mixed-precision leaf optimizer
    (Megatron's ``float16_groups`` and ``fp32_from_float16_groups``, group by group)."""
    out: dict[torch.Tensor, nn.Parameter] = {}
    for model_group, main_group in zip(
        getattr(leaf, "float16_groups", ()),
        getattr(leaf, "fp32_from_float16_groups", ()),
        strict=True,
    ):
        out.update(zip(main_group, model_group, strict=True))
    return out
