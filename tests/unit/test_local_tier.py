"""The local tier in one process (one node): save, retention, restore and fallback, and
the refusals at construction (issue 37). The multi-node cases (replicas, peers, a lost
node) are in tests/distributed/test_local_tier.py.

DESIGN.md F2 and F3 for a copy in memory: a resume from the local tier is the
uninterrupted run bit for bit, or it does not happen and the report says why.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

import unbroken as ub
from conftest import Problem, assert_same_training_state
from unbroken.tiers import local_save, store

pytestmark = pytest.mark.filterwarnings("ignore:LocalTier.*one node:UserWarning")


def _tier(tmp_path: Path, **kwargs) -> ub.LocalTier:
    return ub.LocalTier(tmp_path / "shm", **kwargs)


def _steps_folder(tmp_path: Path) -> Path:
    (job,) = [p for p in (tmp_path / "shm").iterdir() if p.is_dir()]
    return job


def _crashed_run(tmp_path, ckpt_dir, local_steps=(3, 4), **options):
    """A Problem trained to 4 steps, step 2 saved to the folder, ``local_steps`` to the
    local tier; then the uninterrupted run's next 3 losses (the global RNG is every
    Problem's: computed before any other draws)."""
    p = Problem()
    ckpt = p.checkpointer(ckpt_dir, local=_tier(tmp_path), **options)
    ckpt.restore()
    for step in range(1, 5):
        p.step()
        if step == 2:
            ckpt.save(step)
        if step in local_steps:
            ckpt.save(step, tier="local")
    ckpt.close()
    return p, [p.step() for _ in range(3)]


def test_a_local_step_newer_than_the_persistent_one_resumes_exactly(tmp_path, ckpt_dir):
    """A restart restores local step 4 (the folder has step 2), verified, and trains on
    as the uninterrupted run does."""
    straight, expected = _crashed_run(tmp_path, ckpt_dir)
    torch.manual_seed(99)
    resumed = Problem(seed=7)
    ckpt = resumed.checkpointer(ckpt_dir, local=_tier(tmp_path))
    report = ckpt.restore()
    assert (report.step, report.source, report.verified) == (4, "local", True), report
    assert "(local tier)" in report.headline
    assert report.path == str(_steps_folder(tmp_path) / "step_00000004")
    assert [resumed.step() for _ in range(3)] == expected
    assert_same_training_state(resumed, straight)
    ckpt.save(7)  # the lineage records which tier the resume came from
    lineage = json.loads((Path(ckpt.path) / "step_00000007" / "manifest.json").read_text())
    assert lineage["lineage"][-1]["event"] == "resume"
    assert lineage["lineage"][-1]["tier"] == "local"
    ckpt.close()


def test_the_persistent_step_wins_when_it_is_newer(tmp_path, ckpt_dir):
    """Local steps older than the newest persistent one are not restored."""
    p = Problem()
    ckpt = p.checkpointer(ckpt_dir, local=_tier(tmp_path))
    ckpt.restore()
    p.step()
    ckpt.save(1, tier="local")
    p.step()
    ckpt.save(2)
    ckpt.close()
    report = Problem(seed=3).checkpointer(ckpt_dir, local=_tier(tmp_path)).restore()
    assert (report.step, report.source) == (2, "persistent"), report


def test_a_damaged_only_copy_falls_back_loudly_to_the_persistent_step(tmp_path, ckpt_dir):
    """A flipped byte in the only copy of local step 4, and step 3 truncated: each is named
    in the report, and the persistent step 2 is restored."""
    _crashed_run(tmp_path, ckpt_dir)
    job = _steps_folder(tmp_path)
    shard = job / "step_00000004" / "rank_00000.bin"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    short = job / "step_00000003" / "rank_00000.bin"
    short.write_bytes(short.read_bytes()[:-3])
    fresh = Problem(seed=3)
    ckpt = fresh.checkpointer(ckpt_dir, local=_tier(tmp_path))
    report = ckpt.restore()
    assert (report.step, report.source, report.verified) == (2, "persistent", True), report
    text = "\n".join(report.warnings)
    assert "local step 4: node 0's copy of rank_00000.bin fails the checksum" in text
    assert "local step 3 could not be used: no surviving node holds rank_00000.bin" in text
    # the abandoned local steps are gone: no later restart picks them up
    assert ckpt.steps(tier="local") == []
    ckpt.close()


def test_retention_keeps_the_last_local_steps(tmp_path, ckpt_dir):
    p = Problem()
    ckpt = p.checkpointer(ckpt_dir, local=_tier(tmp_path, keep_last=2))
    ckpt.restore()
    for step in range(1, 6):
        p.step()
        ckpt.save(step, tier="local")
    assert ckpt.steps(tier="local") == [4, 5]
    assert ckpt.steps() == []  # the persistent tier is untouched
    ckpt.close()


def test_overlapped_local_saves_resume_exactly(tmp_path, ckpt_dir):
    """async_save="overlap" stages local saves as it stages persistent ones."""
    straight, expected = _crashed_run(tmp_path, ckpt_dir, async_save="overlap")
    resumed = Problem(seed=7)
    report = resumed.checkpointer(ckpt_dir, local=_tier(tmp_path)).restore()
    assert (report.step, report.source) == (4, "local"), report
    assert [resumed.step() for _ in range(3)] == expected
    assert_same_training_state(resumed, straight)


def test_overwrite_ignores_and_drops_the_local_steps(tmp_path, ckpt_dir):
    _crashed_run(tmp_path, ckpt_dir)
    ckpt = Problem(seed=3).checkpointer(ckpt_dir, local=_tier(tmp_path), overwrite=True)
    report = ckpt.restore()
    assert not report.restored and report.source is None
    assert ckpt.steps(tier="local") == []
    ckpt.close()


def test_a_local_save_that_cannot_fit_warns_and_training_goes_on(tmp_path, ckpt_dir, monkeypatch):
    """No room for the shards: nothing committed, a warning, the previous local step and
    the persistent tier untouched, and the next save works again."""
    p = Problem()
    ckpt = p.checkpointer(ckpt_dir, local=_tier(tmp_path))
    ckpt.restore()
    p.step()
    ckpt.save(1, tier="local")
    real = shutil.disk_usage
    monkeypatch.setattr(local_save.shutil, "disk_usage", lambda path: real(path)._replace(free=100))
    p.step()
    ckpt.save(2, tier="local")  # never raises
    assert any("local step 2 not saved" in w and "100 B free" in w for w in ckpt.warnings)
    assert ckpt.steps(tier="local") == [1] and ckpt.steps() == []
    monkeypatch.undo()
    p.step()
    ckpt.save(3, tier="local")
    assert ckpt.steps(tier="local") == [1, 3]
    assert not [p for p in _steps_folder(tmp_path).iterdir() if p.name.startswith(".")]
    ckpt.close()


def test_a_folder_in_use_by_another_job_is_refused(tmp_path):
    first = Problem().checkpointer(tmp_path / "a", local=_tier(tmp_path))
    with pytest.raises(ub.CheckpointError, match=r"in use by the job saving into .*/a "):
        Problem().checkpointer(tmp_path / "b", local=_tier(tmp_path))
    first.close()
    Problem().checkpointer(tmp_path / "b", local=_tier(tmp_path)).close()  # free again


def test_a_folder_that_is_not_writable_is_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    tier = ub.LocalTier(blocker / "shm")
    with pytest.raises(ub.CheckpointError, match=r"file/shm is not writable"):
        Problem().checkpointer(tmp_path / "a", local=tier)
    assert blocker.read_text() == "not a folder"


def test_a_folder_too_small_is_refused_naming_both_sizes(tmp_path, monkeypatch):
    real = shutil.disk_usage
    monkeypatch.setattr(store.shutil, "disk_usage", lambda path: real(path)._replace(free=10))
    with pytest.raises(ub.CheckpointError, match=r"too small: .* need about .* and 10 B is free"):
        Problem().checkpointer(tmp_path / "a", local=_tier(tmp_path))
    monkeypatch.undo()
    Problem().checkpointer(tmp_path / "a", local=_tier(tmp_path)).close()  # lock let go


def test_a_network_file_system_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(store, "fs_type", lambda path: "nfs4")
    with pytest.raises(ub.CheckpointError, match=r"network file system \(nfs4\)"):
        Problem().checkpointer(tmp_path / "a", local=_tier(tmp_path))


def test_one_node_warns_that_no_replica_can_be_placed(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Problem().checkpointer(tmp_path / "a", local=_tier(tmp_path, replicas=1)).close()
    assert any("no replica can be placed" in str(w.message) for w in caught)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Problem().checkpointer(tmp_path / "b", local=_tier(tmp_path, replicas=0)).close()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"replicas": -1}, "replicas must be >= 0"),
        ({"keep_last": 0}, "keep_last must be >= 1"),
        ({"keep_last": True}, "keep_last must be an int"),
        ({"path": "s3://bucket/x"}, "is a URL"),
    ],
)
def test_bad_tier_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ub.LocalTier(**kwargs)


def test_the_tier_argument_is_checked(tmp_path, ckpt_dir):
    p = Problem()
    ckpt = p.checkpointer(ckpt_dir)
    with pytest.raises(ub.CheckpointError, match=r"needs a local tier: pass local="):
        ckpt.save(1, tier="local")
    with pytest.raises(ValueError, match=r'tier must be "persistent" or "local"'):
        ckpt.save(1, tier="memory")
    with pytest.raises(TypeError, match="LocalTier"):
        p.checkpointer(tmp_path / "x", local=str(tmp_path))
    ckpt.close()


def test_inspect_and_verify_read_a_nodes_local_steps(tmp_path, ckpt_dir):
    """A node's job folder is a run folder; the tier's folder points to its jobs."""
    _crashed_run(tmp_path, ckpt_dir)
    job = _steps_folder(tmp_path)
    assert ub.verify_checkpoint(job).ok
    assert [s.step for s in ub.inspect_checkpoint(job).checkpoints] == [3, 4]
    with pytest.raises(ub.CheckpointNotFoundError, match=r"is a local tier folder .*" + job.name):
        ub.inspect_checkpoint(tmp_path / "shm")


def test_the_resume_test_names_a_resume_that_did_not_come_from_the_local_tier():
    """resume-test --tier local: a resume restored from the persistent tier (or one whose
    lineage predates tiers) is NOT RESUMED, named; local and peer resumes pass."""
    from unbroken.proof.resume_lineage import tier_problem

    def resume(step, tier=None):
        event = {"event": "resume", "from_step": step}
        return event if tier is None else {**event, "tier": tier}

    start = {"event": "start"}
    assert tier_problem([10, 20], [start, resume(10, "local"), resume(20, "peer")]) is None
    found = tier_problem([10, 20], [start, resume(10, "local"), resume(20, "persistent")])
    assert found.startswith("the 2nd resume, from step 20 was restored from the persistent")
    assert "a tier its lineage does not name" in tier_problem([10], [start, resume(10)])


def test_the_replay_check_compares_the_steps_after_a_local_resume(tmp_path, ckpt_dir):
    """Steps the crashed run tracked after its last local save are recomputed by the
    resumed run and compared bit for bit, as after any resume."""
    p = Problem()
    ckpt = p.checkpointer(ckpt_dir, local=_tier(tmp_path))
    ckpt.restore()
    for step in range(1, 6):
        ckpt.track(step, loss=p.step())
        if step == 2:
            ckpt.save(step)
        if step == 4:
            ckpt.save(step, tier="local")
    ckpt.close()  # step 5 is tracked, not saved: the replay check's reference
    torch.manual_seed(123)  # restored from the checkpoint
    resumed = Problem(seed=7)
    again = resumed.checkpointer(ckpt_dir, local=_tier(tmp_path))
    assert again.restore().source == "local"
    again.track(5, loss=resumed.step())
    again.close()
    assert again.replay is not None and again.replay.status == "identical", again.replay
    assert again.replay.compared_steps == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("async_save", [False, "overlap"])
def test_gpu_state_resumes_exactly_from_the_local_tier(tmp_path, async_save):
    """On a GPU: the local tier saves CUDA state (staged through pinned memory with
    "overlap") and restores it onto the device, bit for bit, verified."""
    dev = torch.device("cuda")

    def build(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                    torch.nn.Linear(256, 1)).to(dev)  # fmt: skip
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)

    def step(model, opt, i):
        g = torch.Generator(device=dev).manual_seed(i)
        x = torch.randn(128, 64, device=dev, generator=g)
        loss = (model(x) - x.sin().sum(1, keepdim=True)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    model, opt = build(0)
    tier = _tier(tmp_path, replicas=0)
    ckpt = ub.Checkpointer(tmp_path / "run", model=model, optimizer=opt, local=tier,
                           async_save=async_save)  # fmt: skip
    ckpt.restore()
    for i in range(1, 5):
        step(model, opt, i)
        ckpt.save(i, tier="local")
    ckpt.close()
    expected = [step(model, opt, i) for i in range(5, 8)]
    model2, opt2 = build(1)
    again = ub.Checkpointer(tmp_path / "run", model=model2, optimizer=opt2, local=tier)
    report = again.restore()
    assert (report.step, report.source, report.verified) == (4, "local", True), report
    assert next(model2.parameters()).device.type == "cuda"
    assert [step(model2, opt2, i) for i in range(5, 8)] == expected
    again.close()
