"""Checkpoints on S3, against a real S3 API: moto's server on 127.0.0.1 (tests/s3_server.py).

Single process: bit-exact save and restore with multipart uploads; a process killed in
the middle of an upload leaves nothing listed, and a later save aborts and removes what
it left; server errors, throttling and dropped connections are retried, and when they
outlast the retries the save fails naming the object and commits nothing.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch

import unbroken as ub
from s3_server import FaultProxy, S3Server
from unbroken.storage.locate import checkpoint_dir, location

TESTS = str(Path(__file__).resolve().parents[1])


@pytest.fixture(scope="module")
def server(s3_server):
    return s3_server


@pytest.fixture
def s3(server, monkeypatch):
    """A fresh prefix in the bucket; 5 MiB parts so a small model uploads in parts."""
    monkeypatch.setenv("UNBROKEN_STORE_PART_MB", "5")
    with server.environment():
        yield f"s3://ckpts/{uuid.uuid4().hex[:8]}/run"


class Big:
    """2.1M parameters + AdamW moments: a 25 MB shard, 5 parts of 5 MiB."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    def step(self) -> None:
        self.model(torch.randn(4, 1024)).square().mean().backward()
        self.opt.step()
        self.opt.zero_grad()

    def checkpointer(self, url: str, **kw) -> ub.Checkpointer:
        return ub.Checkpointer(url, model=self.model, optimizer=self.opt, **kw)

    def same(self, other: Big) -> bool:
        a, b = self.model.state_dict(), other.model.state_dict()
        oa, ob = self.opt.state_dict()["state"], other.opt.state_dict()["state"]
        return all(torch.equal(a[k], b[k]) for k in a) and all(
            torch.equal(oa[i][k], ob[i][k]) for i in oa for k in oa[i]
        )


def _uploads(server: S3Server, url: str) -> list[str]:
    prefix = url.removeprefix("s3://ckpts/")
    got = server.client().list_multipart_uploads(Bucket="ckpts", Prefix=prefix)
    return [u["Key"] for u in got.get("Uploads", [])]


def _keys(server: S3Server, url: str) -> list[str]:
    prefix = url.removeprefix("s3://ckpts/")
    got = server.client().list_objects_v2(Bucket="ckpts", Prefix=prefix)
    return sorted(o["Key"].removeprefix(prefix + "/") for o in got.get("Contents", []))


def test_multipart_save_and_restore_bit_exact(server, s3):
    """Guarantee: save to S3 in parallel multipart uploads, restore by parallel ranged
    reads, bit-exact and verified."""
    a = Big(0)
    a.step()
    a.checkpointer(s3).save(1)
    shard = next(k for k in _keys(server, s3) if k.endswith(".bin"))
    etag = server.client().head_object(
        Bucket="ckpts", Key=s3.removeprefix("s3://ckpts/") + "/" + shard
    )["ETag"]
    assert etag.strip('"').endswith("-5")  # a multipart object of 5 parts
    b = Big(1)
    report = b.checkpointer(s3).restore()
    assert report.verified and report.step == 1
    assert b.same(a)


KILLED = textwrap.dedent(
    """
    import os, sys
    import torch
    sys.path.insert(0, {tests!r}); sys.path.insert(0, {here!r})
    from test_object_store_s3 import Big
    from unbroken.storage import store as remote
    a = Big(0)
    a.step()
    ckpt = a.checkpointer({url!r})
    ckpt.save(1)
    torch.save((a.model.state_dict(), a.opt.state_dict()), {expected!r})
    real = remote.Store.call
    def dying(self, doing, key, fn, fix=""):
        if doing == "uploading part 3 of":
            os._exit(9)  # killed with parts 1-2 (and more, in flight) sent
        return real(self, doing, key, fn, fix)
    remote.Store.call = dying
    a.step()
    ckpt.save(2)
    os._exit(0)
    """
)


def test_kill_during_upload_lists_nothing_and_is_cleaned(server, s3, monkeypatch, tmp_path):
    """Guarantee: a process killed in the middle of a shard upload commits nothing (step
    1 stays the newest and restores exactly); its open multipart upload is aborted by
    the next save once stale.

    The killed process writes the state it saved at step 1 beside the test: recomputing
    it here would depend on this process's thread count, which changes a matmul's
    rounding."""
    saved = tmp_path / "step1.pt"
    code = KILLED.format(tests=TESTS, here=str(Path(__file__).parent), url=s3, expected=str(saved))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 9, done.stderr[-2000:]
    assert checkpoint_dir(s3).steps() == [1]
    assert not any(k.startswith("step_00000002") for k in _keys(server, s3))
    assert _uploads(server, s3)  # the killed upload is still open on the server
    expected = Big(2)
    model, opt = torch.load(saved, weights_only=True)
    expected.model.load_state_dict(model)
    expected.opt.load_state_dict(opt)
    b = Big(1)
    ckpt = b.checkpointer(s3)
    assert ckpt.restore().step == 1 and b.same(expected)
    monkeypatch.setenv("UNBROKEN_STALE_UPLOAD_S", "0")
    ckpt.save(2)
    assert _uploads(server, s3) == []
    assert checkpoint_dir(s3).steps() == [1, 2]


@pytest.mark.parametrize("fault", ["503", "slowdown", "drop"])
def test_transient_errors_are_retried(server, s3, fault, monkeypatch):
    """Guarantee: 5xx answers, throttling and dropped connections on part uploads and on
    the manifest write are retried (bounded); the save then commits and restores
    exactly."""
    budget = {"PUT": 3}

    def rule(method: str, path: str) -> str | None:
        if method == "PUT" and budget["PUT"] > 0 and ("partNumber=2" in path or "manifest" in path):
            budget["PUT"] -= 1
            return fault
        return None

    proxy = FaultProxy(server.port, rule)
    monkeypatch.setenv("UNBROKEN_STORE_RETRIES", "5")
    try:
        with server.environment(proxy.endpoint):
            a = Big(0)
            a.step()
            a.checkpointer(s3).save(1)
            b = Big(1)
            assert b.checkpointer(s3).restore().verified and b.same(a)
    finally:
        proxy.stop()
    assert proxy.injected == 3


def _save_2_losing_the_commit_answer(server, s3, monkeypatch, refused: str | None = None) -> Big:
    """Save step 1, then step 2 through a proxy that forwards the create-only PUT of its
    manifest and loses the answer (the retry is refused as "exists"); ``refused``: the
    error that save must raise. Returns the trained state."""
    lost = {"manifest": 1}

    def rule(method: str, path: str) -> str | None:
        if method == "PUT" and "step_00000002/manifest.json" in path and lost["manifest"]:
            lost["manifest"] -= 1
            return "lose"
        return None

    a = Big(0)
    a.step()
    a.checkpointer(s3).save(1)
    proxy = FaultProxy(server.port, rule)
    monkeypatch.setenv("UNBROKEN_STORE_RETRIES", "5")
    try:
        with server.environment(proxy.endpoint):
            ckpt = a.checkpointer(s3)
            ckpt.restore()
            a.step()
            if refused is None:
                ckpt.save(2)
            else:
                with pytest.raises(ub.CheckpointError, match=refused):
                    ckpt.save(2)
    finally:
        proxy.stop()
    assert proxy.injected == 1
    return a


def _assert_step_2_whole(s3, a: Big) -> None:
    assert checkpoint_dir(s3).steps() == [1, 2]
    assert ub.verify_checkpoint(f"{s3}/step_00000002").ok
    b = Big(1)
    report = b.checkpointer(s3).restore()
    assert report.step == 2 and report.verified and b.same(a)


def test_a_commit_whose_answer_is_lost_is_kept(server, s3, monkeypatch):
    """Issue 36, item 17: the create-only PUT of the manifest reaches the store and its
    answer is lost; the retry is refused as "exists". That manifest is this save's own:
    the save succeeds, nothing it references is deleted, and the step verifies and
    restores. (Before: "another save committed step 2", its own shards removed under its
    own committed manifest, a restore falling back past it.)"""
    _assert_step_2_whole(s3, _save_2_losing_the_commit_answer(server, s3, monkeypatch))


def test_a_commit_that_cannot_be_read_back_deletes_nothing_it_lists(server, s3, monkeypatch):
    """Issue 36, item 17: the answer to the manifest's write is lost and the manifest then
    cannot be read back. The save cannot confirm its commit and says so, but deletes none
    of the objects the committed manifest lists: step 2 stays whole, verifies and
    restores (never a listed step whose shards were removed under it)."""
    from unbroken.storage import store as remote
    from unbroken.storage import store_medium

    real = remote.Store.read
    blind = {"on": True}

    def read(self, key):
        if blind["on"] and key.endswith("step_00000002/manifest.json"):
            raise FileNotFoundError(key)
        return real(self, key)

    monkeypatch.setattr(remote.Store, "read", read)
    monkeypatch.setattr(store_medium, "_READ_BACK_WAITS", (0.0, 0.0))
    a = _save_2_losing_the_commit_answer(server, s3, monkeypatch, "cannot be confirmed")
    blind["on"] = False
    _assert_step_2_whole(s3, a)


def test_persistent_errors_fail_naming_the_object(server, s3, monkeypatch):
    """Guarantee: errors that outlast the retries fail the save with a CheckpointError
    naming the object; nothing is committed, its upload is aborted, and the earlier
    checkpoint is untouched."""
    a = Big(0)
    a.step()  # AdamW moments too: a shard of 5 parts
    a.checkpointer(s3).save(1)
    before = _keys(server, s3)
    proxy = FaultProxy(server.port, lambda m, p: "503" if "partNumber=4" in p else None)
    monkeypatch.setenv("UNBROKEN_STORE_RETRIES", "3")
    try:
        with server.environment(proxy.endpoint):
            ckpt = a.checkpointer(s3)  # a client of the proxy
            ckpt.restore()
            with pytest.raises(ub.CheckpointError, match=r"part 4 of s3://ckpts/.*rank_00000-"):
                ckpt.save(2)
    finally:
        proxy.stop()
    assert proxy.injected == 3
    assert _keys(server, s3) == before and _uploads(server, s3) == []
    assert checkpoint_dir(s3).steps() == [1]


def test_conditional_write_refuses_a_second_commit(server, s3):
    """Guarantee: the manifest is written with If-None-Match: * (the server refuses a
    second one), so two saves of one step cannot both commit on S3."""
    a = Big(0)
    a.checkpointer(s3).save(1)
    store = location(s3).store
    key = s3.removeprefix("s3://") + "/step_00000001/manifest.json"
    with pytest.raises(FileExistsError):
        store.put(key, b"{}", create=True)
    assert store.read(key) != b"{}"


def test_tracked_steps_reach_the_store_at_exit_without_close(s3, tmp_path):
    """A script that never closes its Checkpointer (no ``with``, no save after the last
    tracked steps) still leaves its metrics record on S3: what is pending is uploaded at
    interpreter exit, so a later resume's replay check has its reference."""
    code = textwrap.dedent(
        f"""
        import sys, torch
        sys.path.insert(0, {TESTS!r})
        from conftest import Problem
        p = Problem()
        ckpt = p.checkpointer({s3!r})
        for s in range(1, 4):
            ckpt.track(s, loss=p.step())
            if s == 1:
                ckpt.save(1)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    from unbroken.format.series import read_series

    assert read_series(s3).steps("loss") == [1, 2, 3]
