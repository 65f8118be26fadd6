"""``unbroken verify DIR [--step N | --all] [--json]``: is every byte what it should be?"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from ._common import (
    EXIT_FAILED,
    Command,
    JsonOption,
    StepOption,
    emit_json,
    guard,
    human_bytes,
    progress,
    stdout,
)
from ._safe import shown

if TYPE_CHECKING:
    from ..tools.verification import CheckpointVerification

HELP = """Verify committed checkpoints completely, reading every byte.

Checks: the manifest's own checksum and structure; every listed file present at its
recorded size and nothing unlisted; each file's record consistent with its chunks;
every chunk's xxh3-128 checksum; every tensor's fingerprint recomputed from its
assembled value; every tensor referenced by a component; the optimizer state covering
the model (no state for unknown FQNs or outside param groups). Default: the latest step.
Given a run folder without --step, every step folder that lost its manifest.json is
reported as damaged too.

Never writes. Exit 0 when every check holds, 1 when any fails (each failure named with
its file or tensor), 2 if DIR is not a checkpoint or the step does not exist."""

MAX_SHOWN = 20


def register(app: typer.Typer) -> None:
    app.command("verify", help=HELP, cls=Command)(verify_command)


def verify_command(
    path: Annotated[
        str, typer.Argument(metavar="DIR", help="A run folder or one step folder (or URL).")
    ],
    step: StepOption = None,
    every: Annotated[bool, typer.Option("--all", help="Verify every committed step.")] = False,
    as_json: JsonOption = False,
) -> None:
    from ..tools.verification import verify_checkpoint

    if every and step is not None:
        raise typer.BadParameter("--step and --all exclude each other")
    with guard(), progress("verifying") as advance:
        report = verify_checkpoint(path, step=step, all=every, progress=advance)
    if as_json:
        emit_json(report.to_dict())
    else:
        console = stdout()
        for r in report.checkpoints:
            _print(console, r)
    if not report.ok:
        raise typer.Exit(EXIT_FAILED)


def _print(console, r: CheckpointVerification) -> None:
    where = f"step {r.step}" if r.step is not None else "checkpoint"
    if r.ok:
        console.print(
            f"[green]OK[/green] {where} ({escape(r.path)}): {r.files_checked} file(s), "
            f"{r.tensors_checked} tensor(s), {human_bytes(r.bytes_read)} read; checksums and "
            "fingerprints match"
        )
    else:
        console.print(f"[red]FAILED[/red] {where} ({escape(r.path)}): {len(r.failures)} problem(s)")
        for f in r.failures[:MAX_SHOWN]:
            console.print(f"  [red]{shown(f.where)}[/red]: {escape(f.message)}")
        if len(r.failures) > MAX_SHOWN:
            console.print(f"  ... and {len(r.failures) - MAX_SHOWN} more (--json lists all)")
    for w in r.warnings:
        console.print(f"  [yellow]note:[/yellow] {escape(w)}")
