"""Is the optimizer a Checkpointer restored the one that trains the model after the resume?

The classic silent resume bug builds a fresh optimizer after restoring: the restored
optimizer, with its moments, is never stepped again, and later checkpoints save its
stale state. The loss often hides it (docs/health-check.md measures how often), but the
objects do not: the parameters the restored optimizer holds state for keep changing
while its state does not.

:class:`OptimizerWatch` samples a few elements of a few such parameters and of their
optimizer state right after the restore, hooks the optimizer's ``step()``, and looks
again at each tracked step:

- ``step()`` was called or the state changed: the restored optimizer is in use; nothing
  to say, the watch ends (and removes its hook);
- the state was emptied, or its ``step`` count went back: it was reset in place;
- the parameters changed at two different tracked steps while the optimizer was never
  stepped: another optimizer object is training the model.

It is not statistical: it cannot fire on a loop that steps the optimizer it restored,
whatever the metrics. One change alone (your own edit of the weights after restoring)
is not enough; it stays silent while nothing changes (gradient accumulation, tracking
before the first update) and for optimizers without per-parameter state (plain SGD).

It never raises into ``restore()`` or ``track()``: an optimizer it cannot watch (a wrapper
such as timm's ``Lookahead`` whose step hooks cannot be registered, or one whose state
cannot be read) is left out, named in :attr:`OptimizerWatch.unwatched` and in a logged
warning, and the rest of the check goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from torch.distributed.tensor import DTensor

from ..format import bitwise

PARAMS = 4  # parameters watched per optimizer
ELEMENTS = 8  # elements sampled per tensor

logger = logging.getLogger(__name__)


def _sample(t: torch.Tensor) -> torch.Tensor:
    """A few elements of this rank's part of ``t``, copied."""
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.detach().reshape(-1)[:ELEMENTS].clone()


def _state_sample(state: Mapping) -> dict[str, torch.Tensor]:
    return {k: _sample(v) for k, v in state.items() if isinstance(v, torch.Tensor)}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (format/bitwise.py): a NaN equals itself, -0.0 differs from 0.0."""
    return a.dtype == b.dtype and a.shape == b.shape and bitwise.equal(a, b)


def _same_state(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)


def _step(sample: Mapping[str, torch.Tensor]) -> float | None:
    s = sample.get("step")
    return float(s.reshape(-1)[0]) if s is not None and s.numel() else None


class _Watched:
    """One optimizer: a few of its parameters and their state, as restored."""

    def __init__(self, name: str, opt: torch.optim.Optimizer) -> None:
        self.name = name
        self.opt = opt
        self.params: list[torch.Tensor] = []
        for group in opt.param_groups:
            for p in group["params"]:
                state = opt.state.get(p)
                local = p.to_local() if isinstance(p, DTensor) else p
                if state and local.numel() and len(self.params) < PARAMS:
                    self.params.append(p)
        self.restored = [_state_sample(opt.state[p]) for p in self.params]
        self.last = [_sample(p) for p in self.params]
        self.changes = 0  # tracked steps at which the parameters had changed
        self.stepping = False  # step() was called or its state changed: it is in use
        self._hook = None
        if self.params:
            # Without this hook a step that leaves the sampled state alone would look like
            # no step at all, and the watch could blame an optimizer in use: a wrapper
            # whose hooks cannot be registered is not watched (OptimizerWatch.unwatched).
            self._hook = opt.register_step_post_hook(self._stepped)

    def _stepped(self, *_: object) -> None:
        self.stepping = True

    def close(self) -> None:
        """Stop watching: remove the hook from the optimizer (never raises)."""
        hook, self._hook, self.params = self._hook, None, []
        if hook is not None:
            try:
                hook.remove()
            except Exception as exc:  # a wrapper's own hook container
                logger.debug("the optimizer watch's hook on %s: %s", self.name, _why(exc))

    def observe(self) -> str | None:
        """None while undecided or fine; a warning when the optimizer is not in use."""
        now = [_state_sample(self.opt.state.get(p, {})) for p in self.params]
        for before, after in zip(self.restored, now, strict=True):
            old, new = _step(before), _step(after)
            if not after or (old is not None and new is not None and new < old):
                was = f" (its step count went from {old:g} to {new:g})" if new is not None else ""
                return (
                    f"lost optimizer state: the {self.name} restored by this Checkpointer was "
                    f"reset after the restore{was}; its state (e.g. Adam's moments) is gone "
                    "(see docs/health-check.md)"
                )
        if self.stepping or any(
            not _same_state(a, b) for a, b in zip(self.restored, now, strict=True)
        ):
            self.stepping = True
            self.close()  # it is in use: nothing to watch any more
            return None
        params = [_sample(p) for p in self.params]
        if any(not _same(a, b) for a, b in zip(self.last, params, strict=True)):
            self.changes += 1
        self.last = params
        if self.changes >= 2:
            return (
                f"lost optimizer state suspected: the model is being trained, but not by the "
                f"{self.name} this Checkpointer restored: its state has not changed since the "
                "restore while the parameters it holds state for did. Another optimizer "
                "object (built after restore(), with fresh moments) is stepping them, and "
                "later checkpoints save the stale restored one. Pass the optimizer you step "
                "to Checkpointer(optimizer=...) (see docs/health-check.md)"
            )
        return None


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class OptimizerWatch:
    """Watches the restored optimizers (name -> optimizer) after a resume.

    Call :meth:`observe` at each tracked step; it returns a warning at most once. Never
    raises: an optimizer it cannot watch is left out and named in :attr:`unwatched`
    (and a logged warning).
    Not thread-safe: call it from the training loop, as ``Checkpointer.track`` does.
    """

    def __init__(self, optimizers: Mapping[str | None, torch.optim.Optimizer]) -> None:
        self.unwatched: dict[str, str] = {}  # optimizer (as named in messages) -> why
        self._watched: list[_Watched] = []
        for name, opt in optimizers.items():
            label = "optimizer" if name is None else f"optimizer {name!r}"
            try:
                watched = _Watched(label, opt)
            except Exception as exc:  # a wrapper's hooks or state (e.g. timm's Lookahead)
                self._give_up(label, opt, exc)
                continue
            if watched.params:
                self._watched.append(watched)
        self.stepping = False  # a restored optimizer was seen stepping

    def _give_up(self, label: str, opt: object, exc: BaseException) -> None:
        why = f"{type(opt).__name__}: {_why(exc)}"
        self.unwatched[label] = why
        logger.warning(
            "resume health check: the %s is not watched (%s); a fresh optimizer built "
            "after restore() in its place would go unnoticed (the metric check still runs)",
            label,
            why,
        )

    @property
    def done(self) -> bool:
        """Nothing left to watch: every optimizer was seen stepping, or a warning came."""
        return not self._watched

    def observe(self) -> str | None:
        """Compare with the restored state; the warning, once, if an optimizer is unused."""
        for w in self._watched:
            try:
                found = w.observe()
            except Exception as exc:  # its state changed into something it cannot read
                w.close()
                self._give_up(w.name, w.opt, exc)
                continue
            self.stepping |= w.stepping
            if found is not None:
                self.close()
                return found
        self._watched = [w for w in self._watched if w.params]
        return None

    def close(self) -> None:
        """Stop watching (removes the hooks); safe to call more than once."""
        for w in self._watched:
            w.close()
        self._watched = []
