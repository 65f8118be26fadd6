"""``unbroken plot DIR [--out FILE.png]``: tracked metrics over all resumes."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..errors import CheckpointNotFoundError
from ..proof.metrics import FILE, read_series
from ..proof.plotting import plot_series
from ._common import guard, stdout

HELP = """Plot a run's tracked metrics to a PNG, resume points marked.

One panel per metric recorded with ckpt.track(). The series follows the timeline that
survived: steps replayed after resuming from an older checkpoint replace the abandoned
ones. Default output: DIR/metrics.png."""


def register(app: typer.Typer) -> None:
    app.command("plot", help=HELP)(plot_command)


def plot_command(
    path: Annotated[Path, typer.Argument(help="A run folder (holding metrics.jsonl).")],
    out: Annotated[Path | None, typer.Option("--out", help="PNG to write.")] = None,
) -> None:
    with guard():
        if not (path / FILE).is_file():
            raise CheckpointNotFoundError(
                f"{path / FILE} does not exist: no metrics were tracked in {path} "
                "(call ckpt.track(step, loss=...) in the training loop)"
            )
        series = read_series(path)
        target = out or path / "metrics.png"
        plot_series({path.name or str(path): series}, target, title=f"{path}")
    stdout().print(
        f"wrote {target} ({len(series.values)} metric(s), {len(series.resumes)} resume(s))"
    )
