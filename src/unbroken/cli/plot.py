"""``unbroken plot DIR|URL [--out FILE.png] [--json]``: tracked metrics over all resumes."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..errors import CheckpointNotFoundError
from ._common import Command, JsonOption, emit_json, guard, stdout, usage_error
from ._safe import shown

HELP = """Plot a run's tracked metrics to a PNG, resume points marked.

One panel per metric recorded with ckpt.track(). The series follows the timeline that
survived: steps replayed after resuming from an older checkpoint replace the abandoned
ones; each resume is a labelled line. DIR is a run folder or a store's URL (s3://...).
Default output: DIR/metrics.png (for a URL: metrics.png in the current folder). Needs
matplotlib (pip install 'unbroken[plot]'). Exit 2 if nothing was tracked there or there
is no matplotlib."""


def register(app: typer.Typer) -> None:
    app.command("plot", help=HELP, cls=Command)(plot_command)


def plot_command(
    path: Annotated[
        str,
        typer.Argument(
            metavar="DIR", help="A run folder (holding metrics.jsonl) or a store's URL."
        ),
    ],
    out: Annotated[Path | None, typer.Option("--out", help="PNG to write.")] = None,
    as_json: JsonOption = False,
) -> None:
    from ..format.series import record_lines, record_name, series_from_lines
    from ..proof.plotting import plot_series
    from ..storage.locate import location

    with guard():
        where = location(path)
        lines = record_lines(where)  # read once: on a store, one request per object
        if lines is None:
            raise CheckpointNotFoundError(
                f"{record_name(where)} does not exist: no metrics were tracked in {where} "
                "(call ckpt.track(step, loss=...) in the training loop)"
            )
        series = series_from_lines(lines)
        target = out or where.local_file("metrics.png")
        try:
            plot_series({where.name or str(where): series}, target, title=f"{where}")
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
        f"wrote {shown(target)} ({len(series.values)} metric(s), {len(series.resumes)} resume(s))"
    )
