"""Checkpoints made once per session for the CLI tests, and helpers to run commands."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import Problem
from distributed import launcher, models

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: object):
    """Run a command in-process; returns the click Result (stdout/stderr separate)."""
    from unbroken.cli import app

    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def run_json(*args: object, code: int = 0):
    result = run_cli(*args, "--json")
    assert result.exit_code == code, result.stdout + result.stderr
    return json.loads(result.stdout)


def flip_bit(path: Path, at: int) -> None:
    """Flip the lowest bit of byte ``at`` of the file ``path`` (damage a checksum sees)."""
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def tree_digest(root: Path) -> dict[str, str]:
    """Every file and folder under ``root`` with the hash of its bytes."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = "dir"
        for f in filenames:
            path = os.path.join(dirpath, f)
            out[os.path.relpath(path, root)] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return out


@pytest.fixture(scope="session")
def single_run(tmp_path_factory) -> Path:
    """A single-process run with checkpoints at steps 2 and 4."""
    root = tmp_path_factory.mktemp("single") / "run"
    p = Problem()
    ckpt = p.checkpointer(root)
    for step in range(1, 5):
        p.step()
        ckpt.track(step, loss=0.5)
        if step % 2 == 0:
            ckpt.save(step)
    ckpt.close()
    return root


@pytest.fixture
def run(single_run, tmp_path) -> Path:
    """A copy of :func:`single_run` that a test may damage."""
    copy = tmp_path / "run"
    shutil.copytree(single_run, copy)
    return copy


@pytest.fixture(scope="session")
def fsdp_run(tmp_path_factory) -> tuple[Path, dict]:
    """A 2-rank FSDP2 checkpoint of step 3, and its gathered model/optimizer state."""
    root = tmp_path_factory.mktemp("fsdp") / "run"
    full = launcher.run(models.save_trained_fsdp, 2, str(root))[0]
    return root, full


@pytest.fixture(scope="session")
def fsdp_resaved(fsdp_run, tmp_path_factory) -> Path:
    """The FSDP2 checkpoint restored into one plain process and saved again."""
    import unbroken as ub

    root = tmp_path_factory.mktemp("resaved") / "run"
    model, opt = models.build(seed=123)
    ub.Checkpointer(fsdp_run[0], model=model, optimizer=opt).restore(reset={"rng"})
    ub.Checkpointer(root, model=model, optimizer=opt).save(3)
    return root
