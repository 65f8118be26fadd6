"""Post-resume health check: does training after a resume continue the run before it?

Two checks, and at most one warning per resume. docs/health-check.md gives the method
and the rates measured on three training scripts, exact and buggy.

1. The optimizer watch (:mod:`.optimizer_watch`): the optimizer a Checkpointer restored
   must be the one training the model. Not statistical: it cannot fire on a loop that
   steps the optimizer it restored, and it catches a fresh optimizer built after
   ``restore()`` within two tracked steps, whatever the loss does.
2. The metric check (:func:`diagnose`): a jump of the loss or of the gradient norm in the
   first steps after the resume that is larger, by a margin, than every jump anywhere in
   the window of steps saved before it. Each run is its own reference, so a noisy loss,
   a spiky warm-up or a drifting gradient norm raise the bar for themselves. The price:
   it sees only resets that visibly disturb training (full-size first steps at a high
   learning rate); a lost RNG or data position seldom shows in these metrics, and it
   does not claim to detect them.

Nothing here raises into ``restore()`` or ``track()``: an optimizer the watch cannot
watch is named (:attr:`HealthCheck.unwatched`, and a logged warning), and a check that
fails on what it is given stops, with a logged warning, instead of failing the run.
"""

from __future__ import annotations

import itertools
import logging
import math
import statistics
from collections.abc import Mapping, Sequence

import torch

from .optimizer_watch import OptimizerWatch

# These constants are what docs/health-check.md measured; change them only with a new
# measurement (python benchmarks/health_check.py).
HORIZON = 50  # tracked steps after a resume the check watches, at most
HISTORY = 200  # steps before the resume, at most, that are the reference (a checkpoint
# keeps the last 200: record.METRICS_WINDOW)
MIN_BEFORE = 20  # steps of saved window needed to judge the metrics at all
LEVEL = 10  # steps whose median is the level before a point
NOISE = 50  # steps whose step-to-step differences give the noise before a point
JUDGED = 4  # steps after the resume whose peak is judged (the metric check's one look)
FLOOR = 6.0  # a jump must exceed this many noise widths ...
MARGIN = 1.5  # ... and this multiple of the largest jump anywhere in the window before
# The noise is never taken below this share of the level: losses and gradient norms that
# are almost constant for a while still vary by a few percent when training moves.
MIN_NOISE = {"loss": 0.01, "gradient norm": 0.05}

logger = logging.getLogger(__name__)


def _median(xs: Sequence[float]) -> float:
    ordered = sorted(xs)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _jumps(xs: Sequence[float], points: range, min_noise: float, log_scale: bool) -> list[float]:
    """For each point t: how far the peak of ``xs[t:t+JUDGED]`` stands above the level of
    the ``LEVEL`` steps before t, in noise widths. Robust: the level is a median, the
    noise the scaled MAD of the step-to-step differences of the ``NOISE`` steps before t
    (so a steady trend is not noise), floored at ``min_noise`` of the level."""
    diffs = [b - a for a, b in itertools.pairwise(xs)]
    out = []
    for t in points:
        level = _median(xs[max(0, t - LEVEL) : t])
        window = diffs[max(0, t - NOISE) : t - 1]
        center = _median(window)
        mad = _median([abs(d - center) for d in window])
        floor = min_noise if log_scale else min_noise * abs(level)
        noise = max(1.4826 * mad / math.sqrt(2), floor, 1e-12)
        out.append((max(xs[t : t + JUDGED]) - level) / noise)
    return out


def _judge(
    before: Sequence[float], after: Sequence[float], min_noise: float, log_scale: bool
) -> tuple[float, float] | None:
    """(jump at the resume, largest jump in the window before), or None if not judgeable."""
    before = before[-HISTORY:]
    xs = [*before, *after[:JUDGED]]
    t = len(before)
    if t < MIN_BEFORE or len(after) < JUDGED or not all(math.isfinite(x) for x in xs):
        return None
    history = _jumps(before, range(LEVEL, t - JUDGED + 1), min_noise, log_scale)
    (jump,) = _jumps(xs, range(t, t + 1), min_noise, log_scale)
    return jump, max(history)


def _log(xs: Sequence[float]) -> list[float]:
    """Gradient norms jump by factors: judged on a log scale (a norm is never negative)."""
    return [math.log(max(x, 1e-12)) if math.isfinite(x) else x for x in xs]


def diagnose(
    before_loss: Sequence[float],
    after_loss: Sequence[float],
    before_grad_norm: Sequence[float] = (),
    after_grad_norm: Sequence[float] = (),
    *,
    optimizer_in_use: bool = False,
) -> list[str]:
    """The metric check of one resume: at most one warning.

    Args:
        before_loss: the tracked losses up to the resume (the saved window), in order.
        after_loss: those after it; the first ``JUDGED`` are judged, once that many
            exist. Fewer steps, or fewer than ``MIN_BEFORE`` before: no verdict.
        before_grad_norm, after_grad_norm: the same for the gradient norm, if tracked.
        optimizer_in_use: the optimizer watch saw the restored optimizer step, so a jump
            is not blamed on lost optimizer state.
    Returns:
        ``[]`` when the resume looks like a continuation, else one warning.

    Example::

        warnings = diagnose(loss[:k], loss[k:], grad_norm[:k], grad_norm[k:])
    """
    found = []
    for what, before, after in (
        ("loss", before_loss, after_loss),
        ("gradient norm", before_grad_norm, after_grad_norm),
    ):
        log_scale = what != "loss"
        scaled = (_log(before), _log(after)) if log_scale else (list(before), list(after))
        verdict = _judge(*scaled, MIN_NOISE[what], log_scale)
        if verdict is not None and verdict[0] > max(FLOOR, MARGIN * verdict[1]):
            jump, largest = verdict
            earlier = (
                f"never jumped more than {largest:.1f}" if largest > 0 else "never rose at all"
            )
            found.append(
                f"the {what} reached {max(after[:JUDGED]):.4g} (median of the last {LEVEL} "
                f"steps before: {statistics.median(before[-LEVEL:]):.4g}), a jump of "
                f"{jump:.1f} noise widths where the {len(before[-HISTORY:])} steps before "
                f"{earlier}"
            )
    if not found:
        return []
    spike = " and ".join("loss" if f.startswith("the loss") else "gradient-norm" for f in found)
    head = "" if optimizer_in_use else "lost optimizer state suspected: "
    cause = (
        "The restored optimizer is stepping, so look at the learning-rate schedule and at "
        "what else the resume may have changed"
        if optimizer_in_use
        else "A fresh optimizer's full-size first steps do this; so does a restarted "
        "learning-rate schedule"
    )
    return [
        f"{head}{spike} spike in the first {JUDGED} steps after the resume: "
        f"{'; '.join(found)}. {cause} (see docs/health-check.md)"
    ]


class HealthCheck:
    """Watches the steps tracked after one resume; reports at most one warning.

    Args:
        window: step -> tracked metrics, as restored (steps up to ``resumed_from`` are
            the reference; a checkpoint keeps the last ``record.METRICS_WINDOW``).
        resumed_from: the step the run resumed from.
        loss: the name of the tracked loss.
        grad_norm: the name of the tracked gradient norm, or None.
        optimizers: name -> optimizer that the resume restored, for the optimizer watch
            (None or empty: no watch). One it cannot watch is named in :attr:`unwatched`.

    Never raises from :meth:`observe` or :meth:`close`. Not thread-safe: feed it from the
    training loop (``RunRecord.track`` does).
    """

    def __init__(
        self,
        window: Mapping[int, Mapping[str, float]],
        resumed_from: int,
        *,
        loss: str = "loss",
        grad_norm: str | None = "grad_norm",
        optimizers: Mapping[str | None, torch.optim.Optimizer] | None = None,
    ) -> None:
        steps = sorted(s for s in window if s <= resumed_from)
        self._names = (loss, grad_norm)
        names = [n for n in self._names if n is not None]
        self._before = {n: [window[s][n] for s in steps if n in window[s]] for n in names}
        self._after: dict[str, list[float]] = {n: [] for n in names}
        self._resumed_from = resumed_from
        self._watch = OptimizerWatch(optimizers) if optimizers else None
        self._metrics_pending = True
        self._seen = 0
        self._failed = False
        self.warnings: list[str] = []

    @property
    def unwatched(self) -> dict[str, str]:
        """The restored optimizers the optimizer watch cannot watch (name -> why)."""
        return dict(self._watch.unwatched) if self._watch is not None else {}

    @property
    def done(self) -> bool:
        """True once the check has nothing left to say about this resume."""
        watching = self._watch is not None and not self._watch.done
        return (
            self._failed
            or bool(self.warnings)
            or self._seen >= HORIZON
            or not (watching or self._metrics_pending)
        )

    def observe(self, step: int, metrics: Mapping[str, float]) -> list[str]:
        """Record one tracked step; returns the warning if this step brought one (logged)."""
        if self.done or step <= self._resumed_from:
            return []
        self._seen += 1
        try:
            found = self._watch.observe() if self._watch is not None else None
            if found is None and self._metrics_pending:
                found = self._observe_metrics(metrics)
        except Exception as exc:  # never into track(): the check stops, saying why
            self._failed = True
            self.close()
            logger.warning(
                "resume health check (step %d) stopped: it could not judge step %d (%s: %s)",
                self._resumed_from,
                step,
                type(exc).__name__,
                exc,
            )
            return []
        if found is not None:
            logger.warning("resume health check (step %d): %s", self._resumed_from, found)
            self.warnings.append(found)
        if self.done:
            self.close()
        return [] if found is None else [found]

    def close(self) -> None:
        """Stop watching (removes the optimizer watch's hooks); safe to call again."""
        if self._watch is not None:
            try:
                self._watch.close()
            except Exception as exc:  # never into track() or a new restore()
                logger.debug("resume health check: closing the optimizer watch: %s", exc)

    def _observe_metrics(self, metrics: Mapping[str, float]) -> str | None:
        loss, grad_norm = self._names
        if self._seen == 1 and loss not in metrics and not self._before[loss]:
            self._metrics_pending = False
            logger.warning(
                "resume health check: no tracked metric named %r (tracked: %s), so the "
                "metrics are not checked; name yours with Checkpointer(loss_metric=...)",
                loss,
                ", ".join(sorted(metrics)) or "none",
            )
            return None
        for name, values in self._after.items():
            if name in metrics:
                values.append(metrics[name])
        if len(self._after[loss]) < JUDGED:
            return None
        self._metrics_pending = False
        found = diagnose(
            self._before[loss],
            self._after[loss],
            self._before.get(grad_norm, []) if grad_norm else [],
            self._after.get(grad_norm, []) if grad_norm else [],
            optimizer_in_use=self._watch is not None and self._watch.stepping,
        )
        return found[0] if found else None


def check_metric_names(loss_metric: object, grad_norm_metric: object) -> None:
    """The names the health check reads: strings, non-empty, different."""
    for arg, name in (("loss_metric", loss_metric), ("grad_norm_metric", grad_norm_metric)):
        if name is None and arg == "grad_norm_metric":
            continue
        if not isinstance(name, str):
            allowed = "a str or None" if arg == "grad_norm_metric" else "a str"
            raise TypeError(f"{arg} must be {allowed}, got {type(name).__name__}")
        if not name:
            raise ValueError(f"{arg} must be a non-empty metric name, got ''")
    if grad_norm_metric == loss_metric:
        raise ValueError(f"loss_metric and grad_norm_metric must differ, both are {loss_metric!r}")
