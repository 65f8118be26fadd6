"""Map a foreign optimizer state onto parameter FQNs, refusing anything that does not fit.

``optimizer.state_dict()`` keys state by *position*: parameters are numbered in the order
of the optimizer's param groups. We turn positions into FQNs through the live optimizer's
groups when the caller has one (the same pairing ``Optimizer.load_state_dict`` makes), or
else through the model's parameter order (``model.parameters()``, which is how an
optimizer built as ``AdamW(model.parameters())`` numbers them). DCP checkpoints are
already keyed by FQN. Every entry must land on exactly one parameter, or an error names
it; parameter-shaped state must have its parameter's shape (catches a wrong order).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import IncompleteCheckpointError, StateMismatchError
from ..live.optimizer import PARAM_SHAPED, group_fqns

ADAMW_STATE = frozenset({"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"})
ADAMW_HYPER = frozenset({"lr", "betas", "eps", "weight_decay"})


def listing(names: list[Any]) -> str:
    shown = ", ".join(map(str, names[:5]))
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def live_groups(
    optimizer: torch.optim.Optimizer, fqn_of: dict[nn.Parameter, str]
) -> list[list[str]]:
    return group_fqns(optimizer, fqn_of, "the factory's optimizer", "the factory's model")


def from_positions(
    saved: dict[str, Any], order: list[str], groups: list[list[str]] | None
) -> dict[str, Any]:
    """FQN-keyed ``{"state", "param_groups"}`` from torch's positional state_dict.

    Args:
        saved: ``optimizer.state_dict()`` as loaded from the foreign file.
        order: the model's parameter FQNs in ``model.parameters()`` order.
        groups: the live optimizer's groups as FQN lists, or None (model order is used).
    """
    saved_groups = saved["param_groups"]
    if groups is not None:
        sizes = [len(g["params"]) for g in saved_groups]
        if sizes != [len(g) for g in groups]:
            raise StateMismatchError(
                f"the imported optimizer has param groups of sizes {sizes}, the factory's "
                f"optimizer {[len(g) for g in groups]}"
            )
    else:
        count = sum(len(g["params"]) for g in saved_groups)
        if count != len(order):
            raise StateMismatchError(
                f"the imported optimizer holds {count} parameter(s), the model has "
                f"{len(order)}; return (model, optimizer) from the factory so positions can "
                "be matched through its param groups"
            )
    fqn_at: dict[int, str] = {}
    out_groups = []
    for g, group in enumerate(saved_groups):
        names = []
        for j, pos in enumerate(group["params"]):
            if pos in fqn_at:
                raise StateMismatchError(f"position {pos} appears in two param groups")
            if groups is None and not (isinstance(pos, int) and 0 <= pos < len(order)):
                raise StateMismatchError(f"param group {g} names position {pos!r}, out of range")
            fqn_at[pos] = groups[g][j] if groups is not None else order[pos]
            names.append(fqn_at[pos])
        out_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
    orphans = sorted((p for p in saved["state"] if p not in fqn_at), key=str)
    if orphans:
        raise StateMismatchError(
            f"optimizer state at position(s) {listing(orphans)} belongs to no param group"
        )
    state = {fqn_at[pos]: dict(v) for pos, v in saved["state"].items()}
    return {"state": state, "param_groups": out_groups}


def from_fqns(
    saved: dict[str, Any], order: list[str], groups: list[list[str]] | None
) -> dict[str, Any]:
    """FQN-keyed ``{"state", "param_groups"}`` from a DCP optimizer state."""
    state = {fqn: dict(v) for fqn, v in saved["state"].items()}
    if "param_groups" in saved:
        out_groups = []
        for g, group in enumerate(saved["param_groups"]):
            if not isinstance(group.get("params"), list):
                raise IncompleteCheckpointError(f"imported param group {g} lists no 'params'")
            out_groups.append(dict(group))
        if groups is not None:
            got = [sorted(g["params"]) for g in out_groups]
            if got != [sorted(g) for g in groups]:
                raise StateMismatchError(
                    "the imported param groups hold other parameters than the factory's "
                    "optimizer groups"
                )
            # Keep the live order inside each group: that is how positions pair up.
            out_groups = [
                {**g, "params": list(live)} for g, live in zip(out_groups, groups, strict=True)
            ]
        return {"state": state, "param_groups": out_groups}
    hyper: dict[str, dict[str, Any]] = saved.get("hyperparameters", {})
    unknown = sorted(set(hyper) - set(order))
    if unknown:
        raise StateMismatchError(f"imported hyperparameters for non-parameters {listing(unknown)}")
    if groups is None:  # one group per distinct set of hyperparameters, in model order
        groups = []
        seen: list[dict[str, Any]] = []
        for fqn in (f for f in order if f in hyper):
            if hyper[fqn] in seen:
                groups[seen.index(hyper[fqn])].append(fqn)
            else:
                seen.append(hyper[fqn])
                groups.append([fqn])
    out_groups = []
    for g, names in enumerate(groups):
        lacking = [f for f in names if f not in hyper]
        if lacking:
            raise IncompleteCheckpointError(
                f"the import has no param-group hyperparameters for {listing(lacking)}"
            )
        values = [hyper[f] for f in names]
        if any(v != values[0] for v in values):
            raise StateMismatchError(
                f"parameters of optimizer group {g} were saved with different hyperparameters"
            )
        out_groups.append({**(values[0] if values else {}), "params": list(names)})
    return {"state": state, "param_groups": out_groups}


def check(mapped: dict[str, Any], params: dict[str, torch.Tensor]) -> None:
    """Every FQN a parameter, once; parameter-shaped state of its parameter's shape."""
    grouped = [f for g in mapped["param_groups"] for f in g["params"]]
    not_params = sorted({f for f in [*grouped, *mapped["state"]] if f not in params})
    if not_params:
        raise StateMismatchError(
            f"imported optimizer state for {listing(not_params)}, which the model has no "
            "parameter for"
        )
    twice = sorted({f for f in grouped if grouped.count(f) > 1})
    if twice:
        raise StateMismatchError(f"parameter(s) {listing(twice)} appear in two param groups")
    stray = sorted(set(mapped["state"]) - set(grouped))
    if stray:
        raise StateMismatchError(f"optimizer state for {listing(stray)} is in no param group")
    wrong = [
        f"{fqn}/{name}: shape {tuple(v.shape)}, parameter {tuple(params[fqn].shape)}"
        for fqn, entries in mapped["state"].items()
        for name, v in entries.items()
        if name in PARAM_SHAPED and isinstance(v, torch.Tensor) and v.shape != params[fqn].shape
    ]
    if wrong:
        raise StateMismatchError(
            "imported optimizer state does not fit its parameter (were the param groups "
            "in another order than the model's parameters? return (model, optimizer) "
            f"from the factory): {'; '.join(wrong[:5])}"
        )


def build_adamw(mapped: dict[str, Any], params: dict[str, torch.Tensor]) -> torch.optim.AdamW:
    """An AdamW with the imported param groups, refusing state AdamW does not have."""
    names = sorted({n for entries in mapped["state"].values() for n in entries} - ADAMW_STATE)
    if names:
        raise StateMismatchError(
            f"the imported optimizer state has entries AdamW does not ({listing(names)}); "
            "return (model, optimizer) with the right optimizer from the factory"
        )
    groups = []
    for g, group in enumerate(mapped["param_groups"]):
        lacking = sorted(ADAMW_HYPER - set(group))
        if lacking:
            raise IncompleteCheckpointError(
                f"imported param group {g} lacks AdamW's {listing(lacking)}; return "
                "(model, optimizer) from the factory"
            )
        hyper = {k: v for k, v in group.items() if k != "params"}
        groups.append({**hyper, "params": [params[f] for f in group["params"]]})
    return torch.optim.AdamW(groups)
