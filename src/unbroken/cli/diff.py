"""``unbroken diff A B [--json]``: do two checkpoints hold the same state?"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.table import Table

from ._common import EXIT_FAILED, Command, JsonOption, emit_json, guard, progress, stdout
from ._safe import safe, shown

if TYPE_CHECKING:
    from ..tools.comparison import DiffReport, TensorDiff

HELP = """Compare two checkpoints tensor by tensor, across any world sizes.

A and B are step folders, or run folders meaning their latest step. Logical tensors are
compared (not shards), so a checkpoint saved on 2 ranks equals the same state saved from
1 process. Per tensor: equal, values differ (count and max absolute difference), dtype
or shape changed, only in A, only in B; per component: a summary, and differences in
non-tensor state (hyperparameters, counters). Per-rank state (rng, dataloader) is
skipped, and listed, when the world sizes differ. Equal fingerprints count as equal
values unless --full.

Never writes. Exit 0 if identical, 1 if anything differs, 2 if A or B is not a
checkpoint."""


def register(app: typer.Typer) -> None:
    app.command("diff", help=HELP, cls=Command)(diff_command)


def diff_command(
    a: Annotated[
        str, typer.Argument(metavar="A", help="Checkpoint A (step folder or run folder).")
    ],
    b: Annotated[
        str, typer.Argument(metavar="B", help="Checkpoint B (step folder or run folder).")
    ],
    full: Annotated[
        bool, typer.Option("--full", help="Compare bytes even where fingerprints agree.")
    ] = False,
    ignore: Annotated[
        list[str] | None,
        typer.Option("--ignore", help="Leave a component out (repeatable), e.g. rng."),
    ] = None,
    as_json: JsonOption = False,
) -> None:
    from ..tools.comparison import diff_checkpoints

    with guard(), progress("comparing", unit="tensors") as advance:
        report = diff_checkpoints(a, b, full=full, ignore=ignore or (), progress=advance)
    if as_json:
        emit_json(report.to_dict())
    else:
        _print(report)
    if not report.identical:
        raise typer.Exit(EXIT_FAILED)


MAX_TENSORS = 20  # rows of the "tensors that differ" table (--json lists all)
MAX_STATE = 10  # non-tensor state differences shown per component


def _describe(t: TensorDiff) -> tuple[str, str]:
    """(what differs, max |A-B|) for the table."""
    worst = "" if t.max_abs_diff is None else f"{t.max_abs_diff:.4g}"
    if t.status == "values" and t.differing is None:  # a frozen base proven, not stored
        return "fingerprint (not stored)", worst
    if t.status == "values":
        numel = math.prod(t.shape_a or [])
        return f"{t.differing} of {numel} value(s)", worst
    if t.status == "dtype":
        return f"dtype {t.dtype_a} -> {t.dtype_b}", worst
    if t.status == "shape":
        return f"shape {t.shape_a} -> {t.shape_b}", ""
    return {"only_a": "only in A", "only_b": "only in B"}.get(t.status, t.status), ""


def _print(report: DiffReport) -> None:
    console = stdout()
    for label, meta in (("A", report.a), ("B", report.b)):
        console.print(
            f"{label}: step {meta['step']}, world size {meta['world_size']}  {escape(meta['path'])}"
        )
    table = Table(title="components")
    for col in ("component", "status", "equal", "differ", "only A", "only B"):
        table.add_column(
            col, no_wrap=True, justify="right" if col not in ("component", "status") else "left"
        )
    table.add_column("note", overflow="fold")
    colors = {"identical": "green", "skipped": "yellow"}
    for c in report.components:
        color = colors.get(c.status, "red")
        table.add_row(
            shown(c.name),
            f"[{color}]{c.status}[/{color}]",
            str(c.equal),
            str(c.different),
            str(c.only_a),
            str(c.only_b),
            escape(c.note),
        )
    console.print(table)
    # RNG state, one line per generator, instead of hundreds of state words and tensors.
    summarized = {"rng"} if report.rng else set()
    if report.rng:
        console.print("rng state, per generator:")
        width = max(len(safe(g.label)) for g in report.rng)
        for g in report.rng:
            color = "green" if g.status == "same" else "red"
            label = escape(safe(g.label).ljust(width))
            console.print(f"  {label}  [{color}]{escape(g.status)}[/{color}]")
    changed = [t for t in report.tensors if t.status != "equal"]
    listed = [t for t in changed if t.component not in summarized]
    if listed:
        table = Table(title="tensors that differ")
        table.add_column("key", overflow="fold")
        table.add_column("difference", no_wrap=True)
        table.add_column("max |A-B|", no_wrap=True, justify="right")
        for t in listed[:MAX_TENSORS]:
            table.add_row(shown(t.key), *map(escape, _describe(t)))
        console.print(table)
        _more(console, len(listed) - MAX_TENSORS, "tensor(s) differ")
    for c in report.components:
        if c.name in summarized:
            continue
        for d in c.state_differences[:MAX_STATE]:
            console.print(f"[red]state differs:[/red] {escape(d)}")
        _more(
            console, len(c.state_differences) - MAX_STATE, f"state difference(s) in {shown(c.name)}"
        )
    equal = len(report.tensors) - len(changed)
    verdict = "[green]identical[/green]" if report.identical else "[red]different[/red]"
    console.print(f"{verdict}: {equal} tensor(s) equal, {len(changed)} differ")


def _more(console, left_out: int, what: str) -> None:
    if left_out > 0:
        console.print(f"... and {left_out} more {what} (--json lists all)")
