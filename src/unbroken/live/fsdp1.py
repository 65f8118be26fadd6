"""FSDP1 (``FullyShardedDataParallel``): its sharded state as DTensors keyed by FQN (F2, F3).

Within :func:`sharded_state`, an FSDP1 model gives and takes ``SHARDED_STATE_DICT`` state
as DTensors sharded on dim 0 (never ShardedTensors), in both ``use_orig_params`` modes:
what the rest of the library saves, fingerprints and reshards, so an FSDP1 checkpoint
restores into FSDP1 on another world size or wrapping, into FSDP2, or into a plain model,
and back.

Hybrid sharding (``HYBRID_SHARD``, ``_HYBRID_SHARD_ZERO2``: sharded within a group of
ranks, replicated across groups) saves the same FQN-keyed state. Given a 2-D
``device_mesh`` (replicate, shard), FSDP1 makes DTensors on it placed ``(Replicate(),
Shard(0))``; given ``process_group=(intra, inter)``, DTensors on a 1-D mesh over the shard
group, placed ``(Shard(0),)``: one instance of that mesh per replica, each holding the whole
tensor (counted once by the fingerprints, written once by DCP's de-duplication).

Optimizer state goes through FSDP's own conversion (``FSDP.optim_state_dict`` and
``FSDP.optim_state_dict_to_load``): flat-parameter state (``use_orig_params=False``) and
each rank's slices of original parameters (``use_orig_params=True``) become whole
original parameters keyed by FQN, and back. Load targets still come from the manifest
(F1), and after ``load_state_dict`` every state tensor is put back exactly as converted,
undoing torch's cast to the parameter's dtype (F5).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import (
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.tensor import empty as dtensor_empty

from ..errors import CheckpointError, StateMismatchError
from ..format.manifest import DTYPES
from . import torch_compat

_HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
_SHARDED = (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, *_HYBRID)
# FSDP1 warns on every state-dict call about its own use of deprecated torch internals.
_NOISE = ("FSDP.state_dict_type", "`_get_pg_default_device`", "Multiple backends are registered")


def is_fsdp1(model: nn.Module, what: str = "model") -> bool:
    """Whether ``model``'s state goes through FSDP1's sharded state (this module).

    False without FSDP1 modules, and for ``NO_SHARD`` modules with ``use_orig_params=True``
    (what FSDP1 picks by itself on a world size of 1): they hold whole parameters, so
    their state is a plain model's.

    Raises:
        ValueError: naming what is not supported: ``NO_SHARD`` with flat parameters,
            ``NO_SHARD`` mixed with sharded modules.
    """
    found = FSDP.fsdp_modules(model)
    strategies = {module.sharding_strategy for module in found}
    if not found:
        return False
    if strategies <= set(_SHARDED):
        return True
    if strategies == {ShardingStrategy.NO_SHARD} and all(
        torch_compat.fsdp1_uses_orig_params(module) for module in found
    ):
        return False
    kinds = sorted(
        {
            f"sharding_strategy={m.sharding_strategy.name}, "
            f"use_orig_params={torch_compat.fsdp1_uses_orig_params(m)}"
            for m in found
        }
    )
    raise ValueError(
        f"{what}: FSDP1 with {' and '.join(kinds)} is not supported. Supported: FULL_SHARD, "
        "SHARD_GRAD_OP, HYBRID_SHARD or _HYBRID_SHARD_ZERO2, and NO_SHARD with "
        "use_orig_params=True (FSDP1 switches to NO_SHARD by itself on a world size of 1); "
        "else use FSDP2 fully_shard or the unwrapped model"
    )


@contextlib.contextmanager
def sharded_state(model: nn.Module) -> Iterator[None]:
    """Within: ``model``'s FSDP1 modules give and take sharded state as DTensors."""
    with warnings.catch_warnings():
        for text in _NOISE:
            warnings.filterwarnings("ignore", message=f".*{text}")
        with (
            torch_compat.fsdp1_dtensor_state(model),
            FSDP.state_dict_type(
                model,
                StateDictType.SHARDED_STATE_DICT,
                ShardedStateDictConfig(offload_to_cpu=False),
                ShardedOptimStateDictConfig(offload_to_cpu=False),
            ),
        ):
            yield


class FSDP1Optimizer:
    """One optimizer over the parameters of one FSDP1 model, its state keyed by FQN.

    Args:
        model: the module holding the FSDP1 modules (the one passed to Checkpointer).
        optimizer: the optimizer over its parameters (flat or original).
        prefix: prepended to every FQN (``"name."`` for a model in a dict of models).
        where: names the optimizer in errors.
    """

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, prefix: str, where: str
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.prefix = prefix
        self.where = where

    def originals(self) -> dict[str, torch_compat.Original]:
        """Prefixed FQN -> the original parameter FSDP manages under it."""
        found = torch_compat.fsdp1_originals(self.model)
        return {self.prefix + fqn: original for fqn, original in found.items()}

    def groups(self) -> list[list[str]]:
        """Each param group's FQNs. A group holding flat parameters lists their original
        parameters in the model's module order (what ``parameters()`` of the unwrapped
        model gives), whatever the wrapping; other groups keep the optimizer's order."""
        names = {p: name for name, p in self.model.named_parameters()}
        originals = torch_compat.fsdp1_originals(self.model)
        position = {id(m): i for i, m in enumerate(self.model.modules())}
        out = []
        for g, group in enumerate(self.optimizer.param_groups):
            keyed: list[tuple[tuple[int, int], str]] = []
            flat = False
            for j, p in enumerate(group["params"]):
                name = names.get(p)
                if name is None:
                    raise StateMismatchError(
                        f"{self.where} holds a parameter (group {g}, position {j}, shape "
                        f"{tuple(p.shape)}) that is not a parameter of the FSDP1 model it "
                        "optimizes; an optimizer over an FSDP1 model holds only its parameters"
                    )
                fqns = torch_compat.normalized_fqns(self.model, name)
                flat = flat or len(fqns) > 1
                for fqn in sorted(fqns):
                    original = originals.get(fqn)
                    if original is not None:
                        key = (position[id(original.owner)], original.index)
                    else:  # a parameter FSDP does not manage (an ignored module)
                        key = (position[id(self.model.get_submodule(name.rpartition(".")[0]))], j)
                    keyed.append((key, fqn))
            if flat:
                keyed.sort(key=lambda item: item[0])
            out.append([self.prefix + fqn for _, fqn in keyed])
        return out

    def capture(self) -> dict[str, Any]:
        """``{"state": {fqn: {...}}, "param_groups": [...]}`` plus any extra top-level
        entries of ``state_dict()``; collective across the model's ranks."""
        groups = self.groups()
        raw = self.optimizer.state_dict()
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in raw["param_groups"]]
        extras = {k: v for k, v in raw.items() if k not in ("state", "param_groups")}
        with sharded_state(self.model):
            converted = FSDP.optim_state_dict(self.model, self.optimizer, raw, group=self._group())
        order = {fqn: i for i, fqn in enumerate(f for names in groups for f in names)}
        unknown = sorted(
            self.prefix + k for k in converted["state"] if self.prefix + k not in order
        )
        if unknown:
            raise CheckpointError(
                f"{self.where}: FSDP gives optimizer state under {unknown[:5]}, which are not "
                "the FQNs of parameters the optimizer holds; this wrapping is not supported"
            )
        state = sorted(converted["state"].items(), key=lambda kv: order[self.prefix + kv[0]])
        out: dict[str, Any] = {
            "state": {self.prefix + fqn: value for fqn, value in state},
            "param_groups": [
                {**h, "params": names} for h, names in zip(hyper, groups, strict=True)
            ],
        }
        out.update(extras)
        return out

    def target(self, entry: dict[str, Any], original: torch_compat.Original) -> torch.Tensor:
        """An empty DTensor to load saved state of ``original``'s shape into: sharded on
        dim 0 as FSDP shards it (every state tensor of one or more dimensions), replicated
        across the replica groups of hybrid sharding."""
        mesh = torch_compat.fsdp1_mesh(original.fsdp)
        return dtensor_empty(
            entry["shape"],
            dtype=DTYPES[entry["dtype"]],
            device_mesh=mesh,
            placements=torch_compat.fsdp1_placements(mesh),
        )

    def install(self, saved: dict[str, Any]) -> None:
        """Load FQN-keyed ``saved`` state (with sharded DTensors) into the optimizer."""
        strip = len(self.prefix)
        groups = []
        for g, names in enumerate(self.groups()):
            entry = {k: v for k, v in saved["param_groups"][g].items() if k != "params"}
            entry["params"] = [fqn[strip:] for fqn in names]
            groups.append(entry)
        state = {fqn[strip:]: dict(v) for fqn, v in saved["state"].items()}
        with sharded_state(self.model):
            flat = FSDP.optim_state_dict_to_load(
                self.model,
                self.optimizer,
                {"state": state, "param_groups": groups},
                group=self._group(),
            )
        flat.update((k, v) for k, v in saved.items() if k not in ("state", "param_groups"))
        self.optimizer.load_state_dict(flat)
        # torch's load_state_dict casts floating state to each parameter's dtype: put back
        # exactly what FSDP converted from the checkpoint.
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        for index, value in flat["state"].items():
            if not isinstance(index, int):
                continue
            live = self.optimizer.state[params[index]]
            for k, v in value.items():
                if live.get(k) is not v:
                    live[k] = v

    def _group(self) -> Any:
        """The process group of FSDP's collectives on state keys: the one the model is
        sharded over, or under hybrid sharding every rank (None: the default group).
        FSDP broadcasts the keys from global rank 0, which only one shard group holds, and
        every replica holds the same keys."""
        modules = FSDP.fsdp_modules(self.model)
        if any(m.sharding_strategy in _HYBRID for m in modules):
            return None
        return modules[0].process_group
