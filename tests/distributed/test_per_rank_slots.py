"""Extras and schedulers whose state differs between ranks are saved per rank (issue 10.4).

A shared slot is saved once; when its state differs between ranks at a save, each rank's
value is kept (the manifest entry becomes per rank) and comes back on its own rank.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from . import launcher, models

pytestmark = pytest.mark.distributed


class Holder:
    """A minimal stateful object: its state is the dict it holds."""

    def __init__(self, state: dict) -> None:
        self.state = state

    def state_dict(self) -> dict:
        return dict(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state = dict(state)


def _extras(rank: int) -> dict[str, Holder]:
    return {
        # a plain value that differs between ranks
        "counter": Holder({"value": 10 * rank + 1, "label": f"rank{rank}"}),
        # a tensor that differs between ranks (same shape and dtype)
        "noise": Holder({"t": torch.arange(6, dtype=torch.float64) * (rank + 1) + 0.25}),
        # equal on every rank, with a tensor
        "shared": Holder({"t": torch.full((3,), 7, dtype=torch.int32), "n": 5}),
    }


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _save_and_restore(rank: int, world: int, path: str) -> dict:
    import unbroken as ub

    records = _Records()
    logging.getLogger("unbroken").addHandler(records)
    model, _ = models.build()
    saved = _extras(rank)
    ckpt = ub.Checkpointer(path, model=model, extra=saved)
    ckpt.save(1)
    ckpt.save(2)  # warned once, not at every save
    ckpt.close()
    doc = json.loads(Path(path, "step_00000002", "manifest.json").read_text())
    fresh = {name: Holder({}) for name in saved}
    fresh_model, _ = models.build(seed=4)
    report = ub.Checkpointer(path, model=fresh_model, extra=fresh).restore()
    return {
        "saved": {n: h.state for n, h in saved.items()},
        "restored": {n: h.state for n, h in fresh.items()},
        "report": report,
        "per_rank": {n: doc["components"][n]["per_rank"] for n in saved},
        "ranks": sorted(doc["components"]["counter"].get("ranks", {})),
        "warnings": records.messages,
    }


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k, v in a.items():
        w = b[k]
        if isinstance(v, torch.Tensor):
            if not (isinstance(w, torch.Tensor) and v.dtype == w.dtype and torch.equal(v, w)):
                return False
        elif v != w or type(v) is not type(w):
            return False
    return True


def test_extras_that_differ_between_ranks_come_back_per_rank(tmp_path):
    """An extra with a per-rank plain value and one with a per-rank tensor are saved per
    rank and restored on their own rank bit for bit; an extra equal on all ranks stays
    shared (and its tensor restores on every rank); one warning per component, rank 0."""
    path = str(tmp_path / "ckpt")
    results = launcher.run(_save_and_restore, 2, path)
    for rank, r in enumerate(results):
        assert r["report"].verified and r["report"].step == 2
        for name in ("counter", "noise", "shared"):
            assert _same(r["restored"][name], r["saved"][name]), (rank, name, r["restored"])
        assert r["per_rank"] == {"counter": True, "noise": True, "shared": False}
        assert r["ranks"] == ["0", "1"]
    warned = results[0]["warnings"]
    for name in ("counter", "noise"):
        about = [w for w in warned if repr(name) in w]
        assert len(about) == 1 and "per rank" in about[0], warned
    assert not any("'shared'" in w for w in warned), warned
    assert results[1]["warnings"] == []


def test_per_rank_extra_cannot_move_to_another_world_size(tmp_path):
    """An extra saved per rank (it differed between ranks) is refused on another world
    size, naming it, as the dataloader is; reset= starts it fresh on purpose."""
    import unbroken as ub

    path = str(tmp_path / "ckpt")
    launcher.run(_save_and_restore, 2, path)
    model, _ = models.build(seed=4)
    fresh = {name: Holder({}) for name in ("counter", "noise", "shared")}
    ckpt = ub.Checkpointer(path, model=model, extra=fresh)
    with pytest.raises(ub.IncompleteCheckpointError, match=r"'counter'.*differed between ranks"):
        ckpt.restore(reset={"rng"})
    report = ckpt.restore(reset={"rng", "counter", "noise"})
    assert report.components["counter"] == "reset" and report.components["shared"] == "restored"
    assert _same(fresh["shared"].state, _extras(0)["shared"].state)
    assert fresh["counter"].state == {}
