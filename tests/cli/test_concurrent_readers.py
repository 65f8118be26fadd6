"""`unbroken verify` and `inspect` while the training job saves and prunes: a step that
vanishes while a command reads it is listed again, never reported as damage.

The job acts at a chosen instant (inside the first manifest read of the command), so
the interleaving is the same on every run.
"""

from __future__ import annotations

import pytest

from cli.conftest import run_cli
from conftest import Problem
from unbroken.format import manifest
from unbroken.storage.locate import checkpoint_dir
from unbroken.storage.names import folder_step


def _job(root, steps, keep_last):
    p = Problem()
    ckpt = p.checkpointer(root, keep_last=keep_last)
    for s in steps:
        p.step()
        ckpt.save(s)
    return p, ckpt


def _on_first_manifest_read(monkeypatch, act) -> list:
    """Run ``act(folder)`` once, when the command first reads a manifest."""
    real, seen = manifest.read, []

    def read(folder, *args, **kwargs):
        if not seen:
            seen.append(folder)
            act(folder)
        return real(folder, *args, **kwargs)

    monkeypatch.setattr(manifest, "read", read)
    return seen


@pytest.mark.parametrize("every", [False, True], ids=["latest", "--all"])
def test_verify_while_the_job_prunes_the_step_being_read(tmp_path, monkeypatch, every):
    """Case: `unbroken verify DIR` (the latest step) and `verify DIR --all` while the job
    commits a newer step and retention deletes the one being verified: exit 0, every
    step committed at the end verified, no 'missing' failure and no traceback."""
    root = tmp_path / "run"
    p, ckpt = _job(root, [1, 2], keep_last=1 if not every else 2)

    def save_and_prune(folder) -> None:
        p.step()
        ckpt.save(3)  # keep_last prunes the oldest: the one being verified

    seen = _on_first_manifest_read(monkeypatch, save_and_prune)
    args = ["verify", root, *(["--all"] if every else [])]
    result = run_cli(*args)
    assert result.exit_code == 0, result.stdout + result.stderr
    assert not checkpoint_dir(root).step_path(folder_step(seen[0])).exists()
    verified = [line.split()[2] for line in result.stdout.splitlines() if line.startswith("OK")]
    assert verified == (["3"] if not every else ["2", "3"]), result.stdout
    ckpt.close()


def test_inspect_while_the_job_prunes_a_listed_step(tmp_path, monkeypatch):
    """Case: `unbroken inspect DIR` while retention deletes a step it has listed: exit 0,
    the step is not shown as DAMAGED, and no traceback."""
    root = tmp_path / "run"
    _, ckpt = _job(root, [1, 2, 3], keep_last=None)
    _on_first_manifest_read(monkeypatch, lambda folder: checkpoint_dir(root).remove(1))
    result = run_cli("inspect", root)
    assert result.exit_code == 0, result.stdout + result.stderr
    assert "DAMAGED" not in result.stdout, result.stdout
    ckpt.close()
