"""Post-resume health check: does training after a resume look like training before it?

A correct resume continues the loss curve; a resume that silently lost optimizer state
shows a known signature (DESIGN.md F3): the loss rises right after the resume while the
gradient norm drops. A resume that lost weights, data position or learning-rate schedule
usually shows as a loss spike. The check compares the first tracked steps after a resume
with the last steps saved before the stop: their level and their step-to-step noise
(a steady downward trend is not noise), so ordinary minibatch noise does not trigger
it while a jump of several noise widths does.
"""

from __future__ import annotations

import itertools
import logging
import statistics
from collections.abc import Sequence

logger = logging.getLogger(__name__)

BEFORE = 10  # steps of the saved window used as the reference
AFTER = 5  # steps after the resume that are judged


def _level_and_noise(xs: Sequence[float]) -> tuple[float, float]:
    """Where a curve stands at its end (median of its last 3 points) and its step-to-step
    noise (scaled median absolute deviation of its first differences, so a steady trend
    does not count as noise), floored at 1% of the level."""
    level = statistics.median(xs[-3:])
    diffs = [b - a for a, b in itertools.pairwise(xs)]
    center = statistics.median(diffs)
    mad = statistics.median(abs(d - center) for d in diffs)
    return level, max(1.4826 * mad, 0.01 * abs(level), 1e-12)


def diagnose(
    before_loss: Sequence[float],
    after_loss: Sequence[float],
    before_grad_norm: Sequence[float] = (),
    after_grad_norm: Sequence[float] = (),
) -> list[str]:
    """Warnings for a resume, from losses (and grad norms) just before and just after it."""
    if len(before_loss) < 5 or len(after_loss) < 3:
        return []
    level, noise = _level_and_noise(before_loss[-BEFORE:])
    post = list(after_loss[:AFTER])
    peak, typical = max(post), statistics.median(post)
    jumped = peak > level + 3 * noise
    rising = typical > level + 2 * noise
    grad_jumped = grad_dropped = False
    if len(before_grad_norm) >= 5 and len(after_grad_norm) >= 3:
        glevel, gnoise = _level_and_noise(before_grad_norm[-BEFORE:])
        gpost = list(after_grad_norm[:AFTER])
        grad_jumped = max(gpost) > glevel + 3 * gnoise
        grad_dropped = statistics.median(gpost) < glevel - 2 * gnoise
        where = (
            f"loss median {typical:.4g} (peak {peak:.4g}) vs {level:.4g} before; gradient "
            f"norm median {statistics.median(gpost):.4g} (peak {max(gpost):.4g}) vs "
            f"{glevel:.4g} before"
        )
    if rising and grad_dropped:
        return [
            f"lost optimizer state suspected: after the resume the loss rose while the "
            f"gradient norm dropped ({where}), the signature of optimizer moments reset by "
            "the resume (DESIGN.md F3)"
        ]
    if jumped and grad_jumped:
        return [
            f"lost optimizer state suspected: loss and gradient norm both jumped right after "
            f"the resume ({where}), as when a fresh optimizer takes full-size first steps "
            "(DESIGN.md F3)"
        ]
    if grad_jumped:
        return [
            f"lost optimizer state suspected: the gradient norm jumped right after the resume "
            f"({where}), as when a fresh optimizer takes full-size first steps (DESIGN.md F3) "
            "or a learning-rate schedule restarts"
        ]
    if jumped or rising:
        return [
            f"loss spike after the resume: median {typical:.4g}, peak {peak:.4g} in the "
            f"first {len(post)} steps vs {level:.4g} before the stop. Check that the "
            "optimizer, scheduler, data position and weights were really restored"
        ]
    return []


class HealthCheck:
    """Feeds tracked steps after a resume to :func:`diagnose`, once enough have arrived."""

    def __init__(self, window: dict[int, dict[str, float]], resumed_from: int) -> None:
        steps = sorted(s for s in window if s <= resumed_from)
        self._before = {name: [window[s][name] for s in steps if name in window[s]]
                        for name in ("loss", "grad_norm")}  # fmt: skip
        self._after: dict[str, list[float]] = {"loss": [], "grad_norm": []}
        self._resumed_from = resumed_from
        self.warnings: list[str] = []
        self._done = not self._before["loss"]

    def observe(self, step: int, metrics: dict[str, float]) -> list[str]:
        """Record one step; returns any new warnings (logged too)."""
        if self._done or step <= self._resumed_from:
            return []
        for name in self._after:
            if name in metrics:
                self._after[name].append(metrics[name])
        if len(self._after["loss"]) < AFTER:
            return []
        self._done = True
        found = diagnose(
            self._before["loss"],
            self._after["loss"],
            self._before["grad_norm"],
            self._after["grad_norm"],
        )
        for w in found:
            logger.warning("resume health check (step %d): %s", self._resumed_from, w)
        self.warnings.extend(found)
        return found
