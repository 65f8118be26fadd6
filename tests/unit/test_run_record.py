"""``run.record.RunRecord``: the run's record a Checkpointer holds, through the
interface it calls (construction, resumed, track, window, before_save, after_commit,
finish, close), without a Checkpointer."""

from __future__ import annotations

import pytest

from unbroken.format.series import read_series
from unbroken.run.record import METRICS_WINDOW, RunRecord
from unbroken.storage.locate import location


def _earlier_run(root, upto=8, saved_at=5):
    """A segment that tracked steps 1..upto; returns (its segment, the window saved at
    ``saved_at``)."""
    record = RunRecord(root)
    for step in range(1, upto + 1):
        record.track(step, {"loss": 1.0 / step, "grad_norm": float(step)})
    window = record.window(saved_at)
    record.after_commit()
    record.finish()
    record.close()
    return record.segment, window


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [({"loss_metric": ""}, ValueError), ({"grad_norm_metric": "loss"}, ValueError),
     ({"loss_metric": 3}, TypeError)],
)  # fmt: skip
def test_metric_names_are_checked_at_construction(tmp_path, kwargs, error):
    with pytest.raises(error):
        RunRecord(location(tmp_path), **kwargs)


def test_tracked_steps_are_recorded_and_windowed(tmp_path):
    record = RunRecord(location(tmp_path))
    for step in range(1, METRICS_WINDOW + 11):
        record.track(step, {"loss": float(step)})
    window = record.window(METRICS_WINDOW + 5)
    assert len(window) == METRICS_WINDOW and window[-1] == {"step": METRICS_WINDOW + 5,
                                                           "loss": METRICS_WINDOW + 5.0}  # fmt: skip
    record.after_commit()
    assert read_series(tmp_path).steps("loss") == list(range(1, METRICS_WINDOW + 11))
    assert record.replay is None and record.before_save() is None and record.warnings == []
    record.finish()
    record.close()
    record.close()  # safe again


def test_a_resumed_record_replays_the_steps_recorded_after_the_checkpoint(tmp_path):
    root = location(tmp_path)
    segment, window = _earlier_run(root)
    record = RunRecord(root)
    record.resumed(window, from_step=5, saved_by=segment, world_size=1, reset=[], optimizers={})
    assert record.segment != segment
    assert record.replay.status == "pending" and record.replay.recorded_steps == 3
    record.track(6, {"loss": 1.0 / 6, "grad_norm": 6.0})
    assert record.before_save()["compared_steps"] == 1
    for step in (7, 8):
        record.track(step, {"loss": 1.0 / step, "grad_norm": float(step)})
    assert record.replay.identical is True and record.warnings == []
    record.finish()
    record.close()
    assert read_series(tmp_path).resumes == [5]


def test_a_replay_difference_is_a_warning(tmp_path):
    root = location(tmp_path)
    segment, window = _earlier_run(root)
    record = RunRecord(root)
    record.resumed(window, from_step=5, saved_by=segment, world_size=1, reset=["optimizer"],
                   optimizers={})  # fmt: skip
    record.track(6, {"loss": -0.0, "grad_norm": 6.0})
    verdict = record.replay
    assert verdict.identical is False and verdict.step == 6 and verdict.metric == "loss"
    (warning,) = record.warnings
    assert "DIFFERENT at step 6" in warning and "optimizer fresh (reset)" in warning
    assert record.before_save()["status"] == "different"
    record.finish()
    record.close()
