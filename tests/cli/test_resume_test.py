"""``unbroken resume-test`` and ``unbroken plot``, run as real commands."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import Problem

TINY = Path(__file__).parents[1] / "e2e" / "scripts" / "tiny_train.py"
CASES = Path(__file__).parents[1] / "e2e" / "scripts" / "resume_cases.py"


def _unbroken(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "unbroken.cli", *map(str, args)],
        capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})},
    )  # fmt: skip


def test_resume_test_passes_then_plot_shows_the_resume(tmp_path):
    work = tmp_path / "work"
    done = _unbroken("resume-test", "--stop-at", "13", "--workdir", work, "--json",
                     "--parallel", "--", sys.executable, TINY, "{dir}", "--steps", "25")  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["passed"] and result["compared_steps"] == 12
    assert (work / "resume-test.png").stat().st_size > 10_000
    plotted = _unbroken("plot", work / "resumed", "--out", tmp_path / "m.png")
    assert plotted.returncode == 0, plotted.stderr
    assert "1 resume(s)" in plotted.stdout and (tmp_path / "m.png").stat().st_size > 10_000


def test_resume_test_fails_on_a_lost_optimizer_naming_the_step(tmp_path):
    done = _unbroken("resume-test", "--stop-at", "13", "--workdir", tmp_path / "w",
                     "--parallel", "--", sys.executable, TINY, "{dir}", "--steps", "25",
                     env={"TINY_BUG": "optimizer"})  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "DIFFERENT" in done.stdout and "first difference: step 15" in done.stdout
    assert "DIFFERENT" in (tmp_path / "w" / "resume-test-report.txt").read_text()


def test_resume_test_from_the_local_tier(tmp_path):
    """--tier local: the stop's save goes to the script's local tier, the resume restores
    it from there (the persistent folder never holds the stop step), exact."""
    done = _unbroken("resume-test", "--stop-at", "13", "--workdir", tmp_path / "w", "--json",
                     "--tier", "local", "--", sys.executable, TINY, "{dir}", "--steps", "25",
                     env={"TINY_LOCAL": str(tmp_path / "shm")})  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout)
    assert result["passed"] and result["resumed_from"] == [13], result
    lineage = json.loads((tmp_path / "w" / "resumed" / "step_00000020" / "manifest.json")
                         .read_text())["lineage"]  # fmt: skip
    assert [(e["from_step"], e["tier"]) for e in lineage if e["event"] == "resume"] == [
        (13, "local")
    ]
    assert not (tmp_path / "w" / "resumed" / "step_00000013").exists()


def test_resume_test_from_the_local_tier_needs_one(tmp_path):
    """--tier local on a script without a local tier: the stop's save says what to do."""
    done = _unbroken("resume-test", "--stop-at", "13", "--workdir", tmp_path / "w",
                     "--tier", "local", "--", sys.executable, TINY, "{dir}", "--steps", "25")  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "has none: pass local=ub.LocalTier(...)" in done.stdout + done.stderr


def test_resume_test_is_not_resumed_when_the_script_starts_fresh(tmp_path):
    """A Checkpointer with overwrite=True starts fresh at every launch: its metrics are
    the straight run's, but it never restored step 8. NOT RESUMED, exit 1."""
    done = _unbroken("resume-test", "--stop-at", "8", "--workdir", tmp_path / "w",
                     "--parallel", "--", sys.executable, CASES, "{dir}", "--steps", "12",
                     "--overwrite")  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert done.stdout.startswith("resume test: NOT RESUMED (stopped at step 8, ")
    assert "not resumed: the resumed run (meant to continue from step 8) started fresh: " \
           "its checkpoint of step 12 has no resume in its lineage" in done.stdout  # fmt: skip
    assert "first difference" not in done.stdout  # the metrics alone could not tell


def test_resume_test_compares_the_non_tensor_state(tmp_path):
    """An extra whose counter is not restored: metrics and tensors identical, the saved
    counter not. DIFFERENT, exit 1, the value and the cause named (--json: new keys)."""
    done = _unbroken("resume-test", "--stop-at", "8", "--workdir", tmp_path / "w", "--json",
                     "--parallel", "--", sys.executable, CASES, "{dir}", "--steps", "12",
                     "--lost-counter")  # fmt: skip
    assert done.returncode == 1, done.stderr
    result = json.loads(done.stdout)
    assert result["verdict"] == "DIFFERENT" and not result["passed"] and result["resumed"]
    assert result["first_difference"] is None
    assert result["state_differences"] == ["progress/samples: 192 vs 64"]
    assert result["cause"].startswith(
        "the checkpoints are identical at step 8, where the run stopped, and differ at step "
        "12, after the 1st resume, from step 8: the resume lost or changed something; the "
        "saved state differs in progress (progress/samples: 192 vs 64)"
    ), result["cause"]


def test_resume_test_tells_an_unseeded_script_to_seed(tmp_path):
    """Issue 36, item 10: a script that never seeds torch (torch 2.13 starts its generator
    from OS entropy in every process) differs from step 1. The cause line said "the
    training itself is not deterministic" and the RNG note that torch starts from a fixed
    seed; now it says the script is not seeded and how to seed it, per framework."""
    done = _unbroken("resume-test", "--stop-at", "8", "--workdir", tmp_path / "w",
                     "--parallel", "--", sys.executable, CASES, "{dir}", "--steps", "12",
                     "--unseeded")  # fmt: skip
    assert done.returncode == 1, done.stderr
    (cause,) = [line for line in done.stdout.splitlines() if line.startswith("  cause: ")]
    assert "before any resume: the script is not seeded" in cause, cause
    assert "differ already in the checkpoints of step 4, saved before any resume" in cause
    for call in ("torch.manual_seed(0)", "lightning.seed_everything(0)",
                 "transformers.set_seed(0)", "accelerate.utils.set_seed(0)"):  # fmt: skip
        assert call in cause, call
    assert "fixed seed" not in done.stdout and "not deterministic" not in cause


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--stop-at", "3", "--", "python", "train.py"], "must contain {dir}"),
     (["--stop-at", "3"], "after --"),
     (["--stop-at", "20,10", "--", "python", "train.py", "{dir}"], "increasing steps"),
     (["--stop-at", "0", "--", "python", "train.py", "{dir}"], "a step >= 1")],
)  # fmt: skip
def test_resume_test_usage_errors(args, message):
    done = _unbroken("resume-test", *args)
    assert done.returncode == 2 and message in done.stderr


def test_plot_without_metrics_is_a_usage_error(tmp_path):
    done = _unbroken("plot", tmp_path)
    assert done.returncode == 2 and "metrics.jsonl" in done.stderr


def _without_matplotlib(tmp_path: Path) -> dict[str, str]:
    """An environment whose `import matplotlib` fails, as after `pip install unbroken`."""
    fake = tmp_path / "no-matplotlib" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    path = os.pathsep.join(p for p in (str(fake.parent), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path}


def test_resume_test_without_matplotlib_gives_the_verdict(tmp_path):
    """No matplotlib (no [plot] extra): all three runs, the verdict and the report as
    usual, no plot, and one line saying why."""
    work = tmp_path / "work"
    done = _unbroken("resume-test", "--stop-at", "13", "--workdir", work, "--parallel",
                     "--", sys.executable, TINY, "{dir}", "--steps", "25",
                     env=_without_matplotlib(tmp_path))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "IDENTICAL" in done.stdout and "Traceback" not in done.stderr
    mentions = [line for line in done.stdout.splitlines() if "matplotlib" in line]
    assert mentions == ["  note: no plot: plots need matplotlib, which is not installed: "
                        "pip install 'unbroken[plot]'"]  # fmt: skip
    assert not (work / "resume-test.png").exists()
    assert "IDENTICAL" in (work / "resume-test-report.txt").read_text()
    assert json.loads((work / "resume-test.json").read_text())["plot_path"] == ""


def test_plot_without_matplotlib_is_a_one_line_usage_error(single_run, tmp_path):
    """`unbroken plot` without matplotlib: one line naming the fix, exit 2, no file."""
    done = _unbroken("plot", single_run, "--out", tmp_path / "m.png",
                     env=_without_matplotlib(tmp_path))  # fmt: skip
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        "ImportError: plots need matplotlib, which is not installed: pip install 'unbroken[plot]'"
    ]
    assert not (tmp_path / "m.png").exists()


def _svg_text(tmp_path: Path) -> dict[str, str]:
    """matplotlib writes SVG text as text (not paths), so a test can read the labels."""
    rc = tmp_path / "matplotlibrc"
    rc.write_text("svg.fonttype: none\n")
    return {"MATPLOTLIBRC": str(rc)}


def test_plot_labels_each_resume_with_its_step(tmp_path):
    """`unbroken plot`: each resume line carries its step as a label."""
    run = tmp_path / "run"
    for start, stop in ((0, 3), (3, 7)):  # trained to 3, then resumed from 3 to 7
        p = Problem()
        ckpt = p.checkpointer(run)
        assert ckpt.restore().step == start
        for step in range(start + 1, stop + 1):
            ckpt.track(step, loss=p.step())
        ckpt.save(stop)
        ckpt.close()
    done = _unbroken("plot", run, "--out", tmp_path / "m.svg", env=_svg_text(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "1 resume(s)" in done.stdout
    assert "resumed from 3" in (tmp_path / "m.svg").read_text()


RAISES_ON_RANK_1 = """
import os, sys
print("rank", os.environ["RANK"], "starting", flush=True)
if os.environ["RANK"] == "1":
    raise ValueError("rank 1 cannot go on: batch of shape (3, 5)\\nexpected (4, 5)")
"""


@pytest.mark.parametrize("tee", [False, True], ids=["plain", "tee"])
def test_a_failing_torchrun_rank_shows_its_exception(tmp_path, tee):
    """A run under torchrun fails on rank 1: the error shows rank 1's exception (both lines
    of its message), read from the log, with or without torchrun's `[default1]:` line
    prefixes, and not torchrun's ChildFailedError report."""
    script = tmp_path / "train.py"
    script.write_text(RAISES_ON_RANK_1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_port", port, *(["--tee", "3"] if tee else []), script, "{dir}"]  # fmt: skip
    done = _unbroken("resume-test", "--stop-at", "2", "--workdir", tmp_path / "w", "--", *torchrun)
    assert done.returncode == 1
    err = done.stderr
    assert "rank 1 raised:" in err if tee else "rank 1 failed first" in err, err
    assert "  ValueError: rank 1 cannot go on: batch of shape (3, 5)\n  expected (4, 5)\n" in err
    assert "ChildFailedError" not in err and "Root Cause" not in err
    assert f"full log: {tmp_path / 'w' / 'straight.log'}" in err
