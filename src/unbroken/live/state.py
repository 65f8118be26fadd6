"""Live training objects <-> nested state with tensors, one class per kind of component.

Model and optimizer state are keyed by normalized parameter FQNs (torch's own rules for
``torch.compile``, activation checkpointing, DDP and FSDP2 wrappers), so a checkpoint
restores into the same model wrapped differently. Load targets are built from what the
checkpoint holds, never from the live optimizer's lazily created state (DESIGN.md F1).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    _get_fqns,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor

from ..errors import CheckpointError, IncompleteCheckpointError, StateMismatchError
from ..format import tree
from ..format.manifest import DTYPES

_MAX_LISTED = 5


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    more = len(names) - _MAX_LISTED
    return shown + (f" and {more} more" if more > 0 else "")


def device_kind(t: torch.Tensor) -> str:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.device.type


def empty_target(entry: dict[str, Any], like: torch.Tensor | None) -> torch.Tensor:
    """An uninitialized tensor to load a saved tensor into: the saved shape and dtype,
    placed (device, sharding) like the live tensor ``like`` where shapes agree."""
    shape, dtype = entry["shape"], DTYPES[entry["dtype"]]
    if like is not None and isinstance(like, DTensor) and list(like.shape) == shape:
        return torch.empty_like(like, dtype=dtype)
    if entry.get("device", "cpu") == "cpu":
        device = torch.device("cpu")
    elif like is not None:
        device = (like.to_local() if isinstance(like, DTensor) else like).device
    else:
        device = torch.device(entry["device"], torch.accelerator.current_device_index())
    return torch.empty(shape, dtype=dtype, device=device)


def _named(obj: Any, kind: type | tuple[type, ...], what: str) -> dict[str | None, Any]:
    """Normalize ``obj`` or a dict name -> obj into {name or None: obj}."""
    if isinstance(obj, Mapping):
        for name, value in obj.items():
            if not isinstance(name, str) or not isinstance(value, kind):
                raise TypeError(f"{what}[{name!r}] must be a {_kind_name(kind)}")
        return dict(obj)
    if not isinstance(obj, kind):
        raise TypeError(f"{what} must be a {_kind_name(kind)} or a dict of them")
    return {None: obj}


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def _unnamed(named: dict[str | None, Any], fn) -> Any:
    if None in named:
        return fn(named[None])
    return {name: fn(obj) for name, obj in named.items()}


class Component:
    """One named part of the training state, saved and restored as a whole."""

    name: str
    kind: str
    per_rank = False

    def capture(self) -> Any:
        raise NotImplementedError

    def targets(self, saved_keys: dict[str, dict], live: dict[str, torch.Tensor]) -> dict:
        """Load targets for the saved tensor keys of this component (key -> tensor)."""
        return {key: empty_target(entry, None) for key, entry in saved_keys.items()}

    def install(self, state: Any) -> None:
        raise NotImplementedError

    verify_live = False  # recapture after install and compare fingerprints


class ModelComponent(Component):
    """``model``: one module or a dict of them, through torch's model state-dict API."""

    kind = "model"
    verify_live = True

    def __init__(self, model: nn.Module | Mapping[str, nn.Module], name: str = "model") -> None:
        self.name = name
        self.models = _named(model, nn.Module, "model")

    def capture(self) -> Any:
        # torch returns an OrderedDict; a plain dict keeps the model's skeleton a JSON
        # object keyed by FQN (what offline tools read), in the same order. The container
        # type means nothing here: set_model_state_dict takes any mapping.
        return _unnamed(self.models, lambda m: dict(get_model_state_dict(m)))

    def parameter_fqns(self) -> dict[nn.Parameter, str]:
        """Each parameter's normalized FQN (prefixed ``name.`` for a dict of models)."""
        out: dict[nn.Parameter, str] = {}
        for name, module in self.models.items():
            for raw, param in module.named_parameters():
                fqns = _get_fqns(module, raw)
                if len(fqns) != 1:
                    raise CheckpointError(
                        f"parameter {raw!r} maps to {len(fqns)} FQNs (FSDP1 flat parameters "
                        "are not supported; use FSDP2 fully_shard)"
                    )
                fqn = next(iter(fqns))
                out[param] = fqn if name is None else f"{name}.{fqn}"
        return out

    def targets(self, saved_keys: dict[str, dict], live: dict[str, torch.Tensor]) -> dict:
        missing = sorted(set(live) - set(saved_keys))
        if missing:
            raise IncompleteCheckpointError(
                f"the checkpoint has no saved value for {len(missing)} tensor(s) of the live "
                f"model: {_listing(missing)}. If the model gained these on purpose, start "
                "from weights you convert yourself; the checkpoint does not cover them"
            )
        unknown = sorted(set(saved_keys) - set(live))
        if unknown:
            raise StateMismatchError(
                f"the checkpoint holds {len(unknown)} tensor(s) the live model lacks: "
                f"{_listing(unknown)}; the architecture changed since the save"
            )
        wrong = [
            f"{key}: saved shape {tuple(entry['shape'])}, live shape {tuple(live[key].shape)}"
            for key, entry in saved_keys.items()
            if list(live[key].shape) != entry["shape"]
        ]
        if wrong:
            raise StateMismatchError(
                "the architecture changed since the save: " + "; ".join(wrong[:_MAX_LISTED])
            )
        return {key: empty_target(entry, live[key]) for key, entry in saved_keys.items()}

    def install(self, state: Any) -> None:
        options = StateDictOptions(strict=True)
        if None in self.models:
            set_model_state_dict(self.models[None], state, options=options)
        else:
            for name, module in self.models.items():
                set_model_state_dict(module, state[name], options=options)


class OptimizerComponent(Component):
    """``optimizer``: state keyed by parameter FQN, installed with exact dtypes (F1, F5)."""

    kind = "optimizer"
    verify_live = True

    def __init__(self, optimizer: Any, model: ModelComponent, name: str = "optimizer") -> None:
        self.name = name
        self.optimizers = _named(optimizer, torch.optim.Optimizer, "optimizer")
        self.model = model
        self._fqn_of: dict[nn.Parameter, str] | None = None

    def _fqns(self) -> dict[nn.Parameter, str]:
        if self._fqn_of is None:
            self._fqn_of = self.model.parameter_fqns()
        return self._fqn_of

    def _group_fqns(self, opt: torch.optim.Optimizer, where: str) -> list[list[str]]:
        return group_fqns(opt, self._fqns(), where, "the model passed to Checkpointer")

    def _where(self, name: str | None) -> str:
        return "optimizer" if name is None else f"optimizer[{name!r}]"

    def _capture_one(self, name: str | None, opt: torch.optim.Optimizer) -> dict[str, Any]:
        groups = self._group_fqns(opt, self._where(name))
        by_index = [fqn for names in groups for fqn in names]
        sd = opt.state_dict()
        state = {by_index[i]: value for i, value in sd["state"].items()}
        param_groups = []
        for saved in sd["param_groups"]:
            entry = {k: v for k, v in saved.items() if k != "params"}
            entry["params"] = [by_index[i] for i in saved["params"]]
            param_groups.append(entry)
        return {"state": state, "param_groups": param_groups}

    def capture(self) -> Any:
        if None in self.optimizers:
            return self._capture_one(None, self.optimizers[None])
        return {n: self._capture_one(n, o) for n, o in self.optimizers.items()}

    def check_coverage(self, skeleton: Any) -> None:
        """Every live parameter must have its optimizer entry in the checkpoint (F3)."""
        for name, opt in self.optimizers.items():
            saved = skeleton if name is None else skeleton.get(name)
            where = self._where(name)
            if not isinstance(saved, dict) or "param_groups" not in saved:
                raise IncompleteCheckpointError(
                    f"the checkpoint has no state for {where}; pass reset={{'optimizer'}} "
                    "to start it fresh on purpose"
                )
            live_groups = self._group_fqns(opt, where)
            saved_groups = [g["params"] for g in saved["param_groups"]]
            if len(saved_groups) != len(live_groups):
                raise StateMismatchError(
                    f"{where}: the checkpoint has {len(saved_groups)} parameter group(s), "
                    f"the live optimizer {len(live_groups)}"
                )
            for g, (s, live) in enumerate(zip(saved_groups, live_groups, strict=True)):
                lacking = sorted(set(live) - set(s))
                if lacking:
                    raise IncompleteCheckpointError(
                        f"{where}, group {g}: the checkpoint has no optimizer entry for "
                        f"parameter(s) {_listing(lacking)}; their optimizer state would start "
                        "fresh silently. Pass reset={'optimizer'} to start it fresh on purpose"
                    )
                extra = sorted(set(s) - set(live))
                if extra:
                    raise StateMismatchError(
                        f"{where}, group {g}: the checkpoint has optimizer state for "
                        f"{_listing(extra)}, which the live optimizer group does not hold"
                    )

    def targets(self, saved_keys: dict[str, dict], live: dict[str, torch.Tensor]) -> dict:
        params = {fqn: p for p, fqn in self._fqns().items()}
        out = {}
        for key, entry in saved_keys.items():
            fqn = _param_of_state_key(key, params)
            out[key] = empty_target(entry, params.get(fqn))
        return out

    def install(self, state: Any) -> None:
        for name, opt in self.optimizers.items():
            self._install_one(opt, state if name is None else state[name], self._where(name))

    def _install_one(self, opt: torch.optim.Optimizer, saved: dict, where: str) -> None:
        live_groups = self._group_fqns(opt, where)
        index = {fqn: i for i, fqn in enumerate(f for names in live_groups for f in names)}
        groups = []
        for g, names in enumerate(live_groups):
            entry = {k: v for k, v in saved["param_groups"][g].items() if k != "params"}
            entry["params"] = [index[f] for f in names]
            groups.append(entry)
        state = {index[fqn]: dict(value) for fqn, value in saved["state"].items()}
        opt.load_state_dict({"state": state, "param_groups": groups})
        # torch's load_state_dict casts floating state to each parameter's dtype (fp32
        # moments of a bf16 parameter become bf16): put back exactly what was saved.
        params = {fqn: p for p, fqn in self._fqns().items()}
        for fqn, value in saved["state"].items():
            live_state = opt.state[params[fqn]]
            for k, v in value.items():
                if isinstance(v, torch.Tensor) and live_state.get(k) is not v:
                    live_state[k] = v


def group_fqns(
    opt: torch.optim.Optimizer, fqn_of: dict[nn.Parameter, str], where: str, owner: str
) -> list[list[str]]:
    """The FQNs of each param group's parameters, in the optimizer's order.

    Raises:
        StateMismatchError: ``where`` (the optimizer) holds a parameter that is not one of
            ``owner`` (the model).
    """
    groups = []
    for g, group in enumerate(opt.param_groups):
        names = []
        for j, p in enumerate(group["params"]):
            if p not in fqn_of:
                raise StateMismatchError(
                    f"{where} holds a parameter (group {g}, position {j}, shape "
                    f"{tuple(p.shape)}) that is not a parameter of {owner}; pass every model "
                    "whose parameters it optimizes"
                )
            names.append(fqn_of[p])
        groups.append(names)
    return groups


def _param_of_state_key(key: str, params: Mapping[str, Any]) -> str | None:
    """The parameter FQN inside an optimizer state key ``.../state/<fqn>/<name>``."""
    parts = key.split("/")
    if "state" in parts:
        i = parts.index("state")
        if i + 1 < len(parts):
            fqn = parts[i + 1].replace("%2F", "/").replace("%25", "%")
            return fqn if fqn in params else None
    return None


class StatefulComponent(Component):
    """Anything with ``state_dict()``/``load_state_dict()``, or a dict of such objects."""

    def __init__(self, name: str, obj: Any, *, kind: str, per_rank: bool = False) -> None:
        self.name = name
        self.kind = kind
        self.per_rank = per_rank
        objs = dict(obj) if isinstance(obj, Mapping) and not _is_stateful(obj) else {None: obj}
        for sub, o in objs.items():
            if not _is_stateful(o):
                label = name if sub is None else f"{name}[{sub!r}]"
                raise TypeError(
                    f"{label} must have state_dict() and load_state_dict(), got "
                    f"{type(o).__qualname__}"
                )
        self.objects = objs

    def capture(self) -> Any:
        return _unnamed(self.objects, lambda o: o.state_dict())

    def install(self, state: Any) -> None:
        if None in self.objects:
            self.objects[None].load_state_dict(state)
        else:
            for sub, o in self.objects.items():
                o.load_state_dict(state[sub])


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def live_tensors(component: Component, prefix: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """The component's current state as (skeleton, key -> tensor), keyed like a save."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = tree.encode(component.capture(), prefix, tensors)
    return skeleton, tensors
