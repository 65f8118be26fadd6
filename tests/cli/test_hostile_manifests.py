"""Hostile manifests (issue 12, item 2): every read command exits 0, 1 or 2, no traceback.

A manifest mutated (``tests/manifest_fuzz.py``) and re-sealed (``tests/tamper.py``) is
either refused as damaged (exit 1, the reason on stderr or in the report) or, when the
mutation left a valid manifest, read as usual; a command never dies with a traceback.
"""

from __future__ import annotations

import os
import random
import shutil
import traceback

import pytest

import manifest_fuzz as fuzz
import tamper
from conftest import Problem
from unbroken.errors import CheckpointError
from unbroken.format import manifest

from .conftest import run_cli

CASES = int(os.environ.get("UNBROKEN_FUZZ_CASES", "20"))  # seed fixed; see reliability.md
SEED = 1212


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile-cli") / "run"
    p = Problem()
    ckpt = p.checkpointer(root, probe=lambda m: m.inp.weight.sum(), keep_last=None)
    for step in (1, 2):
        ckpt.track(step, loss=p.step())
        ckpt.save(step)
    ckpt.close()
    return root


def _commands(run, other, out):
    return [
        ("inspect", run),
        ("inspect", run, "--step", 2),
        ("inspect", run, "--json"),
        ("verify", run),
        ("diff", run / "step_00000002", other),
        ("export", run, "--to", out),
    ]


def test_read_commands_never_crash_on_fuzzed_manifests(pristine, tmp_path):
    """Fuzz: 20 seeded mutations of a real manifest, re-sealed; inspect (list, detail,
    JSON), verify, diff and export each exit 0, 1 or 2 without a traceback, and each
    exits 1 on a manifest the library refuses."""
    run = tmp_path / "run"
    shutil.copytree(pristine, run)
    doc = tamper.read(pristine / "step_00000002")
    rng = random.Random(SEED)
    refused = 0
    for i in range(CASES):
        what, hostile = fuzz.mutated(doc, rng)
        tamper.write(run / "step_00000002", hostile)
        try:
            manifest.read(run / "step_00000002")
            damaged = False
        except CheckpointError:
            damaged = True
        except Exception:
            pytest.fail(f"case {i} ({what}): manifest.read:\n{traceback.format_exc()}")
        refused += damaged
        for args in _commands(run, pristine / "step_00000001", tmp_path / "out.safetensors"):
            try:
                result = run_cli(*args)
            except Exception:
                pytest.fail(f"case {i} ({what}): unbroken {args[0]}:\n{traceback.format_exc()}")
            assert result.exit_code in (0, 1, 2), (i, what, args, result.stderr)
            assert "Traceback" not in result.stdout + result.stderr, (i, what, args)
            if damaged:
                assert result.exit_code == 1, (i, what, args, result.stdout, result.stderr)
    assert refused > CASES // 2
