"""benchmarks/gpu.py --quick still runs on the CPU (a tiny state): it must not rot. No
timings are asserted; every contender's rows and the floors have to be in the table, and
``--write`` has to put the page where it is told."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
BENCH = Path(__file__).parents[2] / "benchmarks" / "gpu.py"
NUMBER = re.compile(r"^\d+\.\d{4}$")

FLOORS = ["floor: pageable D2H copy", "floor: write + fsync", "floor: warm read",
          "floor: cold read"]  # fmt: skip
PINNED = ["floor: pinned D2H copy", "floor: pinned H2D copy"]
OURS = ["ours: save, sync, until durable", "ours: async_save=True, blocked",
        "ours: async_save=True, until durable", 'ours: "overlap", first save, blocked',
        'ours: "overlap", blocked', 'ours: "overlap", until durable',
        "ours: restore into the live objects, warm", "ours: restore into the live objects, cold"]  # fmt: skip
DCP = ["DCP: dcp.save + fsync pass, until durable", "DCP: dcp.async_save (defaults), blocked",
       "DCP: dcp.async_save + fsync pass, until durable", "DCP: dcp.load + set_state_dict, warm",
       "DCP: dcp.load + set_state_dict, cold"]  # fmt: skip
TORCH = ["torch.save + fsync, until durable", "torch.load (map_location the device) + "
         "load_state_dict, warm", "torch.load (map_location the device) + load_state_dict, cold"]  # fmt: skip
TC = ["torch-checkpointing: sync save + fsync pass, until durable",
      "torch-checkpointing: async save, blocked",
      "torch-checkpointing: async save + fsync pass, until durable",
      "torch-checkpointing: load + load_state_dict, warm",
      "torch-checkpointing: load + load_state_dict, cold"]  # fmt: skip


def run(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick", *args],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


def median_cell(out: str, label: str) -> str:
    """The median cell of the table row whose label starts with ``label``."""
    rows = [x for x in out.splitlines() if x.startswith(f"| {label}")]
    assert len(rows) == 1, (label, rows)
    return rows[0].split("|")[2].strip()


def test_gpu_benchmark_quick_smoke(tmp_path):
    """Every installed contender's rows hold a figure; torch-checkpointing's say "not
    installed" where it is not (a bench extra, not a test dependency); the pinned floors
    are n/a on the CPU."""
    out = run("--tmpdir", str(tmp_path))
    for label in FLOORS + OURS + DCP + TORCH:
        assert NUMBER.match(median_cell(out, label)), (label, median_cell(out, label))
    for label in PINNED:
        assert median_cell(out, label).startswith("n/a"), label
    installed = importlib.util.find_spec("torch_checkpointing") is not None
    for label in TC:
        cell = median_cell(out, label)
        assert NUMBER.match(cell) if installed else cell == "not installed", (label, cell)
    assert "(verified: 4 of 4 restores)" in out
    assert "## Targets (issue 27)" in out
    assert "| ours: sync save until durable vs its floor" in out
    assert list(tmp_path.iterdir()) == []  # its checkpoints are gone


def test_gpu_benchmark_writes_the_page(tmp_path):
    """``--write PATH`` puts the whole page there: the machine, the revision, the table."""
    page = tmp_path / "page.md"
    out = run("--runs", "1", "--tmpdir", str(tmp_path), "--write", str(page))
    text = page.read_text()
    assert text.startswith("# Save and restore on one GPU")
    assert "## Machine" in text and "- cpu: " in text and "- memory: " in text
    head = subprocess.run(
        ["git", "-C", str(BENCH.parent), "rev-parse", "--short", "HEAD"],
        capture_output=True, text=True, check=False,
    ).stdout.strip()  # fmt: skip
    assert re.search(r"- unbroken: .*, revision \S+", text), text[:2000]
    if head:
        assert f"revision {head}" in text
    assert "| ours: save, sync, until durable" in text
    assert "| DCP: dcp.save + fsync pass, until durable" in text
    assert "## Targets (issue 27)" in text
    assert f"wrote {page}" in out
