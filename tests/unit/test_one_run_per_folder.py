"""One run per folder, against a second *live* run too (issue 26, items 6, 7 and 9).

Bug class: two Checkpointers on one folder (an actor and a critic; a job launched twice)
silently replaced each other's checkpoints, a second job's tracked steps were appended
to the first one's record, and a relative path followed ``os.chdir``. Each test names
what failed before: a save replaced another run's step, the record mixed two runs, a
save after ``chdir`` went elsewhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest
import torch

import unbroken as ub
from conftest import Problem
from unbroken.format import manifest
from unbroken.format.series import read_series, record_lines


def _run_id(folder, step) -> str:
    return manifest.read(folder / f"step_{step:08d}")["lineage"][0]["run"]


def _track(p: Problem, ckpt, first: int, last: int, save_at=()) -> None:
    for step in range(first, last + 1):
        ckpt.track(step, loss=p.step())
        if step in save_at:
            ckpt.save(step)


def test_an_actor_and_a_critic_never_replace_each_others_steps(ckpt_dir):
    """Case: two Checkpointers in one process, one folder, both starting fresh. The
    second's save of the same step is refused naming both runs, the step and what to do;
    the first's checkpoint is untouched and a relaunch restores the actor's weights."""
    actor, critic = Problem(seed=0), Problem(seed=1)
    a, c = actor.checkpointer(ckpt_dir), critic.checkpointer(ckpt_dir)
    assert not a.restore().restored and not c.restore().restored
    actor.step(), critic.step()
    a.save(10)
    ours = _run_id(ckpt_dir, 10)
    with pytest.raises(ub.CheckpointError, match=r"step 10 .*another run.*refused") as info:
        c.save(10)
    assert ours in str(info.value) and c._run._lineage.events[0]["run"] in str(info.value)
    assert "own folder" in str(info.value)
    with pytest.raises(ub.CheckpointError, match="another run"):
        c.save(11)  # any step: the folder is the actor's
    assert a.steps() == [10] and _run_id(ckpt_dir, 10) == ours
    a.save(20)  # the first run goes on
    a.close(), c.close()
    relaunch = Problem(seed=5)
    with relaunch.checkpointer(ckpt_dir) as ckpt:
        assert ckpt.restore(step=10).verified
    for name, value in relaunch.model.state_dict().items():
        assert torch.equal(value, actor.model.state_dict()[name]), name
    assert not torch.equal(relaunch.model.inp.weight, critic.model.inp.weight)


def test_a_job_launched_twice_on_one_run_is_refused_at_its_first_save(ckpt_dir):
    """Case: two jobs resume the same run (same run identity); the first to commit wins,
    the other's save of any step is refused naming the same run twice, and never
    replaces or retires the winner's steps."""
    first = Problem()
    with first.checkpointer(ckpt_dir, keep_last=None) as ckpt:
        _track(first, ckpt, 1, 4, save_at={4})
    a_p, b_p = Problem(seed=1), Problem(seed=2)
    a, b = a_p.checkpointer(ckpt_dir, keep_last=None), b_p.checkpointer(ckpt_dir, keep_last=None)
    assert a.restore().step == 4 and b.restore().step == 4
    _track(a_p, a, 5, 8, save_at={8})
    _track(b_p, b, 5, 6)
    run = _run_id(ckpt_dir, 8)
    with pytest.raises(ub.CheckpointError, match=r"same run .*refused") as info:
        b.save(6)
    assert str(info.value).count(run) == 2 and "restored step 4" in str(info.value)
    assert a.steps() == [4, 8] and not list(ckpt_dir.glob(".retired-*"))
    a.save(9)  # the winner is unaffected
    a.close(), b.close()


@pytest.mark.parametrize("async_save", [False, True])
def test_legitimate_second_checkpointers_keep_working(ckpt_dir, async_save):
    """Keep: a relaunch after a crash (the crashed Checkpointer never closed), a resume
    of our own run, async saves, and ``overwrite=True`` replacing a previous run."""
    old = Problem()
    crashed = old.checkpointer(ckpt_dir, keep_last=2, async_save=async_save)
    _track(old, crashed, 1, 6, save_at={2, 4, 6})
    crashed.wait()  # never closed: as far as the folder knows, it died
    new = Problem(seed=3)
    with new.checkpointer(ckpt_dir, keep_last=2, async_save=async_save) as ckpt:
        assert ckpt.restore().step == 6
        _track(new, ckpt, 7, 10, save_at={8, 10})
        ckpt.wait()
        assert ckpt.steps() == [8, 10]
    replacing = Problem(seed=4)
    with replacing.checkpointer(ckpt_dir, overwrite=True, async_save=async_save) as ckpt:
        _track(replacing, ckpt, 1, 1, save_at={1})
        ckpt.wait()
        assert ckpt.steps() == [1]
    assert read_series(ckpt_dir).steps("loss") == [1]  # the replaced run's record is not its
    resumed = Problem(seed=5)
    with resumed.checkpointer(ckpt_dir) as ckpt:
        assert ckpt.restore().step == 1
        _track(resumed, ckpt, 2, 2, save_at={2})
    assert read_series(ckpt_dir).steps("loss") == [1, 2]


def test_an_async_save_refused_surfaces_and_commits_nothing(ckpt_dir):
    """An async save is checked in the background, holding the save lock: its refusal is
    raised by the next wait()/save()/close(), and nothing of it is committed."""
    a_p, b_p = Problem(), Problem(seed=1)
    a = a_p.checkpointer(ckpt_dir)
    b = b_p.checkpointer(ckpt_dir, async_save=True)
    a.save(3)
    b.save(3)
    with pytest.raises(ub.CheckpointError, match="another run"):
        b.wait()
    assert a.steps() == [3] and not list(ckpt_dir.glob(".partial-*"))
    a.close()
    b.close()


def test_each_save_lists_once_and_reads_no_manifest_of_its_own(ckpt_dir, monkeypatch):
    """Cost: the check is one listing per save; a manifest is read only for a step that
    someone else committed (never this Checkpointer's own, never the restored run's)."""
    from unbroken.run import ownership

    reads = []
    real = ownership._lineage_of
    monkeypatch.setattr(ownership, "_lineage_of", lambda d, s: reads.append(s) or real(d, s))
    p = Problem()
    with p.checkpointer(ckpt_dir, keep_last=3) as ckpt:
        _track(p, ckpt, 1, 12, save_at={2, 4, 6, 8, 10, 12})
    with Problem(seed=1).checkpointer(ckpt_dir) as ckpt:
        ckpt.restore()
        ckpt.save(13)
    assert reads == []


def _two_jobs(target, tracked: int, saved: int, seed: int = 1):
    """Job A tracks steps 1..``tracked``, saving step ``saved``; job B (a Problem of
    ``seed``) restores that step in the same folder. (A's Problem, A, B's Problem, B),
    both Checkpointers keeping every step and still open."""
    a_p = Problem()
    a = a_p.checkpointer(target, keep_last=None)
    _track(a_p, a, 1, tracked, save_at={saved})
    b_p = Problem(seed=seed)
    b = b_p.checkpointer(target, keep_last=None)
    assert b.restore().step == saved
    return a_p, a, b_p, b


def test_a_second_job_never_writes_into_the_first_jobs_record(ckpt_dir):
    """Case: a second job restores into a running job's folder and tracks; its save is
    refused. Before, its steps were appended to the first job's metrics.jsonl (steps
    twice, a resume that never happened). Now the record holds the first job alone."""
    a_p, a, _, b = _two_jobs(ckpt_dir, tracked=5, saved=5)
    for step in range(6, 10):
        b.track(step, loss=1000.0 + step)  # values no real run tracks
    _track(a_p, a, 6, 8, save_at={8})
    with pytest.raises(ub.CheckpointError, match=r"another run|same run"):
        b.save(9)
    b.track(10, loss=2000.0)
    b.close()
    _track(a_p, a, 9, 10)
    a.close()
    series = read_series(ckpt_dir)
    assert series.steps("loss") == list(range(1, 11)) and series.resumes == []
    assert all(v < 1000 for _, v in series.values["loss"])
    segments = {json.loads(line)["segment"] for line in record_lines(ckpt_dir)}
    assert segments == {a._run.record.segment}


def test_a_run_that_loses_the_folder_withdraws_the_steps_it_wrote(ckpt_dir):
    """The first Checkpointer writes its steps as it tracks (it holds the run lock); when
    the second commits first, the first's save is refused and its steps are withdrawn
    (a ``retracted`` line): the series is the folder's run, the second one."""
    a_p, b_p = Problem(), Problem(seed=1)
    a, b = a_p.checkpointer(ckpt_dir), b_p.checkpointer(ckpt_dir)
    a.restore(), b.restore()
    for step in (1, 2, 3):
        a.track(step, loss=1000.0 + step)
        b.track(step, loss=float(step))
    assert read_series(ckpt_dir).steps("loss") == [1, 2, 3]  # a's, on disk as tracked
    b.save(2)
    with pytest.raises(ub.CheckpointError, match="another run"):
        a.save(3)
    a.close(), b.close()
    series = read_series(ckpt_dir)
    assert series.values["loss"] == [(1, 1.0), (2, 2.0), (3, 3.0)] and series.resumes == []


def test_a_relaunch_while_the_crashed_checkpointer_lingers_still_replays(ckpt_dir):
    """The replay check still sees the steps the crashed run recorded after its last
    save; the relaunch's own steps reach the record once its first save commits."""
    # Steps 5..8 recorded after the last save; "crash".
    _, _, b_p, b = _two_jobs(ckpt_dir, tracked=8, saved=4, seed=7)
    _track(b_p, b, 5, 8)
    assert b.replay.status == "identical" and b.replay.compared_steps == 4
    b.save(8)
    _track(b_p, b, 9, 9)
    b.close()
    series = read_series(ckpt_dir)
    assert series.steps("loss") == list(range(1, 10)) and series.resumes == [4]


def test_a_second_job_on_a_store_withdraws_what_it_uploaded(monkeypatch):
    """On an object store (no locks) a second job may upload before another run commits;
    once its save is refused it withdraws those steps: the series is the first job's."""
    monkeypatch.setenv("UNBROKEN_STORE_METRICS_S", "0")
    url = f"memory://unbroken-tests/{uuid.uuid4().hex[:8]}/run"
    a_p, a, _, b = _two_jobs(url, tracked=2, saved=2)
    b.track(3, loss=5000.0)
    b._run.record._log.flush()  # uploaded: nobody committed since it restored
    assert 5000.0 in [v for _, v in read_series(url).values["loss"]]
    _track(a_p, a, 3, 4, save_at={4})
    with pytest.raises(ub.CheckpointError, match="same run"):
        b.save(4)
    b.close()
    a.close()
    series = read_series(url)
    assert series.steps("loss") == [1, 2, 3, 4] and series.resumes == []
    assert all(v < 1000 for _, v in series.values["loss"])


def test_a_store_refuses_a_second_fresh_checkpointer(monkeypatch):
    url = f"memory://unbroken-tests/{uuid.uuid4().hex[:8]}/run"
    a, b = Problem().checkpointer(url), Problem(seed=1).checkpointer(url)
    a.restore(), b.restore()
    a.save(1)
    with pytest.raises(ub.CheckpointError, match="another run"):
        b.save(1)
    assert a.steps() == [1]
    a.close(), b.close()


def test_the_path_is_resolved_once(tmp_path, monkeypatch):
    """Case: a relative path, then os.chdir: saves and metrics went to another folder,
    and the relaunch started fresh. Now the folder is fixed when the Checkpointer is
    made (symbolic links in the path kept as given) and ckpt.path returns it."""
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    home.mkdir(), elsewhere.mkdir()
    (tmp_path / "link").symlink_to(home)
    monkeypatch.chdir(tmp_path)
    p = Problem()
    ckpt = p.checkpointer("link/ckpts")
    assert ckpt.path == os.path.join(os.getcwd(), "link", "ckpts")  # the link not resolved
    ckpt.restore()
    monkeypatch.chdir(elsewhere)
    _track(p, ckpt, 1, 3, save_at={3})
    ckpt.close()
    assert not (elsewhere / "ckpts").exists()
    assert (home / "ckpts" / "step_00000003").is_dir()
    assert read_series(home / "ckpts").steps("loss") == [1, 2, 3]
    monkeypatch.chdir(home)
    with Problem(seed=1).checkpointer("ckpts") as again:
        assert again.restore().step == 3


def test_a_refusal_tells_a_run_that_never_restored_what_to_do(ckpt_dir):
    old = Problem()
    with old.checkpointer(ckpt_dir) as ckpt:
        ckpt.save(1)
    new = Problem(seed=1)
    ckpt = new.checkpointer(ckpt_dir)
    with pytest.raises(ub.CheckpointError, match=r"another run.*restore\(\).*overwrite=True"):
        ckpt.save(2)
    ckpt.close()
    assert torch.equal(
        torch.tensor(manifest.read(ckpt_dir / "step_00000001")["step"]), torch.tensor(1)
    )


def test_a_checkpointer_never_closed_exits_without_a_shutdown_error(tmp_path):
    """A script that saves and ends without ``close()`` exits 0 and prints nothing: the
    run lock lets go at interpreter shutdown without reaching for module globals that
    shutdown has already cleared (it printed an ignored AttributeError)."""
    script = (
        "import torch, unbroken as ub\n"
        "m = torch.nn.Linear(4, 4)\n"
        "o = torch.optim.AdamW(m.parameters())\n"
        f"ck = ub.Checkpointer({str(tmp_path / 'run')!r}, model=m, optimizer=o)\n"
        "ck.save(1)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", done.stderr
    assert ub.Checkpointer(tmp_path / "run", model=torch.nn.Linear(4, 4)).steps() == [1]
