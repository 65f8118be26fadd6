"""Pipeline stages: one model whose parts live on different ranks.

With pipeline parallelism each rank holds other modules of one model (stage 0 the first
layers, stage 1 the next) and an optimizer over them. A save writes one entry per
component holding every stage's names, keyed by model FQN as always: the ranks'
skeletons merged (:func:`merge`). A restore gives each rank the part its live objects
hold (:func:`held`), whatever the stages are now (another number of stages, one process,
or FSDP on every rank); state that no rank holds is refused (:func:`unheld_error`), as a
single process refuses state its model lacks.
"""

from __future__ import annotations

from typing import Any

from ..errors import CheckpointError, StateMismatchError
from ..format.tree import TAG
from .optimizer import OPTIMIZER_CLASS, OptimizerComponent
from .state import Component, ModelComponent, listing


def merge(component: Component, skeletons: list[Any]) -> Any:
    """One skeleton holding what each rank's holds (rank order kept).

    Raises:
        CheckpointError: the ranks disagree on a value both hold (a non-tensor entry, an
            optimizer's class or param group hyperparameters).
    """
    if isinstance(component, OptimizerComponent):
        if None in component.optimizers:
            return _merge_optimizer(skeletons, "optimizer")
        if not all(_plain(s) for s in skeletons):
            return skeletons[0]
        # Stages may key theirs differently (torchtitan: one optimizer per model part,
        # "stage0" on one rank, "stage1" on another): every rank's names, in rank order.
        names = dict.fromkeys(name for s in skeletons for name in s)
        return {
            name: _merge_optimizer(
                [s[name] for s in skeletons if name in s], f"optimizer[{name!r}]"
            )
            for name in names
        }
    return _merge_mappings(skeletons, component.name)


def _plain(value: Any) -> bool:
    return isinstance(value, dict) and TAG not in value


def _merge_mappings(skeletons: list[Any], where: str) -> Any:
    if not all(_plain(s) for s in skeletons):
        return skeletons[0]
    merged: dict[str, Any] = {}
    for r, skeleton in enumerate(skeletons):
        for key, value in skeleton.items():
            if key not in merged:
                merged[key] = value
            elif _plain(merged[key]) and _plain(value):
                merged[key] = _merge_mappings([merged[key], value], f"{where}.{key}")
            elif merged[key] != value:
                raise CheckpointError(
                    f"{where}: {key!r} holds another value on rank {r} than on a lower rank; "
                    "a name held by several pipeline stages must hold one value"
                )
    return merged


def _merge_optimizer(skeletons: list[Any], where: str) -> Any:
    first = skeletons[0]
    if not all(_plain(s) and isinstance(s.get("param_groups"), list) for s in skeletons):
        return first
    groups = [{**g, "params": []} for g in first["param_groups"]]
    seen: list[set[str]] = [set() for _ in groups]
    state: dict[str, Any] = {}
    for r, skeleton in enumerate(skeletons):
        if skeleton.get(OPTIMIZER_CLASS) != first.get(OPTIMIZER_CLASS) or len(
            skeleton["param_groups"]
        ) != len(groups):
            raise CheckpointError(
                f"{where} is another optimizer on rank {r} than on rank 0 (its class or its "
                "number of param groups): pipeline stages must build theirs alike"
            )
        for g, saved in enumerate(skeleton["param_groups"]):
            if _hyper(saved) != _hyper(groups[g]):
                raise CheckpointError(
                    f"{where}, param group {g}: other hyperparameters on rank {r} than on "
                    "rank 0; pipeline stages with their own hyperparameters are not "
                    "supported: give each its own param group"
                )
            new = [p for p in saved["params"] if p not in seen[g]]
            groups[g]["params"] += new
            seen[g].update(new)
        state.update((k, v) for k, v in skeleton.get("state", {}).items() if k not in state)
    return {**first, "state": state, "param_groups": groups}


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def held(component: Component, skeleton: Any, live_skeleton: Any) -> tuple[Any, list[str]]:
    """The part of a saved skeleton that ``component`` holds on this rank, and the saved
    names it does not hold (for :func:`unheld_error`, once every rank's are known).
    ``live_skeleton``: the component's live state as a skeleton (a model's)."""
    if isinstance(component, OptimizerComponent):
        if None in component.optimizers:
            return _held_optimizer(skeleton, component.live_fqns(None), "")
        if not _plain(skeleton):
            return skeleton, []
        out, missing = {}, []
        for name, saved in skeleton.items():
            if name in component.optimizers:
                out[name], lost = _held_optimizer(saved, component.live_fqns(name), "")
            else:  # another stage's optimizer: held there, or by no rank (refused)
                lost = sorted(_optimizer_names(saved))
            missing += [f"[{name!r}] {fqn}" for fqn in lost]
        return out, missing
    if isinstance(component, ModelComponent):
        if None in component.models:
            return _held_mapping(skeleton, live_skeleton, "")
        if not (_plain(skeleton) and _plain(live_skeleton)):
            return skeleton, []
        out, missing = dict(skeleton), []
        for name in component.models:
            if name in skeleton and name in live_skeleton:
                out[name], lost = _held_mapping(skeleton[name], live_skeleton[name], f"{name}.")
                missing += lost
        return out, missing
    return skeleton, []


def _held_mapping(saved: Any, live: Any, prefix: str) -> tuple[Any, list[str]]:
    if not (_plain(saved) and _plain(live)):
        return saved, []
    kept = {k: v for k, v in saved.items() if k in live}
    return kept, [prefix + k for k in saved if k not in live]


def _optimizer_names(saved: Any) -> set[str]:
    """The parameter FQNs a saved optimizer skeleton names (its state and its groups)."""
    if not (
        _plain(saved) and _plain(saved.get("state")) and isinstance(saved.get("param_groups"), list)
    ):
        return set()
    return set(saved["state"]) | {p for g in saved["param_groups"] for p in g.get("params", [])}


def _held_optimizer(saved: Any, fqns: set[str], prefix: str) -> tuple[Any, list[str]]:
    if not (
        _plain(saved) and _plain(saved.get("state")) and isinstance(saved.get("param_groups"), list)
    ):
        return saved, []
    missing = sorted(_optimizer_names(saved) - fqns)
    if not missing:
        return saved, []
    state = {k: v for k, v in saved["state"].items() if k in fqns}
    groups = [{**g, "params": [p for p in g["params"] if p in fqns]} for g in saved["param_groups"]]
    return {**saved, "state": state, "param_groups": groups}, [prefix + p for p in missing]


def unheld_error(component: Component, names: list[str]) -> StateMismatchError:
    """The error for saved state that no rank's live ``component`` holds."""
    if isinstance(component, OptimizerComponent):
        return StateMismatchError(
            f"{component.name}: the checkpoint has optimizer state for {len(names)} "
            f"parameter(s) that no live optimizer holds (on any rank): {listing(names)}; "
            "pass every parameter to the optimizer as at save, or reset={"
            f"{component.name!r}}} to start it fresh on purpose"
        )
    return StateMismatchError(
        "the architecture changed since the save: the checkpoint holds "
        f"{len(names)} value(s) the live model lacks (on every rank): "
        f"{listing([f'{component.name}/{n}' for n in names])}"
    )
