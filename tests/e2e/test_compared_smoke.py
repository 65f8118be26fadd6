"""``benchmarks/compared.py``: Accelerate resumed both ways at a tiny size, the page it
writes, and the committed docs/integrations/compared.md being that script's output.

One quick run (``--quick --only accelerate --no-variants``: 6 training processes) is
shared by the first two tests. No timings are asserted.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "compared.py"
PAGE = ROOT / "docs" / "integrations" / "compared.md"
MARKER = "<!-- written by benchmarks/compared.py --write-docs"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, str(BENCH), *args],
        capture_output=True, text=True, timeout=timeout, env=ENV, cwd=ROOT, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _rows(text: str, framework: str) -> dict[str, list[str]]:
    """The summary table's rows of ``framework``, by their resume cell: the cells after."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if "| tensors differing |" in line)
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("| "):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == framework:
            rows[cells[1]] = cells[2:]
    return rows


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> tuple[str, Path]:
    tmp = tmp_path_factory.mktemp("compared")
    page = tmp / "compared.md"
    done = _bench("--quick", "--only", "accelerate", "--no-variants", "--workdir",
                  str(tmp / "runs"), "--write-docs", str(page))  # fmt: skip
    return done.stdout, page


def test_ours_is_identical_and_accelerates_own_resume_is_not(quick):
    """Our resume: every tensor, logged loss and input the same as the straight run's.
    Accelerate's own (load_state + skip_first_batches) DIFFERENT, from the first step
    after the stop at 6 (other batches): the comparison can fail, so a harness that
    compared a run with itself, or read the wrong files, would not pass."""
    stdout, _ = quick
    assert "| framework " in stdout and "tensors differing" in stdout, stdout[-2000:]
    rows = _rows(stdout, "Accelerate")
    tensors, loss, inputs, losses, verdict = rows["unbroken"][:5]
    assert (tensors, loss, inputs, losses, verdict) == ("0 of 16", "-", "-", "0 of 10",
                                                        "IDENTICAL"), rows  # fmt: skip
    tensors, loss, inputs, _, verdict = rows["own"][:5]
    assert verdict == "DIFFERENT" and loss == "7" and inputs == "7", rows
    assert not tensors.startswith("0 of"), rows


def test_write_docs_writes_the_page(quick):
    """--write-docs PATH writes the whole page there: marker, table, the why of each own
    row with places in the installed sources, and the results it renders from."""
    _, page = quick
    text = page.read_text(encoding="utf-8")
    assert text.startswith("# ") and MARKER in text
    assert set(_rows(text, "Accelerate")) == {"own", "unbroken"}
    assert "accelerate/checkpointing.py:" in text and "(line not found)" not in text
    assert "<!-- compared.py results" in text


def test_the_committed_page_is_the_scripts_output(tmp_path):
    """docs/integrations/compared.md shows every framework, ours IDENTICAL in every
    row, and is exactly what the script renders from the results kept in it: a hand edit,
    or a page left behind when the renderer changed, fails here."""
    text = PAGE.read_text(encoding="utf-8")
    assert MARKER in text
    for framework in ("Accelerate", "Lightning", "HF Trainer", "DeepSpeed", "Megatron-Core"):
        rows = _rows(text, framework)
        assert "own" in rows and "unbroken" in rows, (framework, rows)
        ours = [cells for resume, cells in rows.items() if resume.startswith("unbroken")]
        assert all(cells[4] == "IDENTICAL" for cells in ours), (framework, ours)
    again = tmp_path / "compared.md"
    _bench("--render", str(PAGE), "--write-docs", str(again), timeout=120)
    assert again.read_text(encoding="utf-8") == text


def test_only_write_docs_merges_into_the_kept_page(monkeypatch):
    """``--only NAME --write-docs`` replaces NAME's rows of the page's kept results and
    keeps the others (no DESIGN.md bug class: the page's bookkeeping). A rerun is listed
    once, the page stays complete, and results of another size are refused, not mixed."""
    monkeypatch.syspath_prepend(str(BENCH.parent))
    import compared

    kept = compared.Results.read(PAGE)
    new_rows = [dataclasses.replace(r, steps_differing=r.steps_differing + 1)
                for r in kept.rows if r.framework == "megatron"]  # fmt: skip
    assert new_rows, "the committed page has no Megatron-Core rows"
    new = dataclasses.replace(kept, command="python benchmarks/compared.py --only megatron "
                              "--write-docs", seconds=60.0, rows=new_rows, reruns=[])  # fmt: skip
    merged = compared.merge(kept, new)
    assert [r for r in merged.rows if r.framework != "megatron"] == [
        r for r in kept.rows if r.framework != "megatron"
    ]
    assert [r for r in merged.rows if r.framework == "megatron"] == new_rows
    assert [r.framework for r in merged.rows] == [r.framework for r in kept.rows]
    assert compared.complete(merged)
    again = compared.merge(merged, new)
    assert [r["frameworks"] for r in again.reruns] == [
        *[r["frameworks"] for r in kept.reruns if r["frameworks"] != ["megatron"]],
        ["megatron"],
    ]
    assert "the Megatron-Core rows since by `python benchmarks/compared.py --only megatron" in (
        compared.page(again)
    )
    with pytest.raises(ValueError, match="another size"):
        compared.merge(kept, dataclasses.replace(new, size={**new.size, "steps": 1}))
