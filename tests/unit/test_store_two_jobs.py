"""Two jobs (two runs) saving the same step into one folder: on S3 (moto on 127.0.0.1)
and on a local disk, one save fails naming the step, and the other's checkpoint stays
intact and restorable. Nothing a save did not write is deleted.
"""

from __future__ import annotations

import copy
import uuid

import pytest
import torch

import unbroken as ub
from unbroken.run.ownership import FolderClaim
from unbroken.storage.locate import checkpoint_dir


@pytest.fixture(scope="module")
def server(s3_server):
    return s3_server


@pytest.fixture
def s3(server):
    with server.environment():
        yield f"s3://ckpts/{uuid.uuid4().hex[:8]}/run"


def _job(seed: int, url: str) -> tuple[ub.Checkpointer, torch.nn.Module]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 8)
    return ub.Checkpointer(url, model=model), model


def _race(url: str, monkeypatch) -> tuple[torch.nn.Module, list[str]]:
    """Job B lists the folder (its claim check passes: nothing is there), then job A
    saves step 5, then B goes on to upload and commit step 5. Returns the model of the
    job whose save returned and the errors of the one that failed."""
    a, model_a = _job(0, url)
    b, model_b = _job(1, url)
    a.restore()
    b.restore()
    check = FolderClaim.check
    errors: list[str] = []
    winner: list[torch.nn.Module] = []

    def paused(self, step, lineage):
        check(self, step, lineage)
        if self is b._run.claim and not winner and not errors:
            try:
                a.save(step)  # the other job saves in between
                winner.append(model_a)
            except ub.CheckpointError as exc:
                errors.append(str(exc))

    monkeypatch.setattr(FolderClaim, "check", paused)
    try:
        b.save(5)
        winner.append(model_b)
    except ub.CheckpointError as exc:
        errors.append(str(exc))
    monkeypatch.setattr(FolderClaim, "check", check)
    assert len(winner) == 1 and len(errors) == 1, (winner, errors)
    return winner[0], errors


def _intact(url: str, model_a: torch.nn.Module) -> None:
    """The winner's step 5 restores, verified, bit for bit."""
    fresh = copy.deepcopy(model_a)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    report = ub.Checkpointer(url, model=fresh).restore()
    assert report.step == 5 and report.verified, report
    assert all(
        torch.equal(p, q) for p, q in zip(fresh.parameters(), model_a.parameters(), strict=True)
    )


def test_second_job_on_one_s3_prefix_fails_and_keeps_the_first(s3, monkeypatch):
    """Guards: two jobs committing one step into one s3:// prefix both returned, and the
    second moved the first's checkpoint aside as its own re-save and deleted it."""
    model_a, errors = _race(s3, monkeypatch)
    assert "another save committed step 5" in errors[0]
    ckdir = checkpoint_dir(s3)
    assert ckdir.steps() == [5]
    assert not [n for n in ckdir.listdir() if n.startswith(".")], ckdir.listdir()
    _intact(s3, model_a)


def test_second_job_on_one_local_folder_fails_and_keeps_the_first(tmp_path, monkeypatch):
    """Guards the same race on a local disk: the save lock and the commit keep the first
    job's step, the second save fails naming it."""
    url = str(tmp_path / "run")
    model_a, errors = _race(url, monkeypatch)  # the save lock refuses the one that comes second
    assert "another save" in errors[0], errors
    assert checkpoint_dir(url).steps() == [5]
    _intact(url, model_a)


def test_a_re_save_of_its_own_step_still_replaces_it(s3):
    """Guards against refusing too much: a Checkpointer re-saving a step it committed (or
    the step it resumed from) replaces it."""
    ck, model = _job(0, s3)
    ck.restore()
    ck.save(5)
    with torch.no_grad():
        model.weight.add_(1)
    ck.save(5)
    again, model2 = _job(3, s3)
    assert again.restore().step == 5
    assert torch.equal(model2.weight, model.weight)
    again.save(5)
    assert checkpoint_dir(s3).steps() == [5]


def _big_job(seed: int, url: str) -> tuple[ub.Checkpointer, torch.nn.Module]:
    """An 8 MB shard: two parts of 5 MiB, a multipart upload."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))
    return ub.Checkpointer(url, model=model), model


def _race_in_upload(url: str, monkeypatch, before_part: int) -> tuple[torch.nn.Module, str]:
    """Job B's shard upload is under way (parts one at a time) when job A saves the
    same step whole, just before B sends part ``before_part``; then B goes on. Returns
    the model of the job whose save returned and the other's error."""
    from unbroken.storage import store_io

    monkeypatch.setenv("UNBROKEN_STORE_PART_MB", "5")
    monkeypatch.setenv("UNBROKEN_STORE_CONCURRENCY", "1")
    a, model_a = _big_job(0, url)
    b, model_b = _big_job(1, url)
    a.restore()
    b.restore()
    real, fired, errors, winner = store_io._s3_once, [], [], []

    def racing(fs, method, **kw):
        if method == "upload_part" and kw["PartNumber"] == before_part and not fired:
            fired.append(True)
            a.save(5)  # the other job: its save cleans the prefix's stale uploads first
            winner.append(model_a)
        return real(fs, method, **kw)

    monkeypatch.setattr(store_io, "_s3_once", racing)
    try:
        b.save(5)
        winner.append(model_b)
    except ub.CheckpointError as exc:
        errors.append(str(exc))
    monkeypatch.setattr(store_io, "_s3_once", real)
    assert fired and len(winner) == 1 and len(errors) == 1, (fired, winner, errors)
    return winner[0], errors[0]


def test_the_loser_of_a_race_on_one_s3_prefix_is_told_of_the_other_job(s3, monkeypatch):
    """Item 18: the loser of two jobs racing on one prefix failed on a part upload with
    moto's answer 500 ("check the store and try again"), never reaching the conflict.
    Cause: the winner's clean-up aborted the loser's upload in flight as stale (moto
    dates every multipart upload 2010-11-10) and moto answers a part of an aborted upload
    500. Now an upload with a recent part is never aborted: the loser reaches its commit
    and is told which run committed the step."""
    model_a, error = _race_in_upload(s3, monkeypatch, before_part=2)
    assert "another save committed step 5" in error and "run " in error, error
    assert "two jobs must not share" in error, error
    assert checkpoint_dir(s3).steps() == [5]
    _intact(s3, model_a)


def test_an_upload_aborted_by_the_other_job_names_the_conflict(s3, monkeypatch):
    """Item 18: an upload aborted before its first part (no part tells its age; moto says
    it began in 2010) failed "check the store and try again" after four 500s. Now the
    save sees its upload gone and names the cause: another job on the same prefix."""
    model_a, error = _race_in_upload(s3, monkeypatch, before_part=1)
    assert "aborted by another process" in error and "two jobs must not share" in error, error
    assert "check the store" not in error, error
    assert "was committed meanwhile by another save" in error, error  # where to look
    assert checkpoint_dir(s3).steps() == [5]
    _intact(s3, model_a)
