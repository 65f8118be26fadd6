"""The benchmark script still runs (a tiny state, one run): it must not rot. No timings
are asserted; the tables just have to be printed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
BENCH = Path(__file__).parents[2] / "benchmarks" / "save_restore.py"


def test_benchmark_quick_smoke(tmp_path):
    """It measures and prints the tables and every missed target with the analysis that
    explains it (or "not analysed yet"); --render prints the same report from the figures
    --results kept, without measuring."""
    figures = tmp_path / "figures.json"
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--parts", "single", "--tmpdir", str(tmp_path),
         "--results", str(figures)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "(d) ours: save (sync, verified)" in done.stdout
    assert "(d) ours: restore, fresh objects" in done.stdout
    report = done.stdout[done.stdout.index("Targets (issue 15):") :]
    missed = [line for line in report.splitlines() if "| missed by" in line]
    if missed:
        listed = report[report.index("Missed in this run") :]
        assert all(("Why: *" in x or "Why: not analysed yet" in x) for x in
                   listed.splitlines()[2:2 + len(missed)]), listed  # fmt: skip
    else:
        assert "Every target was met in this run." in report
    again = subprocess.run(
        [sys.executable, str(BENCH), "--render", str(figures)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert again.stdout.strip().endswith(report.strip()), again.stdout[-2000:]


def test_health_check_benchmark_quick_smoke():
    """benchmarks/health_check.py --quick still measures and prints its tables."""
    done = subprocess.run(
        [sys.executable, str(BENCH.with_name("health_check.py")), "--quick", "--scripts", "mlp"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "metric check: alarms / cut points" in done.stdout
    assert "full check via Checkpointer: caught" in done.stdout


def test_peers_benchmark_quick_smoke(tmp_path):
    """benchmarks/save_restore.py --parts peers --quick measures every contender and prints
    both tables; ours and DCP restore exactly (torch-checkpointing's rows may be dashes where
    it is not installed: it is a bench extra, not a test dependency)."""
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--parts", "peers", "--tmpdir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    out = done.stdout
    assert "| ours: save (sync, verified)" in out
    assert "restore (fresh process, fresh objects)" in out
    for row in ("ours: restore()", "DCP load + set_state_dict", "torch.load + load_state_dict"):
        line = next(x for x in out.splitlines() if x.startswith(f"| {row} "))
        assert line.rstrip(" |").endswith("exact"), line
    assert "Where ours is behind" in out


def test_async_store_and_frozen_parts_quick_smoke(tmp_path):
    """The parts async, store and frozen still measure and print their sections; --render
    prints the same sections again from the figures --results kept."""
    figures, page = tmp_path / "figures.json", tmp_path / "page.md"
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--parts", "async", "store", "frozen",
         "--tmpdir", str(tmp_path), "--results", str(figures)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for row in ("| `False`", "| `'overlap'`", "| one copy into preallocated memory",
                "| save: S3 (moto, loopback)", "| restore: local disk", '| `frozen="verify"`',
                "| floor: its bytes written, fsynced"):  # fmt: skip
        assert row in done.stdout, row
    rendered = subprocess.run(
        [sys.executable, str(BENCH), "--render", str(figures)],
        capture_output=True, text=True, timeout=120, check=False,
    ).stdout  # fmt: skip
    assert rendered.strip() == done.stdout.strip(), rendered[-2000:]
    again = subprocess.run(
        [sys.executable, str(BENCH), "--render", str(figures), "--write-docs", str(page)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert again.stdout.count("wrote ") == 3, again.stdout[-2000:]
    text = page.read_text()
    assert "<!-- async:start -->" in text and "<!-- object-store:end -->" in text, text[:2000]
    assert "<!-- frozen-benchmark:start -->" in text, text[:2000]


def test_tiers_part_quick_smoke(tmp_path):
    """The part tiers (two torchrun agents, a local tier each) still measures and prints
    its rows; each resume restored from where it should, verified, bit for bit (else the
    worker fails); --write-docs puts the section between the page's markers, keeping what
    is around them. (--quick leaves DCP's resume out, for time.)"""
    figures, page = tmp_path / "figures.json", tmp_path / "tiers.md"
    page.write_text("# The local tier\n\nby hand\n")
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--parts", "tiers", "--tmpdir", str(tmp_path),
         "--results", str(figures), "--write-docs", str(page)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for row in ('| local, async_save="overlap"', "| local, sync", "| persistent, async_save=",
                "| ours: local tier (each", "| ours: local tier, node 1's folder lost",
                "| ours: persistent folder, cold", "| one copy in memory", "| TCP on 127.0.0.1",
                "| cold read of the persistent", "| local overlap save blocked <= 2 ms/GB"):  # fmt: skip
        assert row in done.stdout, row
    assert set(json.loads(figures.read_text())["tiers"]["resumes"]["peer"]) >= {
        "restore",
        "first_step",
        "read_verify",
    }
    text = page.read_text()
    assert text.startswith("# The local tier\n\nby hand\n"), text[:500]
    assert "<!-- tiers-benchmark:start -->\n## Benchmark" in text, text[:2000]
    assert text.rstrip().endswith("<!-- tiers-benchmark:end -->"), text[-500:]
