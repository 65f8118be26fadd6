"""The mistakes users make are loud (issue 11): each would otherwise end in a silent fresh
start, a mixed run or a swallowed interrupt (DESIGN.md F3: nothing starts fresh silently)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import unbroken as ub
from conftest import Problem
from unbroken.format import shard_writer


def test_ctrl_c_during_save_propagates_unchanged(ckpt_dir, monkeypatch):
    """Ctrl-C during save(): the KeyboardInterrupt reaches the caller as itself (a loop
    catching CheckpointError must not swallow it), the partial save is cleaned up, the
    last committed checkpoint is untouched, and the next save works."""
    p = Problem()
    ckpt = p.checkpointer(ckpt_dir)
    ckpt.save(1)

    def interrupted(self, plan, planner):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(shard_writer.ShardWriter, "write_data", interrupted)
        with pytest.raises(KeyboardInterrupt):
            try:
                ckpt.save(2)
            except ub.CheckpointError:  # the disk-full pattern of our docs
                pytest.fail("the interrupt became a CheckpointError")
    assert ckpt.steps() == [1]
    assert not [e for e in ckpt_dir.iterdir() if e.name.startswith(".partial")]
    ckpt.save(2)
    assert ckpt.steps() == [1, 2]


@pytest.mark.parametrize(
    "step",
    [np.int64(3), np.int32(3), torch.tensor(3), torch.tensor(3, dtype=torch.int32)],
    ids=["np.int64", "np.int32", "tensor-int64", "tensor-int32"],
)
def test_step_accepts_numpy_and_0d_integer_tensors(ckpt_dir, step):
    """save(step) and track(step) take the integer types training loops hold."""
    p = Problem()
    ckpt = p.checkpointer(ckpt_dir)
    ckpt.track(step, loss=1.0)
    ckpt.save(step)
    assert ckpt.steps() == [3]
    assert isinstance(ckpt.steps()[0], int)


@pytest.mark.parametrize("step", [3.0, torch.tensor(3.0), torch.tensor([3]), True, -1], ids=str)
def test_step_refuses_what_is_not_a_step(ckpt_dir, step):
    """A float, a vector, a bool or a negative number is not a step: a clear ValueError."""
    with pytest.raises(ValueError, match="step must be"):
        Problem().checkpointer(ckpt_dir).save(step)


def test_plain_dataloader_error_names_the_fix(ckpt_dir):
    """A plain torch DataLoader: the error says which stateful loader to use, or the
    documented minimal wrapper for a DistributedSampler loop."""
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2)
    with pytest.raises(TypeError, match=r"StatefulDataLoader.*docs/pitfalls\.md"):
        Problem().checkpointer(ckpt_dir, dataloader=loader)


def _train_step(p: Problem, x: torch.Tensor, y: torch.Tensor) -> float:
    loss = (p.model(x) - y).pow(2).mean()
    p.opt.zero_grad()
    loss.backward()
    p.opt.step()
    return loss.item()


def _shuffled_run(ckpt_dir, *, total: int, stop: int | None, generator: bool, seed: int):
    """The README quickstart loop around a model with dropout and a shuffled loader."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    xs = torch.randn(40, 4, generator=torch.Generator().manual_seed(0))
    data = list(zip(xs, torch.sin(xs).sum(1, keepdim=True), strict=True))
    p = Problem(seed=seed)  # seeds the global RNG: the resumed process starts elsewhere
    gen = torch.Generator().manual_seed(7) if generator else None
    loader = StatefulDataLoader(data, batch_size=6, shuffle=True, generator=gen)
    ckpt = p.checkpointer(ckpt_dir, dataloader=loader)
    report = ckpt.restore()
    losses, step = [], report.step
    while step < total:
        for x, y in loader:
            losses.append(_train_step(p, x, y))
            step += 1
            if step in (stop, total):
                ckpt.save(step)
                break
        if step == stop:
            break
    ckpt.close()
    return losses


@pytest.mark.parametrize("generator", [False, True], ids=["global-rng", "own-generator"])
@pytest.mark.parametrize("stop", [3, 7, 14], ids=["mid-epoch", "at-epoch-end", "next-epoch"])
def test_shuffled_loader_with_dropout_resumes_exactly(tmp_path, generator, stop):
    """The quickstart resumes exactly with dropout and a shuffled StatefulDataLoader
    across epoch ends: the iterator's seed draw no longer shifts the dropout masks, and the
    loader's generator shuffles the next epoch as in an uninterrupted run."""
    straight = _shuffled_run(tmp_path / "a", total=20, stop=None, generator=generator, seed=0)
    first = _shuffled_run(tmp_path / "b", total=20, stop=stop, generator=generator, seed=0)
    resumed = _shuffled_run(tmp_path / "b", total=20, stop=None, generator=generator, seed=1)
    assert first + resumed == straight


def _doc_recipe() -> dict:
    """The DistributedSampler recipe exactly as docs/pitfalls.md shows it."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).parents[2] / "docs" / "pitfalls.md").read_text()
    code = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    namespace: dict = {}
    exec(code, namespace)
    return namespace


def _sampler_run(ckpt_dir, *, total: int, stop: int | None, seed: int) -> list[float]:
    from torch.utils.data import DataLoader, DistributedSampler

    recipe = _doc_recipe()
    xs = torch.randn(30, 4, generator=torch.Generator().manual_seed(0))
    dataset = list(zip(xs, torch.sin(xs).sum(1, keepdim=True), strict=True))
    p = Problem(seed=seed)
    generator = torch.Generator()
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=3)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler, generator=generator)
    position = recipe["EpochPosition"]()
    ckpt = p.checkpointer(ckpt_dir, extra={"position": position})
    step = ckpt.restore().step
    losses = []
    for x, y in recipe["batches"](loader, sampler, generator, position, 3):
        losses.append(_train_step(p, x, y))
        step += 1
        if step in (stop, total):
            ckpt.save(step)
            break
    ckpt.close()
    return losses


@pytest.mark.parametrize("stop", [3, 8, 12], ids=["mid-epoch", "at-epoch-end", "next-epoch"])
def test_documented_distributed_sampler_recipe_resumes_exactly(tmp_path, stop):
    """A plain DataLoader over a DistributedSampler, with the wrapper docs/pitfalls.md
    documents (epoch + batches consumed), resumes bit for bit with dropout."""
    straight = _sampler_run(tmp_path / "a", total=20, stop=None, seed=0)
    first = _sampler_run(tmp_path / "b", total=20, stop=stop, seed=0)
    resumed = _sampler_run(tmp_path / "b", total=20, stop=None, seed=1)
    assert first + resumed == straight


def test_relaunch_without_the_optimizer_is_an_error_unless_skipped(ckpt_dir):
    """Relaunch without optimizer= (the postmortems' bug: AdamW moments stay empty and the
    next save drops them for good): restore() raises naming it; skip= leaves it out on
    purpose, recorded in the lineage."""
    p = Problem()
    for _ in range(3):
        p.step()
    p.checkpointer(ckpt_dir).save(3)

    q = Problem(seed=1)
    before = {k: v.clone() for k, v in q.model.state_dict().items()}
    forgetful = ub.Checkpointer(ckpt_dir, model=q.model, scheduler=q.sched)
    with pytest.raises(ub.StateMismatchError, match=r"'optimizer'.*skip=\{'optimizer'\}"):
        forgetful.restore()
    for k, v in q.model.state_dict().items():  # nothing was installed
        assert torch.equal(v, before[k])
    report = forgetful.restore(skip={"optimizer"})
    assert report.restored and report.components["optimizer"] == "absent"
    forgetful.save(4)
    from unbroken.format import manifest

    doc = manifest.read(ckpt_dir / "step_00000004")
    assert doc["lineage"][-1]["skipped"] == ["optimizer"]
    with pytest.raises(ValueError, match="use reset="):
        ub.Checkpointer(ckpt_dir, model=q.model, optimizer=q.opt).restore(skip={"optimizer"})


@pytest.mark.parametrize(
    ("layout", "found"),
    [
        ("missing", "does not exist"),
        ("empty", "is empty"),
        ("hf", r"checkpoint-1000/, checkpoint-500/.*another tool"),
    ],
)
def test_required_checkpoint_and_what_a_fresh_start_found(tmp_path, monkeypatch, layout, found):
    """No checkpoint where one was expected (a typo, another tool's layout): the fresh-start
    report says where it looked and what it found; require=True or
    UNBROKEN_REQUIRE_CHECKPOINT=1 makes it an error."""
    folder = tmp_path / "run"
    if layout != "missing":
        folder.mkdir()
    if layout == "hf":
        (folder / "checkpoint-500").mkdir()
        (folder / "checkpoint-1000").mkdir()
    report = Problem().checkpointer(folder).restore()
    assert not report.restored and report.searched == str(folder)
    assert __import__("re").search(found, report.found) and found.split(".")[0][:6] in str(report)
    assert bool(report.warnings) == (layout == "hf")
    with pytest.raises(ub.CheckpointNotFoundError, match=found):
        Problem().checkpointer(folder).restore(require=True)
    monkeypatch.setenv("UNBROKEN_REQUIRE_CHECKPOINT", "1")
    with pytest.raises(ub.CheckpointNotFoundError, match="a checkpoint is required"):
        Problem().checkpointer(folder).restore()
    assert not Problem().checkpointer(folder).restore(require=False).restored


def test_a_new_run_cannot_save_into_another_runs_folder(ckpt_dir):
    """Saving into a used folder without restoring: retention would delete steps of both
    runs and restore() would pick either. The save raises naming what to do; overwrite=True
    replaces the old run (its checkpoints retired, not deleted); each run has an identity."""
    old = Problem()
    old_ckpt = old.checkpointer(ckpt_dir)
    old_ckpt.save(10)
    old_ckpt.save(20)

    new = Problem(seed=1)
    with pytest.raises(ub.CheckpointError, match=r"another run.*restore\(\).*overwrite=True"):
        new.checkpointer(ckpt_dir).save(5)
    assert old_ckpt.steps() == [10, 20]

    replacing = new.checkpointer(ckpt_dir, overwrite=True)
    assert not replacing.restore().restored  # the old run's checkpoints are ignored
    replacing.save(5)
    assert replacing.steps() == [5]
    assert sorted(e.name[:21] for e in ckpt_dir.iterdir() if e.name.startswith(".retired")) == [
        ".retired-step_0000001",
        ".retired-step_0000002",
    ]
    from unbroken.format import manifest

    runs = {manifest.read(ckpt_dir / "step_00000005")["lineage"][0]["run"]}
    resumed = Problem(seed=2).checkpointer(ckpt_dir)
    assert resumed.restore().step == 5
    resumed.save(6)  # the same run, continued
    runs.add(manifest.read(ckpt_dir / "step_00000006")["lineage"][0]["run"])
    assert len(runs) == 1
