"""The one "same value" rule (format/bitwise.py) where the resume proof compares: the
resume test's metric comparison and the optimizer watch. Both changed with it: the resume
test now tells -0.0 from 0.0, and the optimizer watch no longer takes a NaN for a change."""

from __future__ import annotations

import json
import math

import torch

from unbroken.proof.replay import compare
from unbroken.run.optimizer_watch import OptimizerWatch


def _record(folder, values: dict[int, dict[str, float]]) -> None:
    """A run folder whose metrics record holds ``values`` (step -> metrics), one segment."""
    folder.mkdir()
    lines = [{"segment": "s", "resumed_from": None, "parent": None, "world_size": 1, "time": 0}]
    lines += [
        {"segment": "s", "step": step, "metrics": {k: v if math.isfinite(v) else repr(v)
                                                   for k, v in m.items()}}
        for step, m in values.items()
    ]  # fmt: skip
    text = "".join(json.dumps(line, allow_nan=False) + "\n" for line in lines)
    (folder / "metrics.jsonl").write_text(text, encoding="utf-8")


def test_resume_test_tells_negative_zero_from_zero(tmp_path):
    """Behaviour change: ``unbroken resume-test`` compares metrics bit for bit, so a loss
    of -0.0 where the straight run had 0.0 is a difference (it used ``==`` before, which
    calls them equal). A NaN in both runs is still the same value."""
    straight = {s: {"loss": 1.0 / s, "nan": math.nan} for s in range(1, 5)}
    resumed = {s: dict(m) for s, m in straight.items()}
    straight[3]["loss"], resumed[3]["loss"] = 0.0, -0.0
    _record(tmp_path / "a", straight)
    _record(tmp_path / "b", resumed)
    result = compare(tmp_path / "a", tmp_path / "b", stop_at=1)
    assert result.first_difference == "step 3, metric 'loss': straight 0.0, resumed -0.0"
    assert result.first_difference_step == 3 and not result.passed


def test_resume_test_finds_nothing_in_identical_series_with_nans(tmp_path):
    values = {s: {"loss": 1.0 / s, "nan": math.nan, "zero": -0.0} for s in range(1, 5)}
    _record(tmp_path / "a", values)
    _record(tmp_path / "b", values)
    result = compare(tmp_path / "a", tmp_path / "b", stop_at=1)
    assert result.first_difference is None and result.compared_steps == 3
    assert "no committed checkpoint" in result.state_differences[0]  # none was saved here


def test_optimizer_watch_is_not_fooled_by_a_nan_in_the_restored_state():
    """Behaviour change: a NaN in the sampled optimizer state is the same value at the
    next look (it compared with ``torch.equal`` before, where NaN != NaN, so the state
    always seemed to change: the watch took the restored optimizer for one in use and
    stopped, missing another optimizer training the model)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    for state in opt.state.values():
        state["exp_avg"].view(-1)[0] = math.nan  # a moment gone bad before the save
    watch = OptimizerWatch({None: opt})
    other = torch.optim.SGD(model.parameters(), lr=0.1)  # built after the restore
    warnings = []
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        other.step()
        warnings.append(watch.observe())
    assert warnings[0] is None
    assert (
        warnings[1] is not None
        and "not by the optimizer this Checkpointer restored" in (warnings[1])
    )
    watch.close()


def test_optimizer_watch_counts_a_sign_flip_of_zero_as_a_change():
    """-0.0 is not 0.0: the restored state turning a 0.0 into -0.0 is the optimizer at
    work (``torch.equal`` called them equal)."""
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    for state in opt.state.values():
        state["exp_avg"].zero_()
    watch = OptimizerWatch({None: opt})
    for state in opt.state.values():
        state["exp_avg"].neg_()  # 0.0 -> -0.0, in place, without step()
    assert watch.observe() is None
    assert watch.stepping and watch.done
