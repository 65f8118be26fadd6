"""Shared plumbing of the commands: exit codes, error reporting, JSON, progress, formats.

Each command is a thin shell over a public function (``unbroken.inspect_checkpoint`` and
the rest): it parses options, calls it, prints the result (a table, or with ``--json``
the result's ``to_dict()``) and sets the exit code.

Nothing here imports torch: ``unbroken --help`` must answer at once, so each command
imports its library modules inside the command function.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import json
import sys
from collections.abc import Callable, Iterator
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
)
from typer.core import TyperArgument, TyperCommand, TyperGroup

from ..errors import CheckpointError, CheckpointNotFoundError
from ..storage.posix import size_text
from ..tools.reporting import jsonable
from ._safe import SafeConsole, safe

EXIT_OK = 0
EXIT_FAILED = 1  # a check failed, a difference was found, or the operation failed
EXIT_USAGE = 2  # bad path, unknown step, not a checkpoint, bad option

JsonOption = Annotated[
    bool, typer.Option("--json", help="Machine-readable output on stdout (and nothing else).")
]
# click's errors, as typer raises them (recent typer releases carry a copy of click of
# their own): found from the one typer exports, so that either kind is caught.
_CLICK_ERROR = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
_USAGE_ERROR = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")

StepOption = Annotated[
    int | None, typer.Option("--step", min=0, help="A committed step (default: the latest).")
]


def unwrap(text: str) -> str:
    """Help text written hard-wrapped in the source, as paragraphs the terminal wraps."""
    paragraphs = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(" ".join(p.split()) for p in paragraphs)


def _flags_as_flags(params: list) -> list:
    """Show boolean flags as ``--json``, not ``--json <bool>`` (they take no value)."""
    for p in params:
        if getattr(p, "is_flag", False) and p.metavar is None:
            p.metavar = ""
    return params


class Command(TyperCommand):
    """Every command: flags shown as flags, help paragraphs re-wrapped to the terminal."""

    def __init__(self, *args: Any, help: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, help=unwrap(help) if help else help, **kwargs)

    def get_params(self, ctx: Any) -> list:
        return _flags_as_flags(super().get_params(ctx))

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        """``unbroken diff [OPTIONS] A B`` (typer would write ``{A} {B}``, which reads
        like the ``{dir}`` placeholder of resume-test)."""
        pieces = [self.options_metavar] if self.options_metavar else []
        for p in self.get_params(ctx):
            if isinstance(p, TyperArgument) and p.required and p.nargs == 1:
                pieces.append(p.display_name_raw)
            else:
                pieces.extend(p.get_usage_pieces(ctx))
        return pieces


class Group(TyperGroup):
    """The ``unbroken`` group itself (its ``--help`` is a flag too). Every usage error of
    it and of its commands (parsed, or raised by a command as ``typer.BadParameter``) is
    one line on stderr, not typer's boxed panel (:func:`one_line_errors`)."""

    def get_params(self, ctx: Any) -> list:
        return _flags_as_flags(super().get_params(ctx))

    def make_context(self, *args: Any, **kwargs: Any) -> Any:
        with one_line_errors():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx: Any) -> Any:
        with one_line_errors():
            return super().invoke(ctx)


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
    """Print click's errors (a missing or unknown option, a bad value, a
    ``typer.BadParameter``) as one line on stderr, ``UsageError: message (see 'unbroken
    CMD --help')``, and exit with their code (2 for usage errors). ``unbroken`` alone
    still prints its help."""
    try:
        yield
    except _CLICK_ERROR as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # the help itself, not an error
            raise
        name = "UsageError" if isinstance(exc, _USAGE_ERROR) else type(exc).__name__
        message = " ".join(exc.format_message().split())  # one line, whatever it held
        ctx = getattr(exc, "ctx", None)
        if isinstance(exc, _USAGE_ERROR) and ctx is not None and ctx.help_option_names:
            message += f" (see '{ctx.command_path} {ctx.help_option_names[0]}')"
        print(f"{name}: {safe(message)}", file=sys.stderr)
        raise typer.Exit(exc.exit_code) from None


def stdout() -> Console:
    """The console of a command's human output: it shows control characters escaped."""
    return SafeConsole(highlight=False, soft_wrap=True)


def stderr() -> Console:
    return SafeConsole(stderr=True, highlight=False)


def report_error(exc: BaseException) -> None:
    """``TypeName: message`` on stderr (plain text: messages may contain brackets; a
    name's control characters shown escaped)."""
    print(f"{type(exc).__name__}: {safe(exc, lines=True)}", file=sys.stderr)


@contextlib.contextmanager
def guard() -> Iterator[None]:
    """Turn the library's errors into exit codes: 2 for no such checkpoint, else 1."""
    try:
        yield
    except CheckpointNotFoundError as exc:
        report_error(exc)
        raise typer.Exit(EXIT_USAGE) from None
    except CheckpointError as exc:
        report_error(exc)
        raise typer.Exit(EXIT_FAILED) from None


def usage_error(exc: BaseException) -> typer.Exit:
    report_error(exc)
    return typer.Exit(EXIT_USAGE)


def emit_json(obj: Any) -> None:
    """``obj`` as JSON on stdout (a tool's result: its ``to_dict()``)."""
    sys.stdout.write(json.dumps(jsonable(obj), indent=2, allow_nan=False) + "\n")
    sys.stdout.flush()


@contextlib.contextmanager
def progress(description: str, *, unit: str = "bytes") -> Iterator[Callable[[int, int], None]]:
    """A progress bar on stderr (shown on terminals only); yields the ``progress(done,
    total)`` callback the library functions take."""
    console = stderr()
    count = DownloadColumn() if unit == "bytes" else MofNCompleteColumn()
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        count,
        TimeRemainingColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )
    with bar:
        task = bar.add_task(description, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def human_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    return size_text(n)


def when(unix: float | None) -> str:
    if unix is None:
        return "?"
    return datetime.datetime.fromtimestamp(unix).strftime("%Y-%m-%d %H:%M:%S")


def lineage_text(lineage: list[dict[str, Any]]) -> str:
    """``start (ws 2) -> resume from 200 (ws 1, reset rng)``."""
    return " -> ".join(event_text(event) for event in lineage) or "-"


def event_text(event: dict[str, Any]) -> str:
    """``resume from 4 (ws 1, reset rng; retired 5, 6; replay identical)``: one lineage
    event, with the abandoned steps it retired and its replay verdict."""
    kind = event.get("event", "?")
    ws = event.get("world_size")
    detail = [f"ws {ws}"] if ws is not None else []
    if event.get("reset"):
        detail.append("reset " + ",".join(event["reset"]))
    notes = [", ".join(detail)] if detail else []
    if event.get("retired"):
        notes.append("retired " + ", ".join(map(str, event["retired"])))
    replay = event.get("replay")
    if isinstance(replay, dict):
        status = replay.get("status", "?")
        if status == "different":
            status = f"DIFFERENT at step {replay.get('step')} ({replay.get('metric')})"
        notes.append(f"replay {status}")
    label = f"resume from {event.get('from_step')}" if kind == "resume" else str(kind)
    return label + (f" ({'; '.join(notes)})" if notes else "")
