"""Post-resume health check: does training after a resume look like training before it?

A correct resume continues the loss curve; a resume that silently lost optimizer state
shows a known signature (DESIGN.md F3): the loss rises right after the resume while the
gradient norm drops. A resume that lost weights, data position or learning-rate schedule
usually shows as a loss spike. The check compares the first tracked steps after a resume
with the window of steps saved before the stop: a line fitted through that window gives
the level the curve had reached and the noise around it, so ordinary minibatch noise
and a falling trend do not trigger it.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Sequence

logger = logging.getLogger(__name__)

BEFORE = 20  # steps of the saved window used as the reference
AFTER = 8  # steps after the resume that are judged


def _level_and_scale(xs: Sequence[float]) -> tuple[float, float]:
    """Where a curve stands at its end (a least-squares line through it) and how noisy it
    is around that line (scaled median absolute residual, floored at 2% of the level)."""
    n = len(xs)
    mean_x, mean_y = (n - 1) / 2, statistics.fmean(xs)
    sxx = sum((i - mean_x) ** 2 for i in range(n))
    slope = sum((i - mean_x) * (y - mean_y) for i, y in enumerate(xs)) / sxx
    fitted = [mean_y + slope * (i - mean_x) for i in range(n)]
    residuals = [y - f for y, f in zip(xs, fitted, strict=True)]
    mad = statistics.median(abs(r) for r in residuals)
    level = fitted[-1]
    return level, max(1.4826 * mad, 0.02 * abs(level), 1e-12)


def diagnose(
    before_loss: Sequence[float],
    after_loss: Sequence[float],
    before_grad_norm: Sequence[float] = (),
    after_grad_norm: Sequence[float] = (),
) -> list[str]:
    """Warnings for a resume, from losses (and grad norms) just before and just after it."""
    if len(before_loss) < 5 or len(after_loss) < 3:
        return []
    warnings = []
    ref, scale = _level_and_scale(before_loss[-BEFORE:])
    post = statistics.median(after_loss[:AFTER])
    rising = post > ref + 3 * scale
    if before_grad_norm and after_grad_norm and len(before_grad_norm) >= 5:
        gref, gscale = _level_and_scale(before_grad_norm[-BEFORE:])
        gpost = statistics.median(after_grad_norm[:AFTER])
        if rising and gpost < gref - 2 * gscale:
            warnings.append(
                f"lost optimizer state suspected: after the resume the loss rose (median "
                f"{post:.4g} vs {ref:.4g} before) while the gradient norm dropped (median "
                f"{gpost:.4g} vs {gref:.4g}). This is the signature of optimizer moments "
                "reset by the resume (DESIGN.md F3)."
            )
            return warnings
    peak = max(after_loss[:AFTER])
    if rising or peak > ref + 8 * scale:
        warnings.append(
            f"loss spike after the resume: median {post:.4g} (peak {peak:.4g}) in the first "
            f"{min(len(after_loss), AFTER)} steps vs {ref:.4g} before the stop. Check that "
            "the optimizer, scheduler, data position and weights were really restored."
        )
    return warnings


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
