"""``unbroken plot DIR [--out FILE.png] [--json]``: tracked metrics over all resumes."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..errors import CheckpointNotFoundError
from ._common import Command, JsonOption, emit_json, guard, stdout, usage_error

HELP = """Plot a run's tracked metrics to a PNG, resume points marked.

One panel per metric recorded with ckpt.track(). The series follows the timeline that
survived: steps replayed after resuming from an older checkpoint replace the abandoned
ones; each resume is a labelled line. Default output: DIR/metrics.png. Needs matplotlib
(pip install 'unbroken[plot]'). Exit 2 if DIR has no tracked metrics or there is no
matplotlib."""


def register(app: typer.Typer) -> None:
    app.command("plot", help=HELP, cls=Command)(plot_command)


def plot_command(
    path: Annotated[
        Path, typer.Argument(metavar="DIR", help="A run folder (holding metrics.jsonl).")
    ],
    out: Annotated[Path | None, typer.Option("--out", help="PNG to write.")] = None,
    as_json: JsonOption = False,
) -> None:
    from ..proof.metrics import FILE, read_series
    from ..proof.plotting import plot_series

    with guard():
        if not (path / FILE).is_file():
            raise CheckpointNotFoundError(
                f"{path / FILE} does not exist: no metrics were tracked in {path} "
                "(call ckpt.track(step, loss=...) in the training loop)"
            )
        series = read_series(path)
        target = out or path / "metrics.png"
        try:
            plot_series({path.name or str(path): series}, target, title=f"{path}")
        except ImportError as exc:  # matplotlib is an optional extra
            raise usage_error(exc) from None
    if as_json:
        emit_json(
            {
                "path": str(target),
                "metrics": sorted(series.values),
                "steps": max((len(v) for v in series.values.values()), default=0),
                "resumes": series.resumes,
            }
        )
        return
    stdout().print(
        f"wrote {target} ({len(series.values)} metric(s), {len(series.resumes)} resume(s))"
    )
