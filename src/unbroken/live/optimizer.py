"""``optimizer``: optimizer state keyed by parameter FQN, restored exactly (F1, F3, F5).

Everything ``Optimizer.state_dict()`` returns is saved: per-parameter state (keyed by the
parameter's normalized FQN instead of its position), param groups, state under keys that
are not parameters, and any extra top-level entries wrappers and third-party optimizers
add; and the optimizer's class, so that a restore into another class says so ("saved
AdamW, live SGD") before anything changes. On restore the state goes through
``load_state_dict`` (so the optimizer's hooks run), then every value torch cast or
converted is put back exactly as saved. Parameters are matched by FQN, so a param group
built in another order (from a set of names) restores the same state. An optimizer over
an FSDP1 model goes through FSDP's own conversion (``fsdp1.FSDP1Optimizer``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..errors import CorruptCheckpointError, IncompleteCheckpointError, StateMismatchError
from ..format.tree import TAG
from . import torch_compat
from .fsdp1 import FSDP1Optimizer
from .state import Component, ModelComponent, empty_target, listing, named

# State entries that always have their parameter's shape (torch's built-in optimizers).
PARAM_SHAPED = frozenset(
    {
        "exp_avg",
        "exp_avg_sq",
        "max_exp_avg_sq",
        "momentum_buffer",
        "square_avg",
        "acc_delta",
        "sum",
        "ax",
        "prev",
        "mu_product_buffer",
    }
)
# Where state kept under keys that are not parameters goes in a captured optimizer.
NON_PARAM_STATE = "unbroken:non_param_state"
# The optimizer's class (``module.qualname``) beside its state; checkpoints written before
# it was recorded lack it.
OPTIMIZER_CLASS = "unbroken:class"
_STANDARD = ("state", "param_groups")
_OURS = (*_STANDARD, NON_PARAM_STATE, OPTIMIZER_CLASS)


def class_name(opt: object) -> str:
    """The name an optimizer's class is recorded under: ``module.qualname``; for a view
    over another optimizer's state (``integrations/deepspeed.py``), the class it shows
    (its ``shown_class``)."""
    shown = getattr(opt, "shown_class", None)
    if isinstance(shown, str):
        return shown
    return f"{type(opt).__module__}.{type(opt).__qualname__}"


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

    def live_fqns(self, name: str | None) -> set[str]:
        """The FQNs of the parameters optimizer ``name`` holds."""
        return {f for names in self._group_fqns(name, self.optimizers[name]) for f in names}

    def _where(self, name: str | None) -> str:
        return "optimizer" if name is None else f"optimizer[{name!r}]"

    def _capture_one(self, name: str | None, opt: torch.optim.Optimizer) -> dict[str, Any]:
        fsdp = self._fsdp1_optimizers().get(name)
        out = fsdp.capture() if fsdp is not None else self._capture_plain(name, opt)
        out[OPTIMIZER_CLASS] = class_name(opt)
        return out

    def _capture_plain(self, name: str | None, opt: torch.optim.Optimizer) -> dict[str, Any]:
        where = self._where(name)
        groups = self._group_fqns(name, opt)
        by_index = [fqn for names in groups for fqn in names]
        sd = opt.state_dict()
        for reserved in (NON_PARAM_STATE, OPTIMIZER_CLASS):
            if reserved in sd:
                raise ValueError(f"{where}.state_dict() uses the reserved key {reserved!r}")
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
            self._check_class(where, opt, saved)
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

    def _check_class(self, where: str, opt: torch.optim.Optimizer, saved: dict) -> None:
        """Refuse, before anything changes, state saved from another optimizer class: a
        class recorded at save that differs from the live one, where the param groups'
        keys differ too (AdamW and Adam, whose groups fit each other, pass); for a
        checkpoint that recorded none, groups that each have keys the other lacks."""
        recorded = saved.get(OPTIMIZER_CLASS)
        if recorded == class_name(opt):
            return
        differs = _group_keys_differ(saved["param_groups"], opt.param_groups)
        if differs is None or (recorded is None and not all(differs)):
            return
        only_saved, only_live = differs
        live = type(opt).__name__
        entries = _state_entries(saved.get("state"))
        held = f"state {', '.join(entries)} per parameter, and " if entries else ""
        if isinstance(recorded, str):
            saved_as = recorded.rpartition(".")[2]
            head, build = f"saved {saved_as}, live {live}", f" ({saved_as})"
        else:
            head, build = f"another optimizer class than the live {live}", ""
        raise StateMismatchError(
            f"{where}: {head}. The checkpoint holds {held}param group keys "
            f"{', '.join(only_saved) or '(none of its own)'} that the live optimizer's groups "
            f"lack; the live groups have {', '.join(only_live) or '(none of their own)'}: "
            "another optimizer's state does not carry over. Build the optimizer as at save"
            f"{build} or pass reset={{{self.name!r}}} to start the {live} fresh on purpose"
        )

    def installed_skeleton(self, skeleton: Any) -> Any:
        """What capturing the optimizers gives right after installing ``skeleton``: each
        param group's FQNs in the live order (state is matched by FQN, so a group built in
        another order restores the same state), and the live class (checked before)."""

        def one(name: str | None, opt: torch.optim.Optimizer, saved: Any) -> Any:
            if not isinstance(saved, dict) or not isinstance(saved.get("param_groups"), list):
                return saved
            groups = saved["param_groups"]
            live = self._group_fqns(name, opt)
            if len(groups) == len(live):
                groups = [_reordered(g, names) for g, names in zip(groups, live, strict=True)]
            return {**saved, "param_groups": groups, OPTIMIZER_CLASS: class_name(opt)}

        if None in self.optimizers:
            return one(None, self.optimizers[None], skeleton)
        if not isinstance(skeleton, dict):
            return skeleton
        return {
            **skeleton,
            **{n: one(n, o, skeleton[n]) for n, o in self.optimizers.items() if n in skeleton},
        }

    def targets(self, saved_keys: dict[str, dict], live: dict[str, torch.Tensor]) -> dict:
        params = {fqn: p for p, fqn in self._fqns().items()}
        # A lazy module's uninitialized parameter has no shape until the model's install
        # materializes it (in the saved shape): its state is not checked against it.
        # DeepSpeed ZeRO-3 partitions each parameter, leaving an empty placeholder whose
        # whole shape is its ds_shape.
        shapes = {
            fqn: getattr(p, "ds_shape", p.shape)
            for fqn, p in params.items()
            if not torch_compat.is_uninitialized(p)
        }
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
            saved = {k: v for k, v in saved.items() if k != OPTIMIZER_CLASS}
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
        extras = {k: v for k, v in saved.items() if k not in _OURS}
        try:
            opt.load_state_dict({"state": state, "param_groups": groups, **extras})
        except Exception as exc:  # torch's own checks of what it is given
            raise StateMismatchError(
                f"{where}.load_state_dict refused the saved state ({type(exc).__name__}: "
                f"{exc}); it does not fit this optimizer"
            ) from exc
        # torch's load_state_dict casts floating state, nested lists and dicts included, to
        # each parameter's dtype (fp32 moments of a bf16 parameter become bf16): put back
        # exactly what was saved. Where the optimizer's own ``state`` does not hold it (a
        # wrapper whose base optimizer keeps it), nothing is added: the checks after the
        # install compare what state_dict() gives with what was saved.
        params = {fqn: p for p, fqn in self._fqns().items()}
        for fqn, value in saved["state"].items():
            live_state = opt.state.get(params[fqn])
            if not isinstance(live_state, dict):
                continue
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


def _group_keys_differ(
    saved: Any, live: list[dict[str, Any]]
) -> tuple[list[str], list[str]] | None:
    """(keys only the saved group has, keys only the live one has) for the first param
    group whose keys differ (``params`` aside), or None."""
    if not isinstance(saved, list):
        return None
    for s, group in zip(saved, live, strict=False):
        if not isinstance(s, dict) or TAG in s:
            return None
        mine, theirs = set(s) - {"params"}, set(group) - {"params"}
        if mine != theirs:
            return sorted(mine - theirs, key=str), sorted(theirs - mine, key=str)
    return None


def _state_entries(state: Any) -> list[str]:
    """The names of the per-parameter state entries a saved optimizer skeleton holds."""
    if not isinstance(state, dict):
        return []
    names = {k for v in state.values() if isinstance(v, dict) and TAG not in v for k in v}
    return sorted((n for n in names if isinstance(n, str)), key=str)[:8]


def _reordered(group: Any, live: list[str]) -> Any:
    """A saved param group skeleton with its FQNs in the live order, where it holds the same
    ones; else as saved (coverage refused a different set)."""
    if not isinstance(group, dict) or not isinstance(group.get("params"), list):
        return group
    if sorted(group["params"], key=str) != sorted(live):
        return group
    return {**group, "params": list(live)}


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
