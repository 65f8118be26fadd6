"""Installing a model's verified tensors by exchanging bytes with the live ones in place.

``load_state_dict`` copies each loaded tensor into its parameter, and a restore that can
be undone must first clone every parameter: one more copy of the weights in new memory.
Exchanging the bytes of the loaded and the live tensor through a small buffer installs
the loaded values and leaves the previous ones in the loaded tensor, which becomes the
undo: no new memory, about the cost of one copy, and the parameters stay the same objects
at the same addresses (views of them, FSDP2's padded shards, stay valid).

It is the same as ``load_state_dict`` only where that is a plain copy into the registered
tensors, so :func:`plan` accepts a model only when every module loads with
``nn.Module``'s own ``_load_from_state_dict``, has no extra state and no load hooks (but
FSDP2's own, which reshard first and are no-ops for tensors changed in place), and every
tensor of its state dict is one of its registered parameters or buffers, laid out like the
loaded one. Anything else installs through ``load_state_dict`` as before.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..errors import StateMismatchError
from ..format import bitwise
from . import torch_compat

_CHUNK = 1 << 20  # bytes per step: the buffer stays in cache


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach()


def _where(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.device, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


def _plain(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes are its values: a dense tensor of torch's own class (not a
    subclass, sparse, quantized or lazily conjugated/negated view)."""
    return (
        type(t) is torch.Tensor
        and t.layout == torch.strided
        and not t.is_quantized
        and not t.is_conj()
        and not t.is_neg()
    )


def _span(t: torch.Tensor) -> torch.Tensor | None:
    """``t``'s bytes as one flat uint8 view when its elements fill one block of memory
    (any dense layout: contiguous, channels-last, ...), else None."""
    expected = 1
    for stride, size in sorted(
        ((s, n) for s, n in zip(t.stride(), t.shape, strict=True) if n != 1)
    ):
        if stride != expected:
            return None
        expected *= size
    try:
        return t.as_strided((t.numel(),), (1,), t.storage_offset()).view(torch.uint8)
    except RuntimeError:  # a dtype without a byte view
        return None


def _loads_plainly(module: nn.Module) -> bool:
    if type(module).load_state_dict is not nn.Module.load_state_dict:
        return False
    for m in module.modules():
        cls = type(m)
        if cls._load_from_state_dict is not nn.Module._load_from_state_dict:
            return False
        if cls.set_extra_state is not nn.Module.set_extra_state:
            return False
        hooks = [*m._load_state_dict_pre_hooks.values(), *m._load_state_dict_post_hooks.values()]
        if not all(torch_compat.is_fsdp2_load_hook(h) for h in hooks):
            return False
    return True


def _registered(modules: Mapping[Any, nn.Module]) -> set[tuple[Any, ...]]:
    out = set()
    for module in modules.values():
        for m in module.modules():
            for t in (*m._parameters.values(), *m._buffers.values()):
                if t is not None and _plain(_local(t)):
                    out.add(_where(_local(t)))
    return out


class Exchange:
    """The byte exchanges that install one model's loaded tensors, and their undo."""

    def __init__(self, pairs: list[tuple[str, torch.Tensor, torch.Tensor]], ties: dict) -> None:
        self._pairs = pairs  # (key, live bytes, loaded bytes)
        self._ties = ties  # key -> the key whose live tensor it shares
        # Progress, each field set by one assignment so that an interrupt (Ctrl-C) between
        # any two statements leaves it true: pairs before _at[0] and the first _at[1] bytes
        # of that pair are exchanged; the buffer holds the live bytes of the chunk at
        # _held_at while that chunk's exchange may be half done.
        self._at = (0, 0)
        self._held_at: tuple[int, int] | None = None
        self._buffers: dict[torch.device, torch.Tensor] = {}

    @property
    def keys(self) -> list[str]:
        return [key for key, _, _ in self._pairs] + list(self._ties)

    def check_ties(self, targets: Mapping[str, torch.Tensor]) -> None:
        """Refuse, before anything changes, a checkpoint whose values differ for names that
        are one tensor in the live model (``load_state_dict`` would keep the last)."""
        for key, first in self._ties.items():
            if not bitwise.equal(targets[key], targets[first]):
                raise StateMismatchError(
                    f"{key!r} and {first!r} are one tensor in the live model (tied), but the "
                    "checkpoint holds different values for them: it was saved from a model "
                    "where they were separate; tie or untie them as they were at save"
                )

    def install(self) -> None:
        """Exchange every pair; :meth:`undo` puts back what was exchanged, also after an
        interrupt."""
        # The byte views are detached: no autograd mode to set (or to leak on an interrupt).
        for i in range(self._at[0], len(self._pairs)):
            _, live, loaded = self._pairs[i]
            buffer = self._buffer(live.device)
            for offset in range(0, live.numel(), _CHUNK):
                end = min(offset + _CHUNK, live.numel())
                a, b, held = live[offset:end], loaded[offset:end], buffer[: end - offset]
                held.copy_(a)
                self._held_at = (i, offset)
                a.copy_(b)
                b.copy_(held)
                self._at = (i, end)
                self._held_at = None
            self._at = (i + 1, 0)
        self._buffers.clear()

    def undo(self) -> None:
        """Put the previous live bytes back: they are in the loaded tensors (and for a
        chunk interrupted midway, in the buffer). Idempotent, so interrupt-safe: it only
        copies from the loaded tensors and the buffer, which it never changes, and resets
        the progress (then frees the buffer) last, so a rollback that an interrupt cut
        short runs it again and completes it; run again once done, it copies nothing."""
        done, offset = self._at
        for _, live, loaded in self._pairs[:done]:
            live.copy_(loaded)
        if done < len(self._pairs):
            _, live, loaded = self._pairs[done]
            live[:offset].copy_(loaded[:offset])
        if self._held_at is not None:
            i, start = self._held_at
            live = self._pairs[i][1]
            n = min(_CHUNK, live.numel() - start)
            live[start : start + n].copy_(self._buffer(live.device)[:n])
        self._at, self._held_at = (0, 0), None
        self._buffers.clear()

    def _buffer(self, device: torch.device) -> torch.Tensor:
        if device not in self._buffers:
            self._buffers[device] = torch.empty(_CHUNK, dtype=torch.uint8, device=device)
        return self._buffers[device]


def plan(
    models: Mapping[Any, nn.Module],
    live: Mapping[str, torch.Tensor],
    targets: Mapping[str, torch.Tensor],
) -> Exchange | None:
    """The exchanges that install ``targets`` into ``models``' live tensors (``live``:
    their state dict, keyed like ``targets``), or None where only ``load_state_dict``
    installs them faithfully."""
    if torch.__future__.get_swap_module_params_on_conversion():
        return None
    if not all(_loads_plainly(m) for m in models.values()) or set(live) != set(targets):
        return None
    registered = _registered(models)
    pairs, ties, owners = [], {}, {}
    spans: list[tuple[int, int, torch.device]] = []
    for key, t in live.items():
        mine, theirs = _local(t), _local(targets[key])
        if not (_plain(mine) and _plain(theirs)):
            return None
        where = _where(mine)
        if where not in registered or isinstance(t, DTensor) != isinstance(targets[key], DTensor):
            return None
        if (mine.shape, mine.stride(), mine.dtype, mine.device) != (
            theirs.shape,
            theirs.stride(),
            theirs.dtype,
            theirs.device,
        ):
            return None
        first = owners.setdefault(where, key)
        if first != key:
            ties[key] = first
            continue
        a, b = _span(mine), _span(theirs)
        if a is None or b is None:
            return None
        if a.numel():
            spans.append((a.data_ptr(), a.data_ptr() + a.numel(), a.device))
        pairs.append((key, a, b))
    spans.sort(key=lambda s: (str(s[2]), s[0]))
    for (_, end, dev), (start, _, dev2) in itertools.pairwise(spans):
        if dev == dev2 and start < end:  # two names overlap without being one tensor
            return None
    return Exchange(pairs, ties)
