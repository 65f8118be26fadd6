"""Installing a model's verified tensors by exchanging bytes with the live ones in place.

``load_state_dict`` copies each loaded tensor into its parameter, and a restore that can
be undone must first clone every parameter: one more copy of the weights in new memory.
Exchanging the bytes of the loaded and the live tensor installs the loaded values and
leaves the previous ones in the loaded tensor, which becomes the undo: no new memory,
about the cost of two copies, and the parameters stay the same objects at the same
addresses (views of them, FSDP2's padded shards, stay valid).

The exchange walks each tensor a chunk at a time: the live chunk's bytes go into the
loaded tensor's previous chunk (already installed, so free), then the loaded chunk into
the live one; the first live chunk waits in a one-chunk buffer and ends in the loaded
tensor's last chunk. So the loaded tensor ends holding the previous bytes rotated by one
chunk, two copies a byte (a swap through a buffer takes three).

It is the same as ``load_state_dict`` only where that is a plain copy into the registered
tensors, so :func:`plan` accepts a model only when every module loads with
``nn.Module``'s own ``_load_from_state_dict``, has no extra state and no load hooks (but
FSDP2's own, which reshard first and are no-ops for tensors changed in place), and every
tensor of its state dict is one of its registered parameters or buffers, laid out like the
loaded one. Anything else installs through ``load_state_dict`` as before.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..errors import StateMismatchError
from ..format import bitwise, shard_reader
from . import torch_compat

_CHUNK = 1 << 20  # bytes per step: the chunk just read stays in cache for its write
_SIDE_MIN = 32 << 20  # host bytes from which a second thread exchanges about half


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


def _host(t: torch.Tensor) -> torch.Tensor | np.ndarray:
    """A CPU tensor's bytes as a numpy array (same memory), else the tensor itself.

    On the CPU, torch splits each ``copy_`` of a chunk across its intra-op threads and
    waits for all of them at its end; where other processes keep the cores busy, each
    wait can last a scheduler time slice, and an exchange makes hundreds of them
    (measured on two cores busy with other work: 4.3 s, median, to exchange 200 MB through
    ``copy_``; 0.1 s on one thread). numpy copies on the calling thread, without the GIL,
    and slices without torch's per-view overhead."""
    return t.numpy() if t.device.type == "cpu" else t


def _copy(dst: torch.Tensor | np.ndarray, src: torch.Tensor | np.ndarray) -> None:
    if isinstance(dst, np.ndarray):
        np.copyto(dst, src)
    else:
        dst.copy_(src)


class Exchange:
    """The byte exchanges that install one model's loaded tensors, and their undo.

    One thread calls :meth:`install` once, then :meth:`undo` as often as a rollback needs;
    :meth:`install` may hand part of the host pairs to a second exchange (``side``) that
    it runs on a thread of its own, and both methods wait for that thread as needed."""

    def __init__(
        self,
        pairs: list[tuple[str, torch.Tensor, torch.Tensor]],
        ties: dict,
        side: Exchange | None = None,
    ) -> None:
        self._pairs = pairs  # (key, live bytes, loaded bytes)
        self._ties = ties  # key -> the key whose live tensor it shares
        self._chunk = _CHUNK
        # Pairs exchanged on a second thread meanwhile (host bytes only), and who ran
        # them: "side" (that thread, which sets _side_done when it ends) or "undo" (the
        # undo came first: that thread, if it starts late, leaves them alone). Each
        # claims it with one setdefault, atomic under the GIL. Install runs once.
        self._side = side
        self._claim: dict[str, str] = {}
        self._side_done = threading.Event()
        self._side_error: list[BaseException] = []
        # Progress, set by one assignment so that an interrupt (Ctrl-C) between any two
        # statements leaves it true: pairs before _at[0] are exchanged (their loaded bytes
        # hold the previous live ones rotated by one chunk); of pair _at[0], the previous
        # values of the first _at[1] live bytes are kept (its first chunk's in the buffer,
        # the rest at the start of its loaded bytes), and the bytes after them untouched.
        self._at = (0, 0)
        self._buffers: dict[torch.device, torch.Tensor] = {}

    @property
    def keys(self) -> list[str]:
        side = self._side.keys if self._side is not None else []
        return [key for key, _, _ in self._pairs] + side + list(self._ties)

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
        if self._side is not None:
            threading.Thread(target=self._run_side, name="unbroken-exchange", daemon=True).start()
        step = self._chunk
        for i, (_, live_t, loaded_t) in enumerate(self._pairs):
            live, loaded, n = _host(live_t), _host(loaded_t), live_t.numel()
            first = min(step, n)  # the first chunk's size, and the rotation
            held = _host(self._buffer(live_t.device))[:first]
            for offset in range(0, n, step):
                end = min(offset + step, n)
                if offset:  # into the loaded chunk before, installed at the last step
                    _copy(loaded[offset - first : end - first], live[offset:end])
                else:
                    _copy(held, live[:first])
                self._at = (i, end)  # kept, so this chunk may be overwritten
                _copy(live[offset:end], loaded[offset:end])
            _copy(loaded[n - first :], held)
            self._at = (i + 1, 0)
        self._buffers.clear()
        if self._side is not None:
            self._side_done.wait()
            if self._side_error:
                raise self._side_error[0]

    def undo(self) -> None:
        """Put the previous live bytes back: they are in the loaded tensors, rotated by one
        chunk (and for the pair interrupted midway, the first chunk's in the buffer).
        Idempotent, so interrupt-safe: it only copies from the loaded tensors and the
        buffer, which it never changes, and resets the progress (then frees the buffer)
        last, so a rollback that an interrupt cut short runs it again and completes it;
        run again once done, it copies nothing. The side thread's pairs are put back once
        it has ended (or, where the undo comes first, it never starts them)."""
        if self._side is not None:
            if self._claim.setdefault("by", "undo") == "side":
                self._side_done.wait()
            self._side.undo()
        done, end = self._at
        for _, live_t, loaded_t in self._pairs[:done]:
            live, loaded, n = _host(live_t), _host(loaded_t), live_t.numel()
            first = min(self._chunk, n)
            _copy(live[first:], loaded[: n - first])
            _copy(live[:first], loaded[n - first :])
        if end:
            _, live_t, loaded_t = self._pairs[done]
            live, loaded = _host(live_t), _host(loaded_t)
            first = min(self._chunk, live_t.numel())
            _copy(live[first:end], loaded[: end - first])
            _copy(live[:first], _host(self._buffer(live_t.device))[:first])
        self._at = (0, 0)
        self._buffers.clear()

    def _run_side(self) -> None:
        """On the side thread: exchange the side's pairs, unless the undo came first."""
        assert self._side is not None
        try:
            if self._claim.setdefault("by", "side") == "side":
                self._side.install()
        except BaseException as exc:  # handed to install(), on the calling thread
            self._side_error.append(exc)
        finally:
            self._side_done.set()

    def _buffer(self, device: torch.device) -> torch.Tensor:
        if device not in self._buffers:
            self._buffers[device] = torch.empty(self._chunk, dtype=torch.uint8, device=device)
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
    return _split(pairs, ties)


def _split(pairs: list[tuple[str, torch.Tensor, torch.Tensor]], ties: dict) -> Exchange:
    """One exchange, or, where there are enough host bytes and this process has two CPUs
    or more to itself, about half of the host bytes handed to a second thread: memory
    copies on one core do not use all of the memory's speed (measured on an idle two-core
    machine, 200 MB: 0.027 s on two threads, 0.049 s on one)."""
    host = [p for p in pairs if p[1].device.type == "cpu"]
    if sum(p[1].numel() for p in host) < _SIDE_MIN or shard_reader.cpu_share() < 2:
        return Exchange(pairs, ties)
    loads, lanes = [0, 0], ([], [])  # the largest first, each to the lighter lane
    for p in sorted(host, key=lambda p: -p[1].numel()):
        lane = 0 if loads[0] <= loads[1] else 1
        lanes[lane].append(p)
        loads[lane] += p[1].numel()
    mine = [p for p in pairs if p[1].device.type != "cpu"] + lanes[0]
    return Exchange(mine, ties, side=Exchange(lanes[1], {}))
