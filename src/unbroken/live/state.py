"""Live training objects <-> nested state with tensors, one class per kind of component.

Model and optimizer state are keyed by normalized parameter FQNs (torch's own rules for
``torch.compile``, activation checkpointing, DDP, FSDP1 and FSDP2 wrappers), so a
checkpoint restores into the same model wrapped differently. Load targets are built from what the
checkpoint holds, never from the live optimizer's lazily created state (DESIGN.md F1).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor

from ..errors import CheckpointError, IncompleteCheckpointError, StateMismatchError
from ..format import layout, tree
from ..format.manifest import DTYPES
from . import exchange, frozen, fsdp1, torch_compat
from .torch_compat import normalized_fqns

_MAX_LISTED = 5


def listing(names: list[str]) -> str:
    """``a, b, c, d, e and 3 more``: names in a message, the first few."""
    shown = ", ".join(names[:_MAX_LISTED])
    more = len(names) - _MAX_LISTED
    return shown + (f" and {more} more" if more > 0 else "")


def device_kind(t: torch.Tensor) -> str:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.device.type


def empty_target(entry: dict[str, Any], like: torch.Tensor | None) -> torch.Tensor:
    """An uninitialized tensor to load a saved tensor into: the saved shape, dtype and
    memory layout (strides), placed (device, sharding) like the live tensor ``like``.

    Never on a device the file names (it is untrusted: ``cuda:99``, ``meta``): a tensor
    saved from the host goes to the host, any other to ``like``'s device, or with no live
    counterpart to this machine's current accelerator, or the host where there is none."""
    shape, dtype = entry["shape"], DTYPES[entry["dtype"]]
    if like is not None and isinstance(like, DTensor) and list(like.shape) == shape:
        return torch.empty_like(like, dtype=dtype)
    accelerator = None if like is not None else torch.accelerator.current_accelerator(True)
    if entry.get("device", "cpu") == "cpu" or (like is None and accelerator is None):
        device = torch.device("cpu")
    elif like is not None:
        device = (like.to_local() if isinstance(like, DTensor) else like).device
    else:
        device = torch.device(accelerator.type, torch.accelerator.current_device_index())
    if "stride" in entry:
        return torch.empty_strided(shape, entry["stride"], dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def named(obj: Any, kind: type | tuple[type, ...], what: str) -> dict[str | None, Any]:
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

    def installed_skeleton(self, skeleton: Any) -> Any:
        """The skeleton a capture gives right after installing the saved ``skeleton``: the
        same, unless installing reorders what means the same (an optimizer's groups)."""
        return skeleton

    verify_live = False  # recapture after install and compare fingerprints

    def save_warnings(self) -> list[str]:
        """What the last capture found that a resume cannot restore cheaply or exactly."""
        return []


class ModelComponent(Component):
    """``model``: one module or a dict of them, through torch's model state-dict API."""

    kind = "model"
    verify_live = True

    def __init__(
        self,
        model: nn.Module | Mapping[str, nn.Module],
        name: str = "model",
        frozen_mode: str = "save",
    ) -> None:
        self.name = name
        self.models = named(model, nn.Module, "model")
        # "verify": frozen parameters are left out of saves, proven by fingerprint
        # (core/frozen.py keeps the base's record in ``base``).
        self.frozen_mode = frozen.check_mode(frozen_mode)
        self.base: frozen.Base | None = None
        # Tensor keys every capture leaves out (a restore of a checkpoint that did not
        # store them sets it while it runs).
        self.omit: frozenset[str] = frozenset()
        # FSDP1 models give their sharded state as DTensors within fsdp1.sharded_state.
        self.fsdp1 = {
            key: fsdp1.is_fsdp1(m, "model" if key is None else f"model[{key!r}]")
            for key, m in self.models.items()
        }
        if None not in self.models:
            _check_joined_names(self.models)

    def _state_context(self, key: str | None) -> Any:
        return fsdp1.sharded_state(self.models[key]) if self.fsdp1[key] else nullcontext()

    def capture(self) -> Any:
        """The model's state (keyed by normalized FQN), without the keys in :attr:`omit`."""
        state = self.capture_all()
        if not self.omit:
            return state
        return frozen.without(state, self.omit, self.name, None not in self.models)

    def frozen_keys(self) -> set[str]:
        """Tensor keys of the frozen parameters (live/frozen.py says which count)."""
        return frozen.frozen_keys(self.models, self.name)

    def frozen_tensors(self, keys: set[str], state: Any = None) -> dict[str, torch.Tensor]:
        """The live tensors of ``keys`` in a full capture (``state``, else a new one)."""
        state = self.capture_all() if state is None else state
        return frozen.tensors_of(state, keys, self.name, None not in self.models)

    def capture_all(self) -> Any:
        """The model's whole state, keyed by normalized FQN."""

        # torch returns an OrderedDict; a plain dict keeps the model's skeleton a JSON
        # object keyed by FQN (what offline tools read), in the same order. The container
        # type means nothing here: set_model_state_dict takes any mapping. strict=False:
        # torch refuses an empty model state only when strict; a part without state
        # (nn.Identity) is simply empty.
        def one(key: str | None) -> dict[str, Any]:
            module = self.models[key]
            if not self.fsdp1[key] and torch_compat.is_unwrapped(module):
                return dict(module.state_dict())  # what torch's API returns for it, faster
            with self._state_context(key):
                return dict(get_model_state_dict(module, options=_GET_OPTIONS))

        if None in self.models:
            return one(None)
        return {key: one(key) for key in self.models}

    def parameter_fqn_sets(self) -> dict[nn.Parameter, set[str]]:
        """Each parameter's normalized FQNs (prefixed ``name.`` for a dict of models): one,
        or for an FSDP1 flat parameter those of the original parameters it holds."""
        out: dict[nn.Parameter, set[str]] = {}
        for name, module in self.models.items():
            for raw, param in module.named_parameters():
                fqns = normalized_fqns(module, raw)
                out[param] = fqns if name is None else {f"{name}.{fqn}" for fqn in fqns}
        return out

    def parameter_fqns(self) -> dict[nn.Parameter, str]:
        """Each parameter's normalized FQN (prefixed ``name.`` for a dict of models).

        Raises:
            CheckpointError: a parameter is an FSDP1 flat parameter (many FQNs).
        """
        out: dict[nn.Parameter, str] = {}
        for param, fqns in self.parameter_fqn_sets().items():
            if len(fqns) != 1:
                raise CheckpointError(
                    f"a parameter maps to {len(fqns)} FQNs ({listing(sorted(fqns))}): an "
                    "FSDP1 flat parameter (use_orig_params=False); this needs one parameter "
                    "per FQN: use use_orig_params=True, FSDP2 fully_shard or the plain model"
                )
            out[param] = next(iter(fqns))
        return out

    def trainable_fqns(self) -> list[str]:
        """Sorted FQNs of the trainable parameters (not buffers, not frozen)."""
        fqns = self.parameter_fqn_sets()
        return sorted({fqn for p, names in fqns.items() if p.requires_grad for fqn in names})

    def targets(self, saved_keys: dict[str, dict], live: dict[str, torch.Tensor]) -> dict:
        """Load targets shaped as saved. A shape change is refused unless the tensor's
        module loads its state itself (it may resize it, as torch lets it: verified after
        the install); a lazy module's uninitialized tensor takes the saved shape, as torch's
        ``load_state_dict`` materializes it."""
        missing = sorted(set(live) - set(saved_keys))
        if missing:
            raise IncompleteCheckpointError(
                f"the checkpoint has no saved value for {len(missing)} tensor(s) of the live "
                f"model: {listing(missing)}. If the model gained these on purpose, start "
                "from weights you convert yourself; the checkpoint does not cover them"
            )
        unknown = sorted(set(saved_keys) - set(live))
        if unknown:
            raise StateMismatchError(
                f"the checkpoint holds {len(unknown)} tensor(s) the live model lacks: "
                f"{listing(unknown)}; the architecture changed since the save"
            )
        lazy = {key: t for key, t in live.items() if torch_compat.is_uninitialized(t)}
        _check_lazy_dtypes(lazy, saved_keys)
        resized = {
            key
            for key, entry in saved_keys.items()
            if key not in lazy and list(live[key].shape) != entry["shape"]
        }
        wrong = sorted(resized - self._self_loaded_keys()) if resized else []
        if wrong:
            raise StateMismatchError(
                "the architecture changed since the save: "
                + "; ".join(
                    f"{key}: saved shape {tuple(saved_keys[key]['shape'])}, live shape "
                    f"{tuple(live[key].shape)}"
                    for key in wrong[:_MAX_LISTED]
                )
                + ". (A tensor that changes shape in training loads only where its module "
                "resizes it in its own _load_from_state_dict, as torch's load_state_dict "
                "requires)"
            )
        relaid = [
            f"{key}: saved with {layout.describe(entry['stride'], entry['shape'])}, live has "
            f"{layout.describe(live[key].stride(), entry['shape'])}"
            for key, entry in saved_keys.items()
            if "stride" in entry
            and key not in lazy
            and key not in resized
            and not isinstance(live[key], DTensor)
            and list(live[key].stride()) != entry["stride"]
        ]
        if relaid:
            raise StateMismatchError(
                "the live model's memory layout differs from the saved one, so training would "
                "not continue bit for bit: " + "; ".join(relaid[:_MAX_LISTED]) + ". Lay the "
                "model out as it was at save (e.g. model.to(memory_format=torch.channels_last)) "
                "before restore()"
            )
        return {key: empty_target(entry, live[key]) for key, entry in saved_keys.items()}

    def _self_loaded_keys(self) -> set[str]:
        """The tensor keys (as in :meth:`targets`) of the parameters and buffers whose
        module, or a module above it, may resize them as it loads (:func:`_loads_itself`)."""
        out: set[str] = set()
        for name, module in self.models.items():
            own = [
                prefix
                for prefix, m in module.named_modules(remove_duplicate=False)
                if _loads_itself(m, root=m is module)
            ]
            if not own:
                continue
            raw = itertools.chain(
                module.named_parameters(remove_duplicate=False),
                module.named_buffers(remove_duplicate=False),
            )
            for n, _ in raw:
                if any(not p or n.startswith(p + ".") for p in own):
                    for fqn in normalized_fqns(module, n):
                        path = (fqn,) if name is None else (name, fqn)
                        out.add(tree.join_key(self.name, *path))
        return out

    def exchange_plan(
        self, live: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]
    ) -> exchange.Exchange | None:
        """How to install ``targets`` by exchanging bytes with ``live`` (this model's state,
        keyed alike), or None where only :meth:`install` is faithful (FSDP1 among them)."""
        if any(self.fsdp1.values()):
            return None
        return exchange.plan(self.models, live, targets)

    def install(self, state: Any) -> None:
        # Left-out frozen parameters keep their live values; targets() checked the rest.
        options = StateDictOptions(strict=not self.omit)
        for name, module in self.models.items():
            part = state if name is None else state[name]
            if not part:  # an empty part has no live tensors either (checked by targets())
                continue
            try:
                with self._state_context(name):
                    set_model_state_dict(module, part, options=options)
            except Exception as exc:  # torch's strict checks of the non-tensor entries
                label = "model" if name is None else f"model[{name!r}]"
                raise StateMismatchError(
                    f"{label} refused the saved state ({type(exc).__name__}: {exc}); it does "
                    "not fit this model"
                ) from exc


_GET_OPTIONS = StateDictOptions(strict=False)


def _loads_itself(module: nn.Module, *, root: bool) -> bool:
    """Whether code of the user's takes part in loading ``module`` before torch compares
    shapes, and so may resize a tensor as torch's ``load_state_dict`` lets it: its own
    ``_load_from_state_dict`` (or, at the ``root``, ``load_state_dict``) or a load pre-hook.
    torch's own overrides and hooks (BatchNorm's, wrappers' prefixes, lazy modules') do not
    resize: a shape change there is the architecture's."""
    cls = type(module)
    own = [cls._load_from_state_dict, *module._load_state_dict_pre_hooks.values()]
    if root:
        own.append(cls.load_state_dict)
    return not all(_defined_in_torch(fn) for fn in own)


def _defined_in_torch(fn: object) -> bool:
    where = getattr(getattr(fn, "hook", fn), "__module__", None) or ""
    return where == "torch" or where.startswith("torch.")


def _check_lazy_dtypes(lazy: dict[str, torch.Tensor], saved_keys: dict[str, dict]) -> None:
    """Refuse, before anything changes, a lazy module's uninitialized tensor whose dtype is
    not the saved one: loading materializes it in its own dtype and casts the values."""
    cast = [
        f"{key} (saved {saved_keys[key]['dtype']}, live {str(t.dtype).removeprefix('torch.')})"
        for key, t in lazy.items()
        if str(t.dtype).removeprefix("torch.") != saved_keys[key]["dtype"]
    ]
    if cast:
        raise StateMismatchError(
            "the live model has lazy modules not yet run (uninitialized parameters or "
            f"buffers) in another dtype than the checkpoint's: {listing(cast)}. restore() "
            "materializes them in the saved shapes, as torch's load_state_dict does, but in "
            "their own dtype, which would cast the saved values: build the lazy modules with "
            "the saved dtype (e.g. nn.LazyLinear(n, dtype=...)) before restore()"
        )


def _check_joined_names(models: dict[str, nn.Module]) -> None:
    """Refuse dict keys whose joined names collide (``{"a": m1, "a.0": m2}``: m1's
    ``0.weight`` and m2's ``weight`` are both ``a.0.weight``): optimizer state and the
    offline tools key tensors by these names, so the two would mix."""
    owner: dict[str, str] = {}
    for name, module in models.items():
        for fqn in _state_fqns(module):
            joined = f"{name}.{fqn}"
            first = owner.setdefault(joined, name)
            if first != name:
                raise ValueError(
                    f"model[{first!r}] and model[{name!r}] both have a tensor named "
                    f"{joined!r} once the dict key and the FQN are joined; optimizer state "
                    "is keyed by these names and would mix: rename a dict key (e.g. to one "
                    "without '.')"
                )


def _state_fqns(module: nn.Module) -> list[str]:
    """Normalized FQNs of the module's parameters and persistent buffers, in order."""
    raw = [n for n, _ in module.named_parameters()]
    for n, _ in module.named_buffers():
        owner, _, leaf = n.rpartition(".")
        if leaf not in module.get_submodule(owner)._non_persistent_buffers_set:
            raw.append(n)
    return list(dict.fromkeys(fqn for n in raw for fqn in sorted(normalized_fqns(module, n))))


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
