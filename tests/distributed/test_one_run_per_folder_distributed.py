"""One run per folder on 2 gloo ranks: rank 0 decides, every rank raises alike.

Two DDP Checkpointers in one folder (an actor and a critic of one job): the second's
save is refused on both ranks with the same error, nothing of it is committed, and its
tracked steps never reach the first's record (issue 26, items 6 and 7).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from . import launcher, models

pytestmark = pytest.mark.distributed


def _two_in_one_folder(rank: int, world: int, path: str, async_save: bool) -> dict:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import unbroken as ub

    runs = []
    for seed in (0, 1):
        model, _ = models.build(seed=seed)
        ddp = DDP(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        ckpt = ub.Checkpointer(path, model=ddp, optimizer=opt, async_save=async_save)
        ckpt.restore()
        runs.append((ddp, opt, ckpt))
    for step in (1, 2):
        for i, (ddp, opt, ckpt) in enumerate(runs):
            (loss,) = models.train_steps(ddp, opt, 1, rank=rank, start=step)
            ckpt.track(step, loss=loss + 1000.0 * i)  # the critic's values stand out
    runs[0][2].save(2)
    runs[0][2].wait()
    error = None
    try:
        runs[1][2].save(2)
        runs[1][2].wait()
    except ub.CheckpointError as exc:
        error = (type(exc).__name__, str(exc).removeprefix("[rank 0] "))
    for _, _, ckpt in runs:
        ckpt.close()
    return {
        "error": error,
        "steps": runs[0][2].steps(),
        "run": runs[0][2]._run._lineage.events[0]["run"],
    }


@pytest.mark.parametrize("async_save", [False, True])
def test_the_second_checkpointer_is_refused_on_every_rank(tmp_path, async_save):
    path = str(tmp_path / "ckpt")
    ranks = launcher.run(_two_in_one_folder, 2, path, async_save)
    assert ranks[0]["error"] is not None and ranks[0]["error"] == ranks[1]["error"]
    kind, message = ranks[0]["error"]
    assert kind == "OtherRunError" and "step 2" in message and ranks[0]["run"] in message
    assert [r["steps"] for r in ranks] == [[2], [2]]
    lineage = json.loads((Path(path) / "step_00000002" / "manifest.json").read_text())["lineage"]
    assert lineage[0]["run"] == ranks[0]["run"]
    lines = [json.loads(x) for x in (Path(path) / "metrics.jsonl").read_text().splitlines()]
    assert all(x["metrics"]["loss"] < 1000 for x in lines if "metrics" in x)
