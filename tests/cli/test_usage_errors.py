"""A usage error is one line on stderr (``UsageError: message (see 'unbroken CMD
--help')``) and exit 2, as docs/cli.md promises: never typer's boxed panel. --help and
``unbroken`` alone still print the help."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cli.conftest import run_cli

CASES = {
    "missing option": (["export", "{run}"], "Missing option '--to'", "unbroken export --help"),
    "missing argument": (["diff", "{run}"], "Missing argument 'B'", "unbroken diff --help"),
    "step with all": (
        ["verify", "{run}", "--step", "2", "--all"],
        "--step and --all exclude each other",
        "unbroken verify --help",
    ),
    "unknown option": (["inspect", "{run}", "--bogus"], "No such option: --bogus", "inspect"),
    "bad value type": (
        ["verify", "{run}", "--step", "two"],
        "Invalid value for '--step'",
        "verify",
    ),
    "bad choice": (["export", "{run}", "--to", "x", "--dtype", "fp8"], "'fp8'", "export"),
    "unknown command": (["nosuchcmd"], "No such command 'nosuchcmd'", "unbroken --help"),
    "unknown top option": (["--bogus"], "No such option: --bogus", "unbroken --help"),
    "resume-test without {dir}": (
        ["resume-test", "--stop-at", "3", "--", sys.executable, "-c", "pass"],
        "{dir}",
        "unbroken resume-test --help",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_usage_error_is_one_line_and_exit_2(single_run, case):
    args, says, hint = CASES[case]
    result = run_cli(*(a.replace("{run}", str(single_run)) for a in args))
    assert result.exit_code == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("UsageError: ") and says in lines[0], lines[0]
    assert hint in lines[0] and "╭" not in result.stderr and "│" not in result.stderr
    assert result.stdout == ""


def test_a_usage_error_of_the_installed_command_is_one_line(single_run):
    """The real entry point too (not only the in-process runner)."""
    out = subprocess.run(
        [sys.executable, "-m", "unbroken.cli", "verify", str(single_run), "--step", "x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and out.stderr.startswith("UsageError: ")


@pytest.mark.parametrize("args", [["--help"], ["export", "--help"], []])
def test_help_is_unchanged(args):
    result = run_cli(*args)
    assert result.exit_code == (2 if not args else 0)
    assert "Usage: unbroken" in result.stdout and "UsageError" not in result.stderr
