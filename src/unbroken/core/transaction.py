"""Commit or roll back: the installs of one restore kept, or every one put back.

The last phase of a restore (``restoring.py``): once every component's install began
under a :class:`Transaction`, a failure anywhere after it (an install that raised, a
verification that failed, an interrupt) puts every live object back as it was, newest
first, with the undos the snapshot took (``live/snapshot.py``), and the error says so.

An interrupt (Ctrl-C, any ``BaseException``) during the rollback itself does not stop it
halfway: every undo can be run again to complete what an interrupt cut short (each is
idempotent), so the rollback retries the undo it was in, finishes, then raises the first
interrupt. The one window left is the first lines of the rollback, before its loop.
"""

from __future__ import annotations

from typing import Any

from ..errors import CheckpointError
from ..live import snapshot
from ..live.state import Component

_INTERRUPTS = 16  # interrupts per component a rollback takes before it gives up


class Transaction:
    """The installs of one restore: kept when the block ends normally (commit); on any
    exception, every component whose install began is put back as it was (roll back), and
    the exception, which then says so, goes on to the caller.

    Args:
        active: the components in install order.
        undo: their undos, in the same order (``snapshot``).
    """

    def __init__(self, active: list[Component], undo: list[snapshot.Undo]) -> None:
        self._undo = dict(zip((c.name for c in active), undo, strict=True))
        self._begun: list[str] = []  # components whose install began, in order
        self._finished = False

    def begin(self, name: str) -> None:
        """``name``'s install starts now (from here on it is put back on failure)."""
        self._begun.append(name)

    def installed(self) -> None:
        """Every install finished (a later failure is in verification, not an install)."""
        self._finished = True

    def __enter__(self) -> Transaction:
        return self

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: Any) -> None:
        if exc is not None:
            raising = None if self._finished or not self._begun else self._begun[-1]
            self._roll_back(raising, exc)

    def _roll_back(self, raising: str | None, exc: BaseException) -> None:
        """Put every begun component back, newest first. ``raising`` names the component
        whose own install raised, if any: putting it back is best effort. Raises if
        another cannot be put back; else adds what was done to ``exc``. An interrupt on
        the way is held until every component is back, then raised in place of ``exc``."""
        failed: dict[str, str] = {}
        interrupts: list[BaseException] = []
        pending = list(self._begun)  # what is not yet put back, newest last
        for _ in range(_INTERRUPTS * (len(pending) + 1)):
            try:
                self._put_back(pending, failed)
                break
            except BaseException as err:  # Ctrl-C: the undo it cut short is run again
                interrupts.append(err)
        else:
            failed.update((name, "interrupted again and again") for name in pending)
        lost = [f"{name!r} ({why})" for name, why in failed.items() if name != raising]
        if lost:
            raise CheckpointError(
                f"restore failed ({type(exc).__name__}: {exc}) after it began installing "
                f"state, and {', '.join(lost)} could not be put back as it was: rebuild "
                "those objects before training"
            ) from (interrupts[0] if interrupts else exc)
        note = "nothing was changed: every live object was put back as it was before restore()"
        if raising in failed:
            note += (
                f", except {raising!r}, whose load_state_dict raised and whose previous state "
                f"could not be loaded back either ({failed[raising]}): check it"
            )
        if interrupts and isinstance(exc, Exception):  # the interrupt goes on, not exc
            interrupts[0].add_note(
                f"interrupted while restore() was rolled back after "
                f"{type(exc).__name__}: {exc}\n({note})"
            )
            raise interrupts[0] from exc
        if isinstance(exc, CheckpointError) and exc.args and isinstance(exc.args[0], str):
            exc.args = (f"{exc.args[0]}\n({note})", *exc.args[1:])
        else:
            exc.add_note(note)

    def _put_back(self, pending: list[str], failed: dict[str, str]) -> None:
        """Undo each of ``pending`` (newest last), removing it once done: run again after
        an interrupt, it goes on where it stopped (an undo run twice puts back the same)."""
        while pending:
            name = pending[-1]
            try:
                self._undo[name]()
            except Exception as err:
                failed[name] = f"{type(err).__name__}: {err}"
            pending.pop()
