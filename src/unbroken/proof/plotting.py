"""PNG plots of tracked metrics, resume points marked (matplotlib, no display needed).

matplotlib is an optional extra (``unbroken[plot]``): without it every function here
raises ``ImportError`` with the line to install it, and the callers go on without a plot.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from ..format import bitwise
from ..format.series import Series

MISSING = "plots need matplotlib, which is not installed: pip install 'unbroken[plot]'"
_STYLES = ["-", "--", ":", "-."]
Mark = tuple[str, int]  # (what, step): a dashed line labelled "what (step)"


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg back-end.

    Raises:
        ImportError: matplotlib is not installed (or cannot be imported); the message says
            how to install it.
    """
    try:
        import matplotlib
    except ImportError:
        raise ImportError(MISSING) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_series(
    runs: Mapping[str, Series],
    out: str | os.PathLike,
    *,
    title: str = "",
    marks: Mapping[str, int] | None = None,
) -> str:
    """Plot every metric of every run (one panel per metric) to ``out``; returns its path.

    ``marks`` adds labelled vertical lines (e.g. ``{"stopped": 25}``); each run's own
    resume points are gray lines labelled with their step.

    Raises:
        ImportError: no matplotlib. ValueError: no tracked metrics.
    """
    plt = pyplot()
    names = _names(runs)
    fig, axes = plt.subplots(
        len(names), 1, figsize=(8, 2.6 * len(names)), sharex=True, squeeze=False
    )
    _metric_panels(axes[:, 0], names, runs, marks or {})
    axes[-1, 0].set_xlabel("step (gray lines: resumes)")
    return _save(plt, fig, out, title)


def plot_resume_test(
    straight: Series,
    resumed: Series,
    out: str | os.PathLike,
    *,
    stop_at: int | Sequence[int],
    title: str = "",
    first_difference: int | None = None,
) -> str:
    """The resume test's plot: each metric, straight and stopped + resumed, and below them
    a panel of the difference (resumed minus straight, symlog), each stop and the first
    differing step marked, so a failed verdict shows its cause. The panel says "every
    value identical" only when every value is the same by bits (format/bitwise.py): a
    -0.0 against 0.0 differs though its difference is zero.

    Raises:
        ImportError: no matplotlib. ValueError: no tracked metrics.
    """
    plt = pyplot()
    runs = {"straight": straight, "stopped + resumed": resumed}
    names = _names(runs)
    fig, axes = plt.subplots(
        len(names) + 1,
        1,
        figsize=(8, 2.6 * len(names) + 2.8),
        sharex=True,
        squeeze=False,
        gridspec_kw={"height_ratios": [1] * len(names) + [1.1]},
    )
    marks = _marks_of(stop_at, first_difference)
    _metric_panels(axes[:-1, 0], names, runs, marks)
    _difference_panel(axes[-1, 0], names, straight, resumed, marks)
    axes[-1, 0].set_xlabel("step")
    return _save(plt, fig, out, title)


def _names(runs: Mapping[str, Series]) -> list[str]:
    names = sorted({name for s in runs.values() for name in s.values})
    if not names:
        raise ValueError("no tracked metrics to plot: call ckpt.track(step, loss=...) in training")
    return names


def _marks_of(stop_at: int | Sequence[int], first_difference: int | None) -> list[Mark]:
    stops = [stop_at] if isinstance(stop_at, int) else list(stop_at)
    marks = [("stop", k) for k in stops]
    if first_difference is not None:
        marks.append(("first difference", first_difference))
    return marks


def _metric_panels(axes, names, runs: Mapping[str, Series], marks: list[Mark]) -> None:
    resumes = sorted({r for s in runs.values() for r in s.resumes} - {k for _, k in marks})
    for row, (ax, name) in enumerate(zip(axes, names, strict=True)):
        for i, (label, series) in enumerate(runs.items()):
            points = series.values.get(name, [])
            if points:
                steps, values = zip(*points, strict=True)
                ax.plot(steps, values, _STYLES[i % len(_STYLES)], label=label, linewidth=1.4)
        for r in resumes:
            ax.axvline(r, color="tab:gray", linewidth=0.8, alpha=0.7)
            if row == 0:  # the label once, at the top: the line runs through every panel
                _label_line(ax, r, f"resumed from {r}", "tab:gray")
        _marks(ax, marks)
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper right")


def _marks(ax, marks: list[Mark]) -> None:
    colors = {"stop": "tab:red", "first difference": "tab:purple"}
    for label, step in marks:
        ax.axvline(
            step,
            color=colors.get(label, "tab:red"),
            linewidth=1.0,
            linestyle="--",
            label=f"{label} ({step})",
        )


def _label_line(ax, x: float, text: str, color: str) -> None:
    ax.annotate(
        text,
        xy=(x, 1.0),
        xycoords=("data", "axes fraction"),
        xytext=(3, -3),
        textcoords="offset points",
        rotation=90,
        va="top",
        ha="left",
        fontsize=7,
        color=color,
    )


def _difference_panel(ax, names, straight: Series, resumed: Series, marks: list[Mark]) -> None:
    smallest = math.inf
    identical = True
    for i, name in enumerate(names):
        a = dict(straight.values.get(name, []))
        b = dict(resumed.values.get(name, []))
        steps = sorted(a.keys() & b.keys())
        identical = identical and all(bitwise.same_float(a[s], b[s]) for s in steps)
        diffs = [b[s] - a[s] for s in steps]
        # The scale's linear range: the smallest nonzero magnitude (sameness is by bits).
        smallest = min([smallest, *(abs(d) for d in diffs if abs(d) > 0.0 and math.isfinite(d))])
        if steps:
            ax.plot(
                steps,
                diffs,
                _STYLES[i % len(_STYLES)],
                marker=".",
                markersize=3,
                linewidth=1.2,
                label=name,
            )
    # Linear within the smallest difference seen, logarithmic beyond: a 1e-7 difference
    # right after the stop and a 1.0 difference later are both visible, and zero is zero.
    linthresh = smallest if math.isfinite(smallest) else 1.0
    ax.set_yscale("symlog", linthresh=linthresh)
    ax.axhline(0.0, color="black", linewidth=0.6)
    _marks(ax, marks)
    if identical:
        ax.set_ylim(-1.0, 1.0)
        ax.text(
            0.5,
            0.75,
            "no difference: every value identical",
            transform=ax.transAxes,
            ha="center",
            fontsize=9,
            color="tab:green",
        )
    ax.set_ylabel("resumed - straight\n(symlog)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")


def _save(plt, fig, out: str | os.PathLike, title: str) -> str:
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return os.fspath(out)
