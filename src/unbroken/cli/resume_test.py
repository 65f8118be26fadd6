"""``unbroken resume-test --stop-at K[,K2,...] [--resume-cmd "..."] -- CMD ...``: prove a
resume."""

from __future__ import annotations

import shlex
import tempfile
from itertools import pairwise
from pathlib import Path
from typing import Annotated

import typer

from ._common import (
    EXIT_FAILED,
    Command,
    JsonOption,
    emit_json,
    guard,
    report_error,
    stderr,
    stdout,
    usage_error,
)

HELP = """Run CMD straight, then stopped at step K and resumed, and compare.

CMD must contain {dir}, replaced by a fresh checkpoint folder for each run, and must use
ub.Checkpointer with should_stop() (UNBROKEN_STOP_AT=K stops the second run at K).
--stop-at 10,20 stops and resumes at each step in turn (a bug that shows only on a
second resume needs two). The resumed run must restore each stop step (its checkpoints'
lineage says so: otherwise NOT RESUMED), and every tracked metric after the first stop
and the whole final state (tensors and non-tensor values) must be bit-identical. With
--resume-cmd (e.g. another world size) the resumed run may deviate by up to
--tolerance (relative); the restore itself is still verified exactly. With --tier local
each stop's save goes to the script's local tier (it passes local=ub.LocalTier(...)) and
each resume must restore it from there (its lineage says so), else NOT RESUMED.

Writes a text report, a JSON result and a PNG plot into --workdir (default: a new
temporary folder, printed). With --store URL the runs keep their checkpoints on an
object store (URL/straight and URL/resumed; {dir} is replaced by those URLs). Exit 0
when identical (or within tolerance), 1 otherwise (NOT RESUMED, or the first differing
step and metric named, with a cause only where the checkpoints show one), 2 on bad usage
(a used folder or prefix included)."""


def register(app: typer.Typer) -> None:
    app.command(
        "resume-test",
        help=HELP,
        cls=Command,
        options_metavar="[OPTIONS] -- CMD ...",
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    )(resume_test_command)


def resume_test_command(
    ctx: typer.Context,
    stop_at: Annotated[
        str,
        typer.Option(
            "--stop-at", help="Step K to stop at, or increasing steps K1,K2,... to stop at each."
        ),
    ],
    resume_cmd: Annotated[
        str | None, typer.Option("--resume-cmd", help="Command for the resumed run.")
    ] = None,
    workdir: Annotated[
        Path | None, typer.Option("--workdir", help="Where runs, report and plot go.")
    ] = None,
    store: Annotated[
        str | None,
        typer.Option(
            "--store", help="A fresh URL prefix (s3://bucket/prefix) for the checkpoints."
        ),
    ] = None,
    tolerance: Annotated[
        float, typer.Option("--tolerance", help="Relative deviation allowed with --resume-cmd.")
    ] = 0.05,
    timeout: Annotated[
        float | None,
        typer.Option(
            "--timeout",
            help="Seconds allowed per run; past it the run is killed with every process it "
            "started (exit 1).",
        ),
    ] = None,
    parallel: Annotated[
        bool,
        typer.Option(
            "--parallel",
            help="Run the straight and the stopped run at the same time (not for commands "
            "that need a whole GPU or bind a fixed port).",
        ),
    ] = False,
    tier: Annotated[
        str,
        typer.Option(
            "--tier",
            help="local: each stop's save goes to the script's local tier "
            "(ub.LocalTier) and each resume must restore it from there.",
        ),
    ] = "persistent",
    as_json: JsonOption = False,
) -> None:
    from ..testing import RunFailed, resume_test

    stops = _stops(stop_at)
    command = list(ctx.args)
    if not command:
        raise typer.BadParameter("give the training command after --, containing {dir}")
    if not any("{dir}" in arg for arg in command):
        raise typer.BadParameter("the command must contain {dir} (its checkpoint folder)")
    work = workdir or Path(tempfile.mkdtemp(prefix="unbroken-resume-test-"))
    if not as_json:
        stderr().print(
            f"resume test in {work}: running {shlex.join(command)}", markup=False, soft_wrap=True
        )
    with guard():
        try:
            result = resume_test(
                command,
                stop_at=stops,
                workdir=work,
                resume_command=shlex.split(resume_cmd) if resume_cmd else None,
                tolerance=tolerance,
                timeout=timeout,
                parallel=parallel,
                store=store,
                tier=tier,
            )
        except RunFailed as exc:
            report_error(exc)  # plain text, unwrapped: paths and tracebacks stay whole
            raise typer.Exit(EXIT_FAILED) from None
        except ValueError as exc:  # a used folder or prefix, a bad stop step
            raise usage_error(exc) from None
    if as_json:
        emit_json(result)
    else:
        stdout().print(str(result), markup=False, highlight=False)
    if not result.passed:
        raise typer.Exit(EXIT_FAILED)


def _stops(text: str) -> int | list[int]:
    """``--stop-at 20`` -> 20; ``--stop-at 10,20`` -> [10, 20]."""
    parts = [p.strip() for p in text.split(",")]
    try:
        steps = [int(p) for p in parts]
    except ValueError:
        steps = []
    if not steps or any(k < 1 for k in steps) or any(b <= a for a, b in pairwise(steps)):
        raise typer.BadParameter(
            f"--stop-at takes a step >= 1 or increasing steps (10,20,30), got {text!r}"
        )
    return steps[0] if len(steps) == 1 else steps
