"""``optimizer``: optimizer state keyed by parameter FQN, restored exactly (F1, F3, F5).

Everything ``Optimizer.state_dict()`` returns is saved: per-parameter state (keyed by the
parameter's normalized FQN instead of its position), param groups, state under keys that
are not parameters, and any extra top-level entries wrappers and third-party optimizers
add. On restore the state goes through ``load_state_dict`` (so the optimizer's hooks run),
then every value torch cast or converted is put back exactly as saved. An optimizer over
an FSDP1 model goes through FSDP's own conversion (``fsdp1.FSDP1Optimizer``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..errors import CorruptCheckpointError, IncompleteCheckpointError, StateMismatchError
from .fsdp1 import FSDP1Optimizer
from .state import Component, ModelComponent, empty_target, listing, named

# State entries that always have their parameter's shape (torch's built-in optimizers).
PARAM_SHAPED = frozenset(
    {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta",
     "sum", "ax", "prev", "mu_product_buffer"}
)  # fmt: skip
# Where state kept under keys that are not parameters goes in a captured optimizer.
NON_PARAM_STATE = "unbroken:non_param_state"
_STANDARD = ("state", "param_groups")


class OptimizerComponent(Component):
    """``optimizer``: one optimizer or a dict of them, over the model's parameters."""

    kind = "optimizer"
    verify_live = True

    def __init__(self, optimizer: Any, model: ModelComponent, name: str = "optimizer") -> None:
        self.name = name
        self.optimizers = named(optimizer, torch.optim.Optimizer, "optimizer")
        self.model = model
        self._fqn_of: dict[nn.Parameter, str] | None = None
        self._fsdp1: dict[str | None, FSDP1Optimizer] | None = None

    def _fqns(self) -> dict[nn.Parameter, str]:
        """Each parameter's FQN; FSDP1 flat parameters (many FQNs) are left out: only
        optimizers over FSDP1 models hold them, and those go through FSDP1Optimizer."""
        if self._fqn_of is None:
            sets = self.model.parameter_fqn_sets()
            self._fqn_of = {p: next(iter(f)) for p, f in sets.items() if len(f) == 1}
        return self._fqn_of

    def _fsdp1_optimizers(self) -> dict[str | None, FSDP1Optimizer]:
        """The optimizers over an FSDP1 model (by their name), each with that model."""
        if self._fsdp1 is None:
            self._fsdp1 = {}
            for name, opt in self.optimizers.items():
                held = {id(p) for group in opt.param_groups for p in group["params"]}
                for key, module in self.model.models.items():
                    if self.model.fsdp1[key] and any(id(p) in held for p in module.parameters()):
                        prefix = "" if key is None else f"{key}."
                        self._fsdp1[name] = FSDP1Optimizer(module, opt, prefix, self._where(name))
                        break
        return self._fsdp1

    def _group_fqns(self, name: str | None, opt: torch.optim.Optimizer) -> list[list[str]]:
        fsdp = self._fsdp1_optimizers().get(name)
        if fsdp is not None:
            return fsdp.groups()
        return group_fqns(opt, self._fqns(), self._where(name), "the model passed to Checkpointer")

    def _where(self, name: str | None) -> str:
        return "optimizer" if name is None else f"optimizer[{name!r}]"

    def _capture_one(self, name: str | None, opt: torch.optim.Optimizer) -> dict[str, Any]:
        fsdp = self._fsdp1_optimizers().get(name)
        if fsdp is not None:
            return fsdp.capture()
        where = self._where(name)
        groups = self._group_fqns(name, opt)
        by_index = [fqn for names in groups for fqn in names]
        sd = opt.state_dict()
        if NON_PARAM_STATE in sd:
            raise ValueError(f"{where}.state_dict() uses the reserved key {NON_PARAM_STATE!r}")
        state: dict[str, Any] = {}
        other: dict[Any, Any] = {}
        for key, value in sd["state"].items():
            if isinstance(key, int) and not isinstance(key, bool) and 0 <= key < len(by_index):
                state[by_index[key]] = value
            else:  # optimizer.state under a key that is not a parameter
                other[key] = value
        param_groups = []
        for saved in sd["param_groups"]:
            entry = {k: v for k, v in saved.items() if k != "params"}
            entry["params"] = [by_index[i] for i in saved["params"]]
            param_groups.append(entry)
        out: dict[str, Any] = {"state": state, "param_groups": param_groups}
        if other:
            out[NON_PARAM_STATE] = other
        out.update((k, v) for k, v in sd.items() if k not in _STANDARD)
        return out

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
            live_groups = self._group_fqns(name, opt)
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
                        f"parameter(s) {listing(lacking)}; their optimizer state would start "
                        "fresh silently. Pass reset={'optimizer'} to start it fresh on purpose"
                    )
                extra = sorted(set(s) - set(live))
                if extra:
                    raise StateMismatchError(
                        f"{where}, group {g}: the checkpoint has optimizer state for "
                        f"{listing(extra)}, which the live optimizer group does not hold"
                    )

    def targets(self, saved_keys: dict[str, dict], live: dict[str, torch.Tensor]) -> dict:
        params = {fqn: p for p, fqn in self._fqns().items()}
        shapes = {fqn: p.shape for fqn, p in params.items()}
        # FSDP1: the original parameters' unsharded shapes; their state loads into DTensors
        # sharded as FSDP shards it.
        sharded = {
            fqn: (fsdp, original)
            for fsdp in self._fsdp1_optimizers().values()
            for fqn, original in fsdp.originals().items()
        }
        shapes.update((fqn, original.shape) for fqn, (_, original) in sharded.items())
        out, wrong = {}, []
        for key, entry in saved_keys.items():
            fqn, state_name = _param_of_state_key(key, shapes)
            shape = shapes.get(fqn) if fqn is not None else None
            if shape is not None and state_name in PARAM_SHAPED and list(shape) != entry["shape"]:
                wrong.append(
                    f"{fqn}/{state_name}: saved shape {tuple(entry['shape'])}, parameter "
                    f"shape {tuple(shape)}"
                )
            if fqn in sharded and entry["shape"]:
                fsdp, original = sharded[fqn]
                out[key] = fsdp.target(entry, original)
            else:
                out[key] = empty_target(entry, params.get(fqn) if fqn is not None else None)
        if wrong:
            raise StateMismatchError(
                "optimizer state does not fit the live parameters (the model changed since "
                "the save; pass reset={'optimizer'} to start the optimizer fresh on purpose): "
                + "; ".join(wrong[:5])
            )
        return out

    def install(self, state: Any) -> None:
        fsdp = self._fsdp1_optimizers()
        for name, opt in self.optimizers.items():
            saved = state if name is None else state[name]
            if name in fsdp:
                fsdp[name].install(saved)
            else:
                self._install_one(name, opt, saved)

    def _install_one(self, name: str | None, opt: torch.optim.Optimizer, saved: dict) -> None:
        where = self._where(name)
        live_groups = self._group_fqns(name, opt)
        index = {fqn: i for i, fqn in enumerate(f for names in live_groups for f in names)}
        groups = []
        for g, names in enumerate(live_groups):
            entry = {k: v for k, v in saved["param_groups"][g].items() if k != "params"}
            entry["params"] = [index[f] for f in names]
            groups.append(entry)
        state: dict[Any, Any] = {index[fqn]: dict(v) for fqn, v in saved["state"].items()}
        other = saved.get(NON_PARAM_STATE, {})
        if not isinstance(other, Mapping):
            raise CorruptCheckpointError(f"{where}: the saved {NON_PARAM_STATE!r} is no mapping")
        state.update(other)
        extras = {k: v for k, v in saved.items() if k not in (*_STANDARD, NON_PARAM_STATE)}
        try:
            opt.load_state_dict({"state": state, "param_groups": groups, **extras})
        except Exception as exc:  # torch's own checks of what it is given
            raise StateMismatchError(
                f"{where}.load_state_dict refused the saved state ({type(exc).__name__}: "
                f"{exc}); it does not fit this optimizer"
            ) from exc
        # torch's load_state_dict casts floating state, nested lists and dicts included, to
        # each parameter's dtype (fp32 moments of a bf16 parameter become bf16): put back
        # exactly what was saved.
        params = {fqn: p for p, fqn in self._fqns().items()}
        for fqn, value in saved["state"].items():
            live_state = opt.state[params[fqn]]
            for k, v in value.items():
                if live_state.get(k) is not v:
                    live_state[k] = v
        for k, v in other.items():
            if opt.state.get(k) is not v:
                opt.state[k] = v


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


def _param_of_state_key(key: str, params: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """(parameter FQN, state entry name) of an optimizer state key ``.../state/<fqn>/<name>``."""
    parts = key.split("/")
    if "state" in parts:
        i = parts.index("state")
        if i + 1 < len(parts):
            fqn = parts[i + 1].replace("%2F", "/").replace("%25", "%")
            if fqn in params:
                name = parts[i + 2] if i + 2 < len(parts) else None
                return fqn, name
    return None, None
