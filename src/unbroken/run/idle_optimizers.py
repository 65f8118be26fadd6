"""An optimizer that holds no state while the parameters it covers change: not the one
that trains the model.

A script that builds an optimizer, then builds the real one and passes the first to the
Checkpointer, saves an optimizer with empty state at every step while the model trains:
the checkpoints restore "verified", yet a resume starts the real optimizer from
nothing. A save can tell, at no extra cost: it fingerprints every model tensor anyway
(``core/verify.py``), so rank 0 compares the trained parameters' fingerprints with the
previous save's (or the restored checkpoint's), kept in memory, and asks each optimizer
that covers a changed parameter whether it holds any state, and whether it stepped since
that save (a step post-hook counts its steps). Holding no state is normal for an
optimizer that keeps none: torch's SGD without momentum stores nothing per parameter
(``state`` stays empty after every step), so only an optimizer that also did not step
is named. An optimizer whose steps cannot be counted (no step hooks) is never named.

The finding is a warning, not an error: logged, in ``Checkpointer.warnings``, in the
manifest (``save_warnings``), and reported by ``unbroken verify``.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from ..live.optimizer import NON_PARAM_STATE, OptimizerComponent
from ..live.state import Component, ModelComponent

Key = tuple[str, str | None]  # (component name, optimizer name in it)
_SHOWN = 3


class IdleOptimizers:
    """What rank 0 compares at each save: the trained parameters' fingerprints at the
    last committed save, and how often each optimizer stepped since.

    Thread-safe: the step hooks count in the training thread while a background save
    compares and commits.
    """

    def __init__(self, components: list[Component]) -> None:
        self._counts: dict[Key, int] = {}
        self._handles: list[Any] = []
        self._single: dict[str, bool] = {}  # optimizer component -> one optimizer (no dict)
        self._model: tuple[str, bool] | None = None  # model component's name, one model
        self._lock = threading.Lock()
        for c in components:
            if isinstance(c, ModelComponent):
                self._model = (c.name, None in c.models)
            if isinstance(c, OptimizerComponent):
                self._single[c.name] = None in c.optimizers
                for name, opt in c.optimizers.items():
                    self._watch((c.name, name), opt)
        self._at_commit: dict[Key, int] = dict(self._counts)
        self._prints: dict[str, str] | None = None  # model tensor key -> fingerprint
        self._algorithm: str | None = None
        self._step: int | None = None  # the step those fingerprints were saved at

    def _watch(self, key: Key, opt: Any) -> None:
        def count(*_: Any) -> None:
            with self._lock:
                self._counts[key] += 1

        try:
            self._handles.append(opt.register_step_post_hook(count))
        except Exception:  # not a torch optimizer underneath: its steps are not counted
            return
        self._counts[key] = 0

    def counts(self) -> dict[Key, int]:
        """Each watched optimizer's steps so far (taken at ``save()``)."""
        with self._lock:
            return dict(self._counts)

    def findings(
        self,
        skeletons: Mapping[str, Any],
        tensors: Mapping[str, Mapping[str, Any]],
        counts: Mapping[Key, int],
        algorithm: str,
    ) -> list[str]:
        """Rank 0, with the manifest's ``tensors`` of the save being written: one
        warning per optimizer that holds no state, did not step since the last save,
        and covers a parameter whose fingerprint changed since then."""
        if self._prints is None or self._algorithm != algorithm or self._model is None:
            return []
        keys = _model_keys(skeletons.get(self._model[0]), self._model[1])
        found = []
        for (component, name), steps in sorted(counts.items(), key=lambda kv: str(kv[0])):
            stepped = steps - self._at_commit.get((component, name), steps)
            state = _optimizer_state(skeletons.get(component), name, self._single[component])
            if stepped or state is None or _holds_state(state):
                continue
            covered = [f for g in state.get("param_groups") or [] for f in g.get("params") or []]
            changed = [
                fqn
                for fqn in covered
                if (k := keys.get(fqn)) in self._prints
                and tensors.get(k, {}).get("fingerprint") != self._prints[k]
            ]
            if changed:
                found.append(_message(component, name, changed, covered, self._step))
        return found

    def committed(
        self,
        step: int,
        skeletons: Mapping[str, Any],
        tensors: Mapping[str, Mapping[str, Any]],
        counts: Mapping[Key, int],
        algorithm: str,
    ) -> None:
        """Rank 0, after the save of ``step`` committed: its fingerprints and the step
        counts it was taken at are what the next save compares with."""
        if self._model is None:
            return
        keys = set(_model_keys(skeletons.get(self._model[0]), self._model[1]).values())
        self._prints = {k: str(tensors[k].get("fingerprint")) for k in keys if k in tensors}
        self._algorithm, self._step = algorithm, step
        self._at_commit = {**self._at_commit, **counts}

    def restored(self, doc: Mapping[str, Any]) -> None:
        """A restore loaded the checkpoint ``doc`` (its manifest): the next save compares
        with its fingerprints, and counts steps from now."""
        if self._model is None:
            return
        skeleton = (doc.get("components", {}).get(self._model[0]) or {}).get("state")
        self.committed(
            doc["step"],
            {self._model[0]: skeleton},
            doc.get("tensors", {}),
            self.counts(),
            str(doc.get("fingerprint_algorithm")),
        )

    def close(self) -> None:
        """Remove the step hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _model_keys(skeleton: Any, single: bool) -> dict[str, str]:
    """Normalized parameter FQN (``name.fqn`` for a dict of models) -> tensor key, from
    the model's saved skeleton."""
    parts = {None: skeleton} if single else (skeleton if isinstance(skeleton, dict) else {})
    keys: dict[str, str] = {}
    for model, entries in parts.items():
        if not isinstance(entries, dict):
            continue
        for fqn, ref in entries.items():
            if isinstance(ref, dict) and isinstance(ref.get("key"), str):
                keys[fqn if model is None else f"{model}.{fqn}"] = ref["key"]
    return keys


def _optimizer_state(skeleton: Any, name: str | None, single: bool) -> dict[str, Any] | None:
    state = skeleton if single else (skeleton.get(name) if isinstance(skeleton, dict) else None)
    if not isinstance(state, dict) or not isinstance(state.get("param_groups"), list):
        return None  # a layout this check does not know: say nothing
    return state


def _holds_state(state: dict[str, Any]) -> bool:
    """Any per-parameter state, or state under another key (never judged empty when it
    cannot be told)."""
    per_param = state.get("state")
    return bool(per_param) or not isinstance(per_param, dict) or bool(state.get(NON_PARAM_STATE))


def _message(
    component: str, name: str | None, changed: list[str], covered: list[str], since: int | None
) -> str:
    where = component if name is None else f"{component}[{name!r}]"
    shown = ", ".join(repr(f) for f in changed[:_SHOWN]) + (
        ", ..." if len(changed) > _SHOWN else ""
    )
    return (
        f"{where} holds no state at all and did not step since the checkpoint of step "
        f"{since}, while "
        f"{len(changed)} of the {len(covered)} parameters it covers changed ({shown}): it "
        "is probably not the optimizer that trains the model (one built before the real "
        "one?), and a resume would start the real one from nothing. Seen: no "
        "per-parameter state, 0 optimizer steps since that save, changed fingerprints. "
        "Pass the optimizer whose step() updates the model (an optimizer that keeps no "
        "state, like SGD without momentum, is never named while it steps)"
    )
