"""The local tier across nodes (issue 37): two torchrun agents on 127.0.0.1, each with
its own local folder standing for its node's memory (``SHM/node_G``).

One run trains to step 4 (a persistent save at 2, local saves at 3 and 4, replicated),
then every process dies at step 5's local save, node 1 killed just before it commits
(node 0 committed its part): the crash of a job mid-save. Each test restarts from a copy
of what that run left, damaged as the test says, and compares with an uninterrupted run,
bit for bit. DESIGN.md F2 (a resume that is not the uninterrupted run), for the copy a
restore takes from memory or from a peer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import unbroken as ub
from conftest import assert_identical

from . import agents

pytestmark = pytest.mark.distributed
SCRIPT = Path(__file__).parent / "scripts" / "tier_train.py"
END = 6


def _records(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"rank_{r}.json").read_text()) for r in range(world)]


def _same_state(got: Path, want: Path) -> None:
    assert_identical(torch.load(got, weights_only=True), torch.load(want, weights_only=True))


@pytest.fixture(scope="module")
def crashed(tmp_path_factory) -> dict[str, Path]:
    """The uninterrupted reference, and what the crashed run left (ckpt, shm)."""
    root = tmp_path_factory.mktemp("tiers")
    ref = root / "ref"
    ref.mkdir()
    agents.launch(
        SCRIPT,
        2,
        [str(root / "ref_ckpt"), str(root / "ref_shm"), "--out", str(ref), "--steps", str(END)],
        ref / "logs",
    )
    run = root / "run"
    run.mkdir()
    args = [str(root / "ckpt"), str(root / "shm"), "--out", str(run), "--steps", "5"]
    codes = agents.launch(
        SCRIPT, 2, [*args, "--saves", "--die-node", "1"], run / "logs", check=False
    )
    assert any(codes), "the run was to die at step 5's local save"
    for r in _records(run, 2):
        assert r["losses"]["4"] < r["losses"]["1"], r  # it learns
    assert (root / "shm" / "node_0").is_dir()
    # Kept aside: each test restarts the job at the same paths (the local tier's folder
    # is named after the persistent folder's path), from a fresh copy.
    shutil.copytree(root / "ckpt", root / "pristine_ckpt")
    shutil.copytree(root / "shm", root / "pristine_shm")
    return {"root": root, "ref": ref, "run": run}


def _job(shm: Path, node: int) -> Path:
    (folder,) = [p for p in (shm / f"node_{node}").iterdir() if p.is_dir()]
    return folder


def _restart(
    crashed: dict[str, Path], name: str, damage=None, *, nodes: int = 2, extra: list[str] = ()
) -> tuple[Path, list[dict]]:
    """Restart from a copy of the crashed run's folders, damaged by ``damage(shm)``."""
    root = crashed["root"]
    for name_ in ("ckpt", "shm"):
        shutil.rmtree(root / name_, ignore_errors=True)
        shutil.copytree(root / f"pristine_{name_}", root / name_)
    if damage is not None:
        damage(root / "shm")
    here = root / name
    out = here / "out"
    out.mkdir(parents=True)
    args = [str(root / "ckpt"), str(root / "shm"), "--out", str(out), "--steps", str(END)]
    agents.launch(SCRIPT, nodes, [*args, "--resume", *extra], out / "logs")
    return out, _records(out, nodes)


def _continues_exactly(crashed, out: Path, records: list[dict], step: int) -> None:
    """Restored at ``step``, verified, and the rest of the run is the uninterrupted one."""
    ref = _records(crashed["ref"], 2)
    for r, want in zip(records, ref, strict=True):
        assert r["report"]["step"] == step and r["report"]["verified"], r["report"]
        for s in range(step + 1, END + 1):
            assert r["losses"][str(s)] == want["losses"][str(s)], (s, r, want)
    _same_state(out / f"full_{END}.pt", crashed["ref"] / f"full_{END}.pt")


def test_every_process_killed_restores_from_the_local_tier(crashed):
    """(a, f) Restart on both nodes: local step 4 (newer than persistent step 2) is
    restored from each node's own memory; step 5, committed on node 0 only when node 1
    died, is never chosen, and the report says why."""
    out, records = _restart(crashed, "a")
    for r in records:
        assert r["report"]["source"] == "local", r["report"]
        assert any("local step 5 could not be used" in w for w in r["report"]["warnings"]), r
    _same_state(out / "full_restored.pt", crashed["run"] / "full_4.pt")
    _continues_exactly(crashed, out, records, 4)


def test_a_replaced_node_is_restored_from_its_peers_replica(crashed):
    """(b) Node 1 replaced: its folder is empty; its rank's shard comes from node 0's
    replica (``source == "peer"``), exact."""
    out, records = _restart(crashed, "b", lambda shm: shutil.rmtree(shm / "node_1"))
    for r in records:
        assert r["report"]["source"] == "peer", r["report"]
    _continues_exactly(crashed, out, records, 4)


def test_a_lost_node_without_a_spare_reshards_from_the_survivors_copies(crashed):
    """(c) Node 1 lost, no spare: one agent, one rank, restored from node 0's own shard
    and its replica of node 1's, resharded, verified; the state is the saved one."""
    out, records = _restart(crashed, "c", nodes=1, extra=["--reset-rng"])
    (r,) = records
    report = r["report"]
    assert report["source"] == "local" and report["step"] == 4, report
    assert report["verified"] and report["resharded"], report
    assert (report["saved_world_size"], report["world_size"]) == (2, 1), report
    _same_state(out / "full_restored.pt", crashed["run"] / "full_4.pt")


def test_a_damaged_copy_is_skipped_for_the_other_one(crashed):
    """(d) A flipped byte in node 1's own copy of rank 1's shard: found when rank 1 reads
    it (nothing live changed), every copy then checked, node 1's named and skipped, and
    node 0's replica sent to node 1 instead (``"peer"``), exact."""

    def flip(shm: Path) -> None:
        path = _job(shm, 1) / "step_00000004" / "rank_00001.bin"
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x10
        path.write_bytes(bytes(data))

    out, records = _restart(crashed, "d", flip)
    for r in records:
        assert r["report"]["source"] == "peer", r["report"]
        assert any(
            "node 1's copy of rank_00001.bin fails the checksum" in w
            for w in r["report"]["warnings"]
        ), r["report"]["warnings"]
    _continues_exactly(crashed, out, records, 4)


def test_both_copies_gone_fall_back_to_the_persistent_step(crashed):
    """(e) Rank 1's shard gone from both nodes (its own and the replica) at every local
    step: the newest persistent step (2), each newer local step named."""

    def lose(shm: Path) -> None:
        for node in (0, 1):
            for step in _job(shm, node).glob("step_*"):
                (step / "rank_00001.bin").unlink(missing_ok=True)

    out, records = _restart(crashed, "e", lose)
    for r in records:
        report = r["report"]
        assert report["source"] == "persistent", report
        for step in (4, 3):
            assert any(f"local step {step} could not be used" in w for w in report["warnings"])
    _continues_exactly(crashed, out, records, 2)


def test_three_nodes_a_replaced_node_fetches_what_its_ranks_read(tmp_path):
    """Three agents, replicas on the next node of the ring: node 2 replaced (its folder
    wiped) takes its rank's shard from node 0's replica, and what else its rank reads
    from the others (``"peer"``); the restored state is the saved one, bit for bit.
    Nodes 0 and 1 each hold two of the three shards: each reads its own."""
    run = tmp_path / "run"
    run.mkdir()
    args = [str(tmp_path / "ckpt"), str(tmp_path / "shm"), "--out", str(run), "--steps", "4"]
    agents.launch(SCRIPT, 3, [*args, "--saves"], run / "logs")
    for node, held in ((0, ["rank_00000.bin", "rank_00002.bin"]), (1, ["rank_00000.bin",
                       "rank_00001.bin"]), (2, ["rank_00001.bin", "rank_00002.bin"])):  # fmt: skip
        step = _job(tmp_path / "shm", node) / "step_00000004"
        assert sorted(p.name for p in step.glob("rank_*")) == held, node
    node_1 = ub.verify_checkpoint(_job(tmp_path / "shm", 1))  # two of three shards
    assert node_1.ok, node_1
    (checked,) = node_1.checkpoints
    assert any("rank_00002.bin is not on this node" in w for w in checked.warnings), checked
    shutil.rmtree(tmp_path / "shm" / "node_2")
    out = tmp_path / "out"
    out.mkdir()
    args = [str(tmp_path / "ckpt"), str(tmp_path / "shm"), "--out", str(out), "--steps", "4"]
    agents.launch(SCRIPT, 3, [*args, "--resume"], out / "logs")
    for r in _records(out, 3):
        report = r["report"]
        assert (report["step"], report["source"], report["verified"]) == (4, "peer", True), r
    _same_state(out / "full_restored.pt", run / "full_4.pt")
