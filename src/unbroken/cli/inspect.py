"""``unbroken inspect DIR [--step N] [--json]``: what a run's checkpoints hold."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from ._common import (
    EXIT_FAILED,
    Command,
    JsonOption,
    StepOption,
    emit_json,
    event_text,
    guard,
    human_bytes,
    lineage_text,
    stdout,
    when,
)
from ._safe import shown

if TYPE_CHECKING:
    from ..tools.inspection import CheckpointInspection, CheckpointSummary, RunInspection

HELP = """Show a run's committed checkpoints, or one checkpoint in detail.

Without --step (and given a run folder): every committed checkpoint with its time, size
on disk, world size, torch and unbroken versions, and lineage of resumes and resets.

With --step (or given a step folder): components, every tensor (key, shape, dtype,
bytes) and the optimizer's coverage of the model (state entries and `step` per
parameter; parameters without state and model tensors in no param group are flagged).

A step folder without manifest.json (its manifest was lost or deleted) is listed as
DAMAGED: it is never restored, and `unbroken verify` fails on it.

Reads only the JSON manifest (and the optimizer's `step` tensors); never writes.
Exit 0, or 1 if a manifest is damaged, 2 if DIR is not a checkpoint or the step does
not exist."""


def register(app: typer.Typer) -> None:
    app.command("inspect", help=HELP, cls=Command)(inspect_command)


def inspect_command(
    path: Annotated[
        str, typer.Argument(metavar="DIR", help="A run folder or one step folder (or URL).")
    ],
    step: StepOption = None,
    as_json: JsonOption = False,
) -> None:
    from ..tools.inspection import RunInspection, inspect_checkpoint

    with guard():
        found = inspect_checkpoint(path, step=step)
    if as_json:
        emit_json(found.to_dict())
    elif isinstance(found, RunInspection):
        _print_run(found)
    else:
        _print_detail(found)
    if isinstance(found, RunInspection) and found.unreadable:  # verify fails on the others
        raise typer.Exit(EXIT_FAILED)


def _print_run(run: RunInspection) -> None:
    # Versions are usually the same for every step: said once under the table, a
    # column only when they differ (the lineage keeps room at 80 columns).
    summaries = run.checkpoints
    versions = {_versions(s) for s in summaries if not s.error}
    table = Table(
        title=f"committed checkpoints in {shown(run.path)}",
        caption=f"saved with {versions.pop()}" if len(versions) == 1 else None,
    )
    columns = ["step", "created", "size", "world"] + (["versions"] if versions else [])
    for col in columns:
        table.add_column(col, no_wrap=True, justify="left" if col == "created" else "right")
    table.add_column("lineage", overflow="fold", min_width=20)
    for s in summaries:
        if s.error:
            table.add_row(
                str(s.step),
                "[red]DAMAGED[/red]",
                human_bytes(s.size_bytes),
                "",
                *[""] * (len(columns) - 4),
                escape(s.error),
            )
            continue
        row = [str(s.step), when(s.created_unix), human_bytes(s.size_bytes), str(s.world_size)]
        if versions:
            row.append(_versions(s).replace(", ", "\n"))
        table.add_row(*row, escape(lineage_text(s.lineage)))
    stdout().print(table)
    _print_branch(run.newest, run.retired)


def _print_branch(newest: CheckpointSummary | None, retired: list[CheckpointSummary]) -> None:
    """The newest lineage as a branch (what restore() resumes), and the retired steps."""
    console = stdout()
    if newest is not None and len(newest.lineage) > 1:
        console.print(
            f"history of step {newest.step} (the newest lineage, what restore() resumes):"
        )
        for depth, event in enumerate(newest.lineage):
            console.print(
                "  " + "   " * (depth - 1) + ("└─ " if depth else "") + escape(event_text(event))
            )
    if retired:
        console.print(
            "retired checkpoints (abandoned branches: never listed or restored; "
            "delete them when no longer needed):"
        )
        table = Table()
        table.add_column("step", justify="right")
        table.add_column("size", justify="right", no_wrap=True)
        table.add_column("folder", no_wrap=True)
        table.add_column("lineage", overflow="fold")
        for r in retired:
            lineage = r.error or lineage_text(r.lineage)
            table.add_row(
                str(r.step), human_bytes(r.size_bytes), shown(Path(r.path).name), escape(lineage)
            )
        console.print(table)


def _versions(s: Any) -> str:
    return f"torch {s.versions.get('torch', '?')}, unbroken {s.versions.get('unbroken', '?')}"


def _print_detail(info: CheckpointInspection) -> None:
    console = stdout()
    versions = ", ".join(f"{k} {v}" for k, v in info.versions.items())
    console.print(f"[bold]step {info.step}[/bold]  {escape(info.path)}")
    console.print(
        f"  saved {when(info.created_unix)} by {info.world_size} rank(s); {escape(versions)}"
    )
    console.print(f"  lineage: {escape(lineage_text(info.lineage))}")
    console.print(
        f"  tracked metrics: {len(info.metrics)} step(s); probe: {escape(str(info.probe))}"
    )
    console.print(f"  fingerprints: {escape(info.fingerprint_format)}")
    if info.fingerprint_note:
        console.print(f"  [yellow]note:[/yellow] {escape(info.fingerprint_note)}")
    table = Table(title="components")
    for col in ("component", "kind", "per rank", "tensors", "bytes"):
        table.add_column(col)
    for c in info.components:
        table.add_row(
            shown(c.name),
            escape(c.kind),
            "yes" if c.per_rank else "",
            str(c.tensors),
            human_bytes(c.bytes),
        )
    console.print(table)
    table = Table(title="tensors")
    table.add_column("key", overflow="fold")
    for col in ("shape", "dtype", "bytes"):
        table.add_column(col, no_wrap=True)
    for t in info.tensors:
        table.add_row(
            shown(t.key),
            "x".join(map(str, t.shape)) or "scalar",
            escape(t.dtype),
            human_bytes(t.bytes),
        )
    console.print(table)
    if info.frozen is not None:
        f = info.frozen
        console.print(
            f"  frozen base: {f.tensors} tensor(s), {human_bytes(f.bytes)}, verified by "
            "fingerprint at restore, not stored"
            + (f"; {f.stored} frozen tensor(s) stored (changed since the base)" if f.stored else "")
        )
    if info.optimizer is not None:
        _print_coverage(console, info.optimizer)


def _print_coverage(console, coverage) -> None:
    table = Table(title="optimizer coverage")
    for col in ("parameter", "group", "state entries", "step", "flag"):
        table.add_column(col, overflow="fold", no_wrap=col in ("group", "step"))
    for p in coverage.params:
        flag = "" if p.in_model else "[red]not a model tensor[/red]"
        if not p.entries:
            flag = (flag + " " if flag else "") + "[yellow]no state[/yellow]"
        group = str(p.group) if p.optimizer is None else f"{shown(p.optimizer)}/{p.group}"
        step = "" if p.step is None else f"{p.step:g}"
        entries = ", ".join(map(shown, p.entries)) or "-"
        table.add_row(shown(p.fqn), group, entries, step, flag)
    console.print(table)
    for message in coverage.failures:
        console.print(f"[red]problem:[/red] {escape(message)}")
    for message in coverage.warnings:
        console.print(f"[yellow]note:[/yellow] {escape(message)}")
    for alias, target in coverage.tied.items():
        console.print(f"tied: {shown(alias)} is {shown(target)} (optimized under that name)")
