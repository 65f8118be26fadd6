"""The tracked-metrics record on an object store (a journal, storage/store_path.py), on ``memory://``.

A store cannot append, so the record is a series of objects under ``PREFIX/metrics/``.
These tests hold it to what ``metrics.jsonl`` gives locally: the replay check compares
the steps a resumed run recomputes with the ones recorded before the stop (bug class:
a resume that is wrong while the report says verified, unseen because nothing was
compared), the plotted series follows the surviving timeline, and nothing tracked is
lost when an upload fails or the Checkpointer is never closed.
"""

from __future__ import annotations

import uuid

import fsspec
import pytest
import torch

from conftest import Problem
from unbroken.errors import CheckpointError
from unbroken.format.series import read_series, record_lines
from unbroken.storage.store import Store


@pytest.fixture
def url() -> str:
    return f"memory://unbroken-tests/{uuid.uuid4().hex[:8]}/run"


def _metric_objects(url: str) -> list[str]:
    fs, root = fsspec.core.url_to_fs(url)
    return sorted(p.rsplit("/", 1)[-1] for p in fs.find(f"{root}/metrics"))


def _train(p: Problem, ckpt, first: int, last: int, save_at: set[int] = frozenset()) -> None:
    for step in range(first, last + 1):
        ckpt.track(step, loss=p.step())
        if step in save_at:
            ckpt.save(step)


def test_replay_check_compares_recomputed_steps_on_a_store(url):
    """Bug class: a resume that is wrong while the report says verified. On a store the
    steps tracked after the last save are recorded too, so the resumed run's recomputed
    steps are compared bit for bit: identical for an exact resume..."""
    torch.manual_seed(0)
    a = Problem()
    with a.checkpointer(url) as ckpt:
        _train(a, ckpt, 1, 8, save_at={4})  # steps 5-8 tracked after the last save
    assert _metric_objects(url), "nothing recorded on the store"
    b = Problem(seed=3)
    with b.checkpointer(url) as ckpt:
        assert ckpt.restore().step == 4
        _train(b, ckpt, 5, 8)
        verdict = ckpt.replay
    assert verdict.status == "identical" and verdict.compared_steps == 4, verdict


def test_replay_check_catches_a_reset_optimizer_on_a_store(url):
    """...and DIFFERENT when the resume was not exact (the optimizer's moments dropped
    after the restore, the failure DESIGN.md names first)."""
    torch.manual_seed(0)
    a = Problem()
    with a.checkpointer(url) as ckpt:
        _train(a, ckpt, 1, 8, save_at={4})
    b = Problem(seed=3)
    with b.checkpointer(url) as ckpt:
        ckpt.restore()
        b.opt.state.clear()  # the bug: moments lost after the restore
        _train(b, ckpt, 5, 8)
        verdict = ckpt.replay
    # step 5's loss comes before the first step of the reset optimizer: step 6 differs
    assert verdict.status == "different" and verdict.step == 6, verdict


def test_series_follows_the_surviving_timeline(url):
    """The record read back from the store is the local file's: a resume from an older
    step replaces the abandoned steps, and the resume point is listed."""
    torch.manual_seed(0)
    a = Problem()
    with a.checkpointer(url) as ckpt:
        _train(a, ckpt, 1, 6, save_at={2, 4})
    b = Problem(seed=3)
    with b.checkpointer(url) as ckpt:
        ckpt.restore(step=2)
        _train(b, ckpt, 3, 5)
    series = read_series(url)
    assert series.steps("loss") == [1, 2, 3, 4, 5] and series.resumes == [2]
    lines = record_lines(url)
    assert lines is not None and sum('"resumed_from"' in x for x in lines) == 2


def test_a_failed_upload_loses_nothing_and_keeps_the_order(url, monkeypatch):
    """An upload the store refuses is retried, with everything tracked since, under the
    same object name: no step lost, none out of order."""
    monkeypatch.setenv("UNBROKEN_STORE_RETRIES", "1")
    real_put = Store.put
    failing = {"on": True}

    def put(self, key, data, **kw):
        if "/metrics/" in key and failing["on"]:
            raise CheckpointError(f"writing {key}: injected failure")
        return real_put(self, key, data, **kw)

    monkeypatch.setattr(Store, "put", put)
    torch.manual_seed(0)
    p = Problem()
    with p.checkpointer(url) as ckpt:
        _train(p, ckpt, 1, 3, save_at={3})  # the save commits; the metrics upload fails
        assert _metric_objects(url) == []
        failing["on"] = False
        _train(p, ckpt, 4, 5)
    assert len(_metric_objects(url)) == 1
    assert read_series(url).steps("loss") == [1, 2, 3, 4, 5]


def test_a_save_whose_record_upload_fails_says_so_in_its_warnings(url, monkeypatch, caplog):
    """Issue 36, item 16 (d): every upload of the metrics record fails (the store answers
    500 until the retries are spent). The save succeeds, rightly, and its warnings (and
    the log) say how many tracked steps are not in the store's record, naming the object;
    once the store answers again they are written."""
    monkeypatch.setenv("UNBROKEN_STORE_RETRIES", "1")
    real_put = Store.put
    failing = {"on": True}

    def put(self, key, data, **kw):
        if "/metrics/" in key and failing["on"]:
            raise CheckpointError(f"writing {key}: the store answered 500 (injected)")
        return real_put(self, key, data, **kw)

    monkeypatch.setattr(Store, "put", put)
    p = Problem()
    ckpt = p.checkpointer(url)
    with caplog.at_level("WARNING", logger="unbroken"):
        _train(p, ckpt, 1, 3, save_at={3})
    [note] = [w for w in ckpt.warnings if "metrics record" in w]
    assert note.startswith("3 tracked step(s) are not in the metrics record yet")
    assert "/metrics/" in note and "500" in note
    assert note in caplog.text
    failing["on"] = False
    _train(p, ckpt, 4, 4, save_at={4})
    assert not [w for w in ckpt.warnings if "metrics record" in w]
    ckpt.close()
    assert read_series(url).steps("loss") == [1, 2, 3, 4]


def test_close_raises_naming_the_object_when_the_store_refuses(url, monkeypatch):
    """At close() a record that cannot be uploaded is an error naming the object (a
    save's upload failure is only a warning: its checkpoint is committed)."""
    monkeypatch.setenv("UNBROKEN_STORE_RETRIES", "1")
    real_put = Store.put

    def put(self, key, data, **kw):
        if "/metrics/" in key:
            raise CheckpointError(f"writing {key}: injected failure")
        return real_put(self, key, data, **kw)

    monkeypatch.setattr(Store, "put", put)
    p = Problem()
    ckpt = p.checkpointer(url)
    ckpt.track(1, loss=p.step())
    with pytest.raises(CheckpointError, match=r"/metrics/.*injected"):
        ckpt.close()


def test_background_upload_after_the_interval(url, monkeypatch):
    """With ``UNBROKEN_STORE_METRICS_S`` passed, tracked steps are uploaded without a
    save, so a process killed outright loses at most that interval of its record."""
    monkeypatch.setenv("UNBROKEN_STORE_METRICS_S", "0")
    p = Problem()
    ckpt = p.checkpointer(url)
    try:
        ckpt.track(1, loss=p.step())
        ckpt._run.record._log._background.join(10)
        assert read_series(url).steps("loss") == [1]
    finally:
        ckpt.close()


def test_uploads_fill_one_object_until_it_is_full(url, monkeypatch):
    """Frequent uploads (every save, every interval) do not leave an object each: the
    object being filled is rewritten until it holds CHUNK_BYTES, then a new one starts,
    so a long run's record stays a few objects to list and read, in order."""
    from unbroken.storage import store_path

    monkeypatch.setattr(store_path, "CHUNK_BYTES", 600)
    p = Problem()
    with p.checkpointer(url) as ckpt:
        for step in range(1, 13):
            ckpt.track(step, loss=p.step())
            ckpt._run.record._log.flush()
    names = _metric_objects(url)
    assert 2 <= len(names) < 12, names
    assert read_series(url).steps("loss") == list(range(1, 13))
