"""PNG plots of tracked metrics, resume points marked (matplotlib, no display needed)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from .metrics import Series


def plot_series(
    runs: Mapping[str, Series],
    out: str | os.PathLike,
    *,
    title: str = "",
    marks: Mapping[str, int] | None = None,
) -> str:
    """Plot every metric of every run (one panel per metric) to ``out``; returns its path.

    ``marks`` adds labelled vertical lines (e.g. ``{"stopped": 25}``); each run's own
    resume points are marked too.
    """
    try:
        import matplotlib
    except ImportError:
        raise ImportError(
            "plots need matplotlib: pip install 'unbroken[plot]' (or pass plot=False)"
        ) from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({name for s in runs.values() for name in s.values})
    if not names:
        raise ValueError("no tracked metrics to plot: call ckpt.track(step, loss=...) in training")
    fig, axes = plt.subplots(
        len(names), 1, figsize=(8, 2.6 * len(names)), sharex=True, squeeze=False
    )
    styles = ["-", "--", ":", "-."]
    for ax, name in zip(axes[:, 0], names, strict=True):
        for i, (label, series) in enumerate(runs.items()):
            points = series.values.get(name, [])
            if points:
                steps, values = zip(*points, strict=True)
                ax.plot(steps, values, styles[i % len(styles)], label=label, linewidth=1.4)
            for r in series.resumes:
                ax.axvline(r, color="tab:gray", linewidth=0.8, alpha=0.7)
        for label, step in (marks or {}).items():
            ax.axvline(
                step, color="tab:red", linewidth=1.0, linestyle="--", label=f"{label} ({step})"
            )
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper right")
    axes[-1, 0].set_xlabel("step (gray lines: resumes)")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return os.fspath(out)
