"""``unbroken verify DIR [--step N | --all] [--json]``: is every byte what it should be?"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from ..errors import CheckpointError
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

if TYPE_CHECKING:
    from ..tools.audit import AuditReport

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
MAX_RELISTS = 100  # how often verification may start over because a save changed the folder


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
    if every and step is not None:
        raise typer.BadParameter("--step and --all exclude each other")
    with guard():
        reports = _verify(path, step, every)
    if as_json:
        emit_json({"ok": all(r.ok for r in reports), "checkpoints": reports})
    else:
        console = stdout()
        for r in reports:
            _print(console, r)
    if not all(r.ok for r in reports):
        raise typer.Exit(EXIT_FAILED)


def _verify(path: Path, step: int | None, every: bool) -> list[AuditReport]:
    """Audit the folders. One that a concurrent save pruned or re-saved while it was read
    is not damaged: the folders are listed again, and those not audited as they are now
    are audited (a step that is gone is no longer asked for; one pruned that was asked
    for by --step is a missing step)."""
    from ..tools.audit import audit, total_bytes

    done: dict[Path, AuditReport] = {}
    for _ in range(MAX_RELISTS):
        folders = _folders(path, step, every)
        todo = [f for f in folders if f not in done]
        with progress("verifying", sum(total_bytes(f) for f in todo)) as advance:
            for f in todo:
                done[f] = audit(f, on_bytes=advance)
        if not any(done[f].vanished for f in folders):
            return [done[f] for f in folders]
        done = {f: r for f, r in done.items() if not r.vanished}
    raise CheckpointError(f"the checkpoints in {path} changed faster than they could be verified")


def _folders(path: Path, step: int | None, every: bool) -> list[Path]:
    """The folders to audit: the step asked for; else the latest (or every) committed
    one and every step folder without manifest.json (damaged: its audit fails)."""
    from ..tools.inspection import is_step_folder, locate, step_folders

    if step is not None:
        return [locate(path, step)]
    folders = step_folders(path, damaged=True)
    if every:
        return folders
    committed = [f for f in folders if is_step_folder(f)]
    return [f for f in folders if f == committed[-1] or not is_step_folder(f)]


def _print(console, r: AuditReport) -> None:
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
            console.print(f"  [red]{escape(f.where)}[/red]: {escape(f.message)}")
        if len(r.failures) > MAX_SHOWN:
            console.print(f"  ... and {len(r.failures) - MAX_SHOWN} more (--json lists all)")
    for w in r.warnings:
        console.print(f"  [yellow]note:[/yellow] {escape(w)}")
