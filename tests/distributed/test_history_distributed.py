"""Branches and the replay check on 2 gloo ranks: every rank reaches the same decision."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from . import launcher, models

pytestmark = pytest.mark.distributed


def _ddp_run(rank: int, world: int, path: str, restore_step: int | None, saves: tuple,
             upto: int, close: bool) -> dict:  # fmt: skip
    """DDP training that tracks rank 0's loss every step and saves at ``saves``."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import unbroken as ub

    model, _ = models.build(seed=7 if restore_step else 0)
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    ckpt = ub.Checkpointer(path, model=ddp, optimizer=opt, keep_last=None)
    start = ckpt.restore(step=restore_step).step
    for step in range(start, upto):
        (loss,) = models.train_steps(ddp, opt, 1, rank=rank, start=step)
        ckpt.track(step + 1, loss=loss)
        if step + 1 in saves:
            ckpt.save(step + 1)
    if close:  # else: a crash, as far as the checkpoints are concerned
        ckpt.close()
    return {"steps": ckpt.steps(), "replay": ckpt.replay}


def test_rollback_and_replay_on_two_ranks(tmp_path):
    """2 ranks: a run saves 2, 3, 4 and tracks to 6, then dies; a rollback to 2 saves 3'
    and 6': both ranks retire 3 and 4 alike, and both end with rank 0's replay verdict
    (identical over steps 3..6). Restored at world size 1, the replay is skipped, saying
    why."""
    import unbroken as ub

    path = str(tmp_path / "ckpt")
    launcher.run(_ddp_run, 2, path, None, (2, 3, 4), 6, False)
    ranks = launcher.run(_ddp_run, 2, path, 2, (3, 6), 6, True)
    assert [r["steps"] for r in ranks] == [[2, 3, 6], [2, 3, 6]]
    for r in ranks:
        assert (r["replay"].status, r["replay"].compared_steps) == ("identical", 4)
    assert ranks[0]["replay"] == ranks[1]["replay"]
    root = Path(path)
    event = json.loads((root / "step_00000006" / "manifest.json").read_text())["lineage"][-1]
    assert (event["from_step"], event["retired"]) == (2, [3, 4])
    assert sorted(p.name.split("-")[1] for p in root.glob(".retired-*")) == [
        "step_00000003",
        "step_00000004",
    ]

    model, opt = models.build(seed=9)
    single = ub.Checkpointer(path, model=model, optimizer=opt)
    single.restore(step=3, reset={"rng"})
    verdict = single.replay
    assert verdict.status == "skipped" and "world size 2" in verdict.reason
    single.close()
