"""A reader racing a writer that prunes with ``keep_last=1`` sees the new step or the old
one, never none (issue 36, item 16 (c)). The writer's save is injected between the
reader's listing and its reading of what it listed, so the race is met every time.
"""

from __future__ import annotations

import uuid

import torch

import unbroken as ub
from unbroken.storage import local_medium
from unbroken.tools import verification


def _pruning_writer(url: str) -> tuple[ub.Checkpointer, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    ckpt = ub.Checkpointer(url, model=model, keep_last=1)
    ckpt.restore()
    ckpt.save(1)
    return ckpt, model


def _save_next(ckpt: ub.Checkpointer, model: torch.nn.Module) -> None:
    """Step 2 committed, then step 1 pruned (keep_last=1)."""
    with torch.no_grad():
        model.weight.add_(1)
    ckpt.save(2)


def test_verify_sees_the_new_step_when_the_listed_one_is_pruned_before_it_is_looked_at(
    tmp_path, monkeypatch
):
    """Item 16 (c), on a disk: the listing named step_00000001, the writer committed step
    2 and pruned step 1 before the reader looked at step 1's manifest; the reader's
    listing held no step and `unbroken verify` said "holds no committed checkpoint"
    (exit 2). Now the folder is listed again: step 2 is verified."""
    url = str(tmp_path / "run")
    ckpt, model = _pruning_writer(url)
    real, fired = local_medium._manifest_mark, []

    def racing(folder):
        if not fired and folder.name == "step_00000001":
            fired.append(True)
            _save_next(ckpt, model)
        return real(folder)

    monkeypatch.setattr(local_medium, "_manifest_mark", racing)
    report = ub.verify_checkpoint(url)
    assert fired, "the injected save never ran"
    assert report.ok and [c.step for c in report.checkpoints] == [2], report
    ckpt.close()


def test_verify_lists_again_when_the_latest_step_is_pruned_after_the_listing(monkeypatch):
    """Item 16 (c), on a store (memory://): the latest step listed was pruned before the
    reader asked whether it is committed; the reader was left with no committed folder
    (an IndexError). Now it lists again and verifies the new step."""
    url = f"memory://ub-prune/{uuid.uuid4().hex[:8]}/run"
    ckpt, model = _pruning_writer(url)
    real, fired = verification.step_folders, []

    def racing(path, **kw):
        found = real(path, **kw)
        if not fired:
            fired.append(True)
            _save_next(ckpt, model)
        return found

    monkeypatch.setattr(verification, "step_folders", racing)
    report = ub.verify_checkpoint(url)
    assert fired, "the injected save never ran"
    assert report.ok and [c.step for c in report.checkpoints] == [2], report
    ckpt.close()
