"""Help pages (fast: no torch; flags as flags) and output that fits 80 columns."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

COMMANDS = ("inspect", "verify", "diff", "export", "import", "resume-test", "plot")

# Runs the real entry point for every help page in one process, then reports which heavy
# modules those pages imported.
_HELP_PAGES = """
import json, sys
from unbroken.cli import main
for args in [["--help"]] + [[c, "--help"] for c in sys.argv[1:]]:
    sys.argv = ["unbroken", *args]
    try:
        main()
    except SystemExit as exc:
        assert exc.code == 0, (args, exc.code)
heavy = ("torch", "numpy", "matplotlib", "safetensors")
print(json.dumps(sorted(m for m in heavy if m in sys.modules)), file=sys.stderr)
"""


def _help(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "unbroken.cli", *args, "--help"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "80"},
    )  # fmt: skip


def test_help_pages_import_no_torch():
    """`unbroken --help` (and every command's --help) answers without importing torch:
    the commands import their library modules when they run, not when they register."""
    done = subprocess.run([sys.executable, "-c", _HELP_PAGES, *COMMANDS],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stderr.strip().splitlines()[-1]) == []


@pytest.mark.parametrize("command", [(), *((c,) for c in COMMANDS)])
def test_help_shows_flags_as_flags_and_fits_80_columns(command):
    """Boolean options (--json, --all, --full, --help) show no `<bool>` value, arguments
    show their names (A B, DIR), and every help line fits an 80-column terminal."""
    done = _help(*command)
    assert done.returncode == 0, done.stderr
    assert "<bool>" not in done.stdout
    assert "{" not in done.stdout.splitlines()[1]  # the usage line: `DIR`, not `{path}`
    assert max(len(line) for line in done.stdout.splitlines()) <= 80


def test_help_usage_lines():
    """The resume-test usage line shows where the training command goes (`-- CMD ...`);
    diff names its two checkpoints; help paragraphs are re-wrapped to the terminal, not
    broken where the source text was."""
    usage = _help("resume-test").stdout.splitlines()[1]
    assert "unbroken resume-test [OPTIONS] -- CMD ..." in usage
    assert "unbroken diff [OPTIONS] A B" in _help("diff").stdout
    verify = _help("verify").stdout
    assert "checksum and structure; every listed file present" in " ".join(verify.split())
    assert not any(line.strip() in ("at its", "K).", "to") for line in verify.splitlines())


def _console80(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "unbroken.cli", *map(str, args)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "80"},
    )  # fmt: skip


def test_inspect_listing_is_readable_at_80_columns(single_run):
    """At 80 columns the checkpoint listing keeps each date and each lineage whole on one
    line (versions, the same for every step, are said once under the table)."""
    done = _console80("inspect", single_run)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    rows = [line for line in lines if re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", line)]
    assert len(rows) == 2 and all("start (ws 1)" in row for row in rows)
    assert any(line.startswith("saved with torch ") for line in lines)


def test_plot_json(single_run, tmp_path):
    """`unbroken plot DIR --json` (every read command takes --json): the PNG written, the
    metrics plotted and the resumes, as JSON on stdout."""
    done = _console80("plot", single_run, "--out", tmp_path / "m.png", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "path": str(tmp_path / "m.png"), "metrics": ["loss"], "steps": 4, "resumes": [],
    }  # fmt: skip
    assert (tmp_path / "m.png").stat().st_size > 5_000
