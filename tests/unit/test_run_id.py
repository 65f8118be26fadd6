"""``Checkpointer.run_id``: one id per run, across resumes, forks, resets and ranks (issue 30,
item 8).

Bug class: a run whose identity changes at each resume (a new W&B run per relaunch, a
dashboard that splits one training into pieces), ranks that each mint their own id
(rank 1 names a run rank 0 never wrote), an old checkpoint without an id that fails to
restore or gets a new id each time, and a hostile id in a manifest reaching a tracker or
a path (``../``, a newline) instead of being refused as damage.
"""

from __future__ import annotations

import pytest

import tamper
import unbroken as ub
from conftest import Problem, save_steps
from distributed import launcher
from unbroken.format import manifest
from unbroken.format.schema import RUN_ID


def _saved_run(folder, step) -> str:
    return manifest.read(folder / f"step_{step:08d}")["lineage"][0]["run"]


def _train_and_save(p: Problem, ckpt, *steps: int) -> None:
    for step in steps:
        ckpt.track(step, loss=p.step())
        ckpt.save(step)


def test_a_fresh_run_gets_an_id_at_restore_and_every_checkpoint_keeps_it(ckpt_dir):
    """Before ``restore()`` the id is not decided (a clear error, not a guess that the
    restore would change); a fresh start mints 32 hex digits, which every save records."""
    p = Problem()
    with p.checkpointer(ckpt_dir) as ckpt:
        with pytest.raises(ub.CheckpointError, match=r"decided by restore\(\)"):
            _ = ckpt.run_id
        assert not ckpt.restore().restored
        run_id = ckpt.run_id
        assert RUN_ID.fullmatch(run_id) and len(run_id) == 32
        _train_and_save(p, ckpt, 1, 2)
    assert _saved_run(ckpt_dir, 1) == _saved_run(ckpt_dir, 2) == run_id


def test_resumes_a_rollback_and_a_reset_keep_the_id(ckpt_dir):
    """Restore, a second resume, then ``restore(step=1, reset={"optimizer"})`` (a branch
    that retires steps 2 and 3): one id throughout, in the branch's checkpoint too."""
    p = Problem()
    with p.checkpointer(ckpt_dir, keep_last=None) as ckpt:
        ckpt.restore()
        run_id = ckpt.run_id
        _train_and_save(p, ckpt, 1, 2)
    q = Problem(seed=1)
    with q.checkpointer(ckpt_dir, keep_last=None) as ckpt:
        assert ckpt.restore().step == 2 and ckpt.run_id == run_id
        _train_and_save(q, ckpt, 3)
    with Problem(seed=2).checkpointer(ckpt_dir, keep_last=None) as ckpt:
        assert ckpt.restore().step == 3 and ckpt.run_id == run_id
    r = Problem(seed=3)
    with r.checkpointer(ckpt_dir, keep_last=None) as ckpt:
        report = ckpt.restore(step=1, reset={"optimizer"})
        assert report.components["optimizer"] == "reset" and ckpt.run_id == run_id
        _train_and_save(r, ckpt, 4)
        assert ckpt.steps() == [1, 4]
    assert _saved_run(ckpt_dir, 4) == run_id


def test_without_a_restore_the_first_save_decides_the_id(ckpt_dir):
    p = Problem()
    with p.checkpointer(ckpt_dir) as ckpt:
        with pytest.raises(ub.CheckpointError, match="the first save"):
            _ = ckpt.run_id
        _train_and_save(p, ckpt, 1)
        assert ckpt.run_id == _saved_run(ckpt_dir, 1)


def test_overwrite_starts_a_new_run_with_a_new_id(ckpt_dir):
    p = Problem()
    with p.checkpointer(ckpt_dir) as ckpt:
        ckpt.restore()
        _train_and_save(p, ckpt, 1)
        old = ckpt.run_id
    with Problem(seed=1).checkpointer(ckpt_dir, overwrite=True) as ckpt:
        assert not ckpt.restore().restored and ckpt.run_id != old


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Steps 1 and 2 of one run."""
    root = tmp_path_factory.mktemp("run-id") / "run"
    save_steps(root)
    return root


def _edited(saved, tmp_path, edit):
    return tamper.edited_copy(saved, tmp_path / "run", edit)


def _restored_id(folder, step: int) -> str:
    with Problem(seed=4).checkpointer(folder, keep_last=None) as ckpt:
        assert ckpt.restore(step=step).verified
        return ckpt.run_id


@pytest.mark.parametrize("lineage", ["no-run", "empty"])
def test_an_old_checkpoint_without_an_id_gets_a_stable_one(saved, tmp_path, lineage):
    """A manifest whose lineage records no ``run`` (written before ids existed), or no
    event at all: restored, not refused; the same derived id at every restore, kept by the
    next save (for an empty lineage, in a start event added in front)."""

    def edit(doc):
        if lineage == "empty":
            doc["lineage"] = []
        else:
            del doc["lineage"][0]["run"]

    work = _edited(saved, tmp_path, edit)
    with Problem(seed=3).checkpointer(work, keep_last=None) as ckpt:
        ckpt.restore()
        derived = ckpt.run_id
        ckpt.save(3)
    assert RUN_ID.fullmatch(derived) and derived != _saved_run(saved, 2)
    assert _restored_id(work, 2) == _restored_id(work, 3) == derived
    if lineage == "empty":
        assert _saved_run(work, 3) == derived


HOSTILE = ["../../etc", "a" * 65, "", "abc\n", "wandb:run", "ünï", 5, ["x"]]


@pytest.mark.parametrize("value", HOSTILE, ids=repr)
def test_a_hostile_run_id_is_damage_named_by_its_field(saved, tmp_path, value):
    """A ``run`` that is not 1..64 ASCII letters or digits, sealed into step 2: restoring
    that step raises ``CorruptCheckpointError`` naming ``lineage/0/run``; ``restore()``
    falls back to step 1 with a warning naming it; the id never reaches a tracker."""
    work = _edited(saved, tmp_path, lambda doc: doc["lineage"][0].update(run=value))
    refused = pytest.raises(ub.CorruptCheckpointError, match=r"lineage/0/run: .* not a run id")
    with Problem(seed=3).checkpointer(work) as ckpt, refused:
        ckpt.restore(step=2)
    with Problem(seed=3).checkpointer(work) as ckpt:
        report = ckpt.restore()
        assert report.step == 1 and ckpt.run_id == _saved_run(saved, 1)
        assert any("lineage/0/run" in w for w in report.warnings), report.warnings


# Two ranks -------------------------------------------------------------------------------


class _Calls:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def start(self, run_id, resume_step, tracked_upto):
        self.calls.append(f"start {run_id} {resume_step} {tracked_upto}")

    def log(self, step, metrics):
        self.calls.append(f"log {step}")

    def verdict(self, step, verdict):
        self.calls.append(f"verdict {verdict.status}")

    def close(self):
        self.calls.append("close")


def _two_ranks(rank: int, world: int, folder: str) -> dict:
    """Each rank: a fresh start, steps 1-2 tracked and step 2 saved, then a resume."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    first, again = _Calls(), _Calls()
    ckpt = ub.Checkpointer(folder, model=model, trackers=[first])
    minted = ckpt._run._lineage.events[0]["run"]  # this rank's own, before the ranks agree
    ckpt.restore()
    fresh = ckpt.run_id
    for step in (1, 2):
        ckpt.track(step, loss=float(step))
    ckpt.save(2)
    ckpt.close()
    with ub.Checkpointer(folder, model=model, trackers=[again]) as ckpt:
        ckpt.restore()
        resumed = ckpt.run_id
    calls = first.calls + again.calls
    return {"minted": minted, "fresh": fresh, "resumed": resumed, "calls": calls}


@pytest.mark.distributed
def test_ranks_agree_on_rank_0s_id_and_only_rank_0_forwards(tmp_path):
    """Each rank mints its own id when made; ``restore()`` makes rank 0's everyone's, the
    one its manifest records, and a resume on two ranks reads it back. Only rank 0's
    trackers are started and fed; rank 1's get no call (no second W&B run)."""
    r0, r1 = launcher.run(_two_ranks, 2, str(tmp_path))
    assert r0["minted"] != r1["minted"]  # without the agreement, two ids for one run
    assert r0["fresh"] == r1["fresh"] == r0["minted"] == _saved_run(tmp_path, 2)
    assert r0["resumed"] == r1["resumed"] == r0["minted"]
    run_id = r0["minted"]
    first = [f"start {run_id} 0 0", "log 1", "log 2", "close"]
    assert r0["calls"] == [*first, f"start {run_id} 2 2", "verdict none", "close"]
    assert r1["calls"] == []
