"""Saves that run behind the training loop: ``async_save=True`` and ``async_save="overlap"``.

``True``: ``save()`` copies the whole state into reusable host buffers, then returns;
writing, fingerprinting and the commit run on a background thread.

``"overlap"``: ``save()`` copies only what the next forward pass or the loop itself may
change (buffers such as BatchNorm statistics, the scheduler, the data position, the RNG,
``extra``; small), then returns. The parameters and the optimizer state, nearly all the
bytes, are copied on the background thread while the next forward and backward run;
every optimizer's step waits for that copy, the first moment they would change. Then the
write goes on in the background as with ``True``. Where the host buffers are still to be
made (the first save; pinned memory on a GPU takes about a second per 3 GB to allocate),
the state is first copied beside itself on the device, which takes milliseconds, and the
step waits only for that (``StagingBuffers.hold_on_device``; no room: as before).

Every optimizer, not only those the Checkpointer holds: a second optimizer (a part of
the model trained apart, a GAN's other half) may step the saved parameters too, and its
fused kernels (``fused=True``) change them without bumping a version counter, so the
check below would not see it. While a copy is pending, a step pre-hook common to all
optimizers (``torch.optim.optimizer.register_optimizer_step_pre_hook``) makes any
``torch.optim.Optimizer``'s ``step()`` wait for it; an optimizer the Checkpointer holds
that is not a ``torch.optim.Optimizer`` gets its own pre-hook (``register_step_pre_hook``).

The bug class: a *torn checkpoint*, whose tensors come from two steps (the weights of
step N with the moments of N+1, or half of one tensor each). It loads without an error
and resumes onto a trajectory no run ever took. So the copy must be exactly the state at
``save(step)``. The optimizer hooks cover every change an optimizer's ``step()`` makes,
fused or not; any other in-place change of a saved parameter or optimizer tensor before
the copy is settled (an EMA update, weight surgery, a ``load_state_dict``) is found
through the tensors' ``_version`` counters (torch bumps one on every in-place change):
each is recorded at ``save()`` and compared, in the training thread, once the copy is
done; any difference refuses the save (nothing is committed, the error is raised by the
next ``save()``, ``wait()`` or ``close()``). The rule for users: between ``save()`` and
the next optimizer step, change parameters and optimizer state only through an
optimizer's ``step()``, or call ``ckpt.wait()`` first. Torch counts no versions through
``.data`` (an edit of ``p.data`` in place is invisible to autograd and to this check
alike), nor in a fused kernel called outside an optimizer's ``step()``
(``torch._fused_adamw_`` by hand), nor from another thread or process writing the
memory: those are outside what can be detected.

Collectives of the background thread run on a gloo group of its own, never on the
default group the training loop uses; the copy itself issues none.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from ..errors import CheckpointError
from ..live.optimizer import OptimizerComponent
from ..live.state import Component, ModelComponent
from . import collective
from .saving import Staged
from .staging import StagingBuffers, local

logger = logging.getLogger(__name__)

OVERLAP = "overlap"
SETTLE_POLL_S = 0.05  # how often a copy waiting for its verdict checks its owner is alive
_savers: weakref.WeakSet[BackgroundSaver] = weakref.WeakSet()
_registered = False


def _at_exit() -> None:
    """An exit without ``close()`` must neither hang nor lose the save in flight: the
    main thread is done, so nothing can change the state any more; its copy is judged
    and the save is finished here, before ``concurrent.futures`` refuses new work (the
    write uses a thread pool). Python runs these callbacks in reverse order of
    registration, and this one is registered after ``concurrent.futures`` registered
    its own. ``threading._register_atexit`` is private (Python >= 3.9): without it, the
    save in flight is judged once the main thread's end shows in ``Thread.is_alive``."""
    for saver in list(_savers):
        try:
            saver.wait()
        except Exception as exc:  # nobody is left to raise it to
            logger.error("the save in flight at exit failed: %s", exc)


def _register_exit(saver: BackgroundSaver) -> None:
    global _registered
    register = getattr(threading, "_register_atexit", None)
    if not _registered and register is not None:
        with contextlib.suppress(RuntimeError):  # already shutting down
            register(_at_exit)
            _registered = True
    _savers.add(saver)


def check_mode(value: Any) -> bool | str:
    """``async_save``'s value, validated: False, True or ``"overlap"``."""
    if value is False or value is True or value == OVERLAP:
        return value
    raise ValueError(f'async_save must be False, True or "overlap", got {value!r}')


class _Copy:
    """One save's deferred copy: its progress, and the training thread's verdict on it."""

    def __init__(
        self, staged: Staged, owner: threading.Thread, owners: dict[int, list[torch.Tensor]]
    ) -> None:
        self.staged = staged
        self.live = {k: local(t) for k, t in staged.deferred.items()}
        # Each captured tensor and the live tensors sharing its memory: a state dict may
        # hand out an alias with a version counter of its own (FSDP2's, made like
        # ``.data``), so the parameter's and the optimizer state's own counters are
        # watched too.
        self.watched = {
            k: [t, *owners.get(t.untyped_storage().data_ptr(), [])] for k, t in self.live.items()
        }
        self.versions = {k: self._versions(k) for k in self.watched}
        self.owner = owner  # the training thread, which alone may settle the copy
        # On CUDA the copy runs on a side stream, after the work queued so far.
        cuda = next((t.device for t in self.live.values() if t.is_cuda), None)
        self.after = torch.cuda.current_stream(cuda).record_event() if cuda else None
        self.copied = threading.Event()
        self.settled = threading.Event()
        self.settling = threading.Lock()  # one judge, however many threads step
        self.changed: list[str] = []

    def _versions(self, key: str) -> list[int]:
        return [t._version for t in self.watched[key]]

    def check(self) -> None:
        """Record the saved tensors changed in place since ``save()``."""
        self.changed = [k for k in self.watched if self._versions(k) != self.versions[k]]

    def await_verdict(self) -> None:
        """Wait (background thread) until the training thread settles the copy; if that
        thread has ended without doing so (an exit without ``close()``), nothing can
        change the state any more, and the check is made here."""
        while not self.settled.wait(SETTLE_POLL_S):
            if not self.owner.is_alive():
                self.judge()

    def judge(self) -> bool:
        """Check the copy once (it must be done); True for the caller that judged it."""
        with self.settling:
            if self.settled.is_set():
                return False
            self.check()
            self.settled.set()
            return True

    def refusal(self) -> CheckpointError:
        step = self.staged.request.step
        names = ", ".join(repr(k) for k in self.changed[:3])
        more = f" and {len(self.changed) - 3} more" if len(self.changed) > 3 else ""
        return CheckpointError(
            f"step {step} was not saved: {names}{more} changed in place after save({step}) "
            "returned and before its copy was settled at the next optimizer step, outside "
            'an optimizer\'s step(). With async_save="overlap" the parameters and optimizer '
            "state are copied while training goes on, so until the next step() they may "
            "change only through an optimizer's step(): call ckpt.wait() "
            "before changing them any other way (an EMA update, weight surgery, a "
            "load_state_dict), or use async_save=True. Earlier checkpoints are untouched"
        )


class BackgroundSaver:
    """Runs one save at a time behind the training loop (see the module docstring).

    Thread safety: every method is called from the training loop's thread; the optimizer
    hooks run in whichever thread calls ``step()`` (each such thread waits for the copy,
    one judges it); the save itself runs on one worker thread.

    Args:
        mode: ``True`` or ``"overlap"``.
        components: the Checkpointer's components: their parameters and optimizer state
            are what ``"overlap"`` copies late. Every optimizer's step waits for that
            copy, held or not.
    """

    def __init__(self, mode: bool | str, components: list[Component]) -> None:
        self.mode = check_mode(mode)
        self.buffers = StagingBuffers()
        self._models: list[torch.nn.Module] = []
        self._optimizers: list[Any] = []
        for c in components:
            if isinstance(c, ModelComponent):
                self._models += c.models.values()
            elif isinstance(c, OptimizerComponent):
                self._optimizers += c.optimizers.values()
        if self.mode == OVERLAP:
            for opt in self._optimizers:
                if not callable(getattr(opt, "register_step_pre_hook", None)):
                    raise TypeError(
                        f'async_save="overlap" needs optimizers with register_step_pre_hook '
                        f"(torch.optim.Optimizer); {type(opt).__name__} has none: use "
                        "async_save=True"
                    )
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None
        self._copy: _Copy | None = None
        self._hooks: list[RemovableHandle] = []
        self._owners: dict[int, list[torch.Tensor]] = {}  # memory -> live tensors, at save()
        # The background save's collectives run on a group of its own, so they never
        # interleave with the training loop's collectives on the default group.
        self._group = dist.new_group(backend="gloo") if collective.active() else None

    def defer(self) -> Callable[[torch.Tensor], bool] | None:
        """For ``saving.stage``: whether a captured tensor is copied late (``"overlap"``):
        those held in the memory of a parameter or of optimizer state."""
        if self.mode != OVERLAP:
            return None
        owners: dict[int, list[torch.Tensor]] = {}
        for t in self._late_tensors():
            if not t.is_inference() and t.untyped_storage().data_ptr():
                owners.setdefault(t.untyped_storage().data_ptr(), []).append(t)
        self._owners = owners

        def late(t: torch.Tensor) -> bool:
            part = local(t)
            if part.is_inference():  # no version counter: copied now
                return False
            return part.untyped_storage().data_ptr() in owners

        return late

    def _late_tensors(self) -> Iterator[torch.Tensor]:
        for model in self._models:
            for p in model.parameters():
                yield local(p)
        for opt in self._optimizers:
            for state in opt.state.values():
                for v in state.values() if isinstance(state, dict) else ():
                    if isinstance(v, torch.Tensor):
                        yield local(v)

    def submit(self, staged: Staged, finish: Callable[[Staged], None]) -> None:
        """Run the rest of a staged save in the background: the deferred copy (if any),
        then ``finish`` (write and commit) on the background group."""
        self.wait()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="unbroken-save")
            _register_exit(self)
        job = None
        if staged.deferred:
            job = self._copy = _Copy(staged, threading.current_thread(), self._owners)
            self._hooks = self._hook_steps()
        self._owners = {}  # no references to live tensors kept beyond this save
        self._pending = self._executor.submit(self._run, staged, job, finish)

    def _run(self, staged: Staged, job: _Copy | None, finish: Callable[[Staged], None]) -> None:
        def copy_and_judge() -> None:
            assert job is not None
            held = None
            try:
                held = self.buffers.hold_on_device(staged.deferred, after=job.after)
                if held is None:
                    staged.flat.update(self.buffers.copy(staged.deferred, after=job.after))
            finally:
                job.copied.set()  # with a hold, training goes on while buffers are made
            if held is not None:
                staged.flat.update(self.buffers.copy(held))
                del held
            staged.deferred = {}
            job.await_verdict()
            if job.changed:
                raise job.refusal()

        with collective.using(self._group):
            if job is not None:  # a copy refused or failed on one rank stops every rank's
                collective.agree(copy_and_judge)  # save here, before any writes
            finish(staged)

    def _hook_steps(self) -> list[RemovableHandle]:
        """Make every optimizer's next step wait for the copy (see the module docstring).
        The hooks hold the saver weakly: one left behind by a saver never closed is a
        no-op, and does not keep it alive."""
        ref = weakref.ref(self)

        def before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
            saver = ref()
            if saver is not None:
                saver.settle()  # the hook is removed later: not while torch iterates hooks

        hooks = [register_optimizer_step_pre_hook(before_step)]
        for opt in self._optimizers:
            if not isinstance(opt, torch.optim.Optimizer):  # the common hook skips it
                hooks.append(opt.register_step_pre_hook(before_step))
        return hooks

    def settle(self) -> None:
        """Wait for the deferred copy and judge it: the saved tensors must not have
        changed since ``save()``. A refusal is logged here and raised by the next
        ``wait()``. Any thread stepping an optimizer waits here until the copy is done."""
        job = self._copy
        if job is None:
            return
        job.copied.wait()
        if job.judge() and job.changed:
            logger.error("%s", job.refusal())
        if self._copy is job:
            self._copy = None

    def wait(self) -> None:
        """Wait for the save in flight; raise its error if it failed."""
        self.settle()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
