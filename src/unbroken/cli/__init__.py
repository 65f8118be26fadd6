"""The ``unbroken`` command line: a thin shell over the library.

Each command parses its options, calls one public function (``inspect`` calls
``unbroken.inspect_checkpoint``, ``verify`` ``verify_checkpoint``, and so on), prints the
result (``--json``: the result's ``to_dict()``) and sets the exit code.

Exit codes: 0 ok, 1 a check failed or a difference was found, 2 a usage error (bad
path, unknown step, not a checkpoint). Read commands (``inspect``, ``verify``, ``diff``)
never write into a checkpoint; ``--json`` prints machine-readable output on stdout and
nothing else there; progress bars go to stderr.

Each command lives in its own module with a ``register(app)`` function; adding one is a
single line in ``COMMAND_MODULES``. Registering imports no torch (``unbroken --help`` is
instant); each command imports the library when it runs.
"""

from __future__ import annotations

import importlib
from typing import Annotated

import typer

from .._version import __version__
from ._common import Group

app = typer.Typer(
    cls=Group,
    name="unbroken",
    help="Look inside, verify, compare, export and import unbroken checkpoints; prove resumes.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

COMMAND_MODULES = (
    "inspect",
    "verify",
    "diff",
    "export",
    "import_",
    "resume_test",
    "plot",
)

for _name in COMMAND_MODULES:
    importlib.import_module(f"{__name__}.{_name}").register(app)


def _print_version(value: bool) -> None:
    if value:
        print(f"unbroken {__version__}")
        raise typer.Exit(0)


@app.callback()
def _options(
    version: Annotated[
        bool,
        typer.Option(
            "--version", is_eager=True, callback=_print_version, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    # The options of `unbroken` itself (before any command); no docstring: it would
    # replace the group's help text.
    pass


def main() -> None:
    """Console-script entry point (``unbroken = "unbroken.cli:main"``)."""
    app(prog_name="unbroken")


__all__ = ["app", "main"]
