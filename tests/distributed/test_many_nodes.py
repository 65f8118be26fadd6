"""Many nodes (issue 28): several torchrun agents, one rendezvous, one shared folder.

Each node is a torchrun agent (``--nnodes K --nproc-per-node 1``) started as its own
process on this machine, the agents meeting through a c10d rendezvous on loopback, as
agents on separate hosts would. Two nodes train FSDP2 (one mesh over every rank of the
job) and save into one shared folder and one ``s3://`` prefix; the run is resumed on one
node and on three (and from the store on one), and the gathered state after the restore
equals the one saved, bit for bit (DESIGN.md F2). Every launch runs under a timeout;
whatever still runs then (agents and their workers) is killed, so nothing is left waiting.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from . import agents

pytestmark = pytest.mark.distributed
SCRIPT = Path(__file__).parent / "scripts" / "many_nodes_train.py"
STEPS = 4
URL = "s3://nodes/run"


def _launch(nodes: int, args: list[str], logs: Path, env: dict[str, str] | None = None) -> None:
    agents.launch(SCRIPT, nodes, args, logs, env)


def _records(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"rank_{r}.json").read_text()) for r in range(world)]


def _assert_same(got, want, where: str = "state") -> None:
    """Bit for bit, dtypes and types included, at every level."""
    assert type(got) is type(want), f"{where}: {type(got).__name__} vs {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert list(got) == list(want), f"{where}: keys {list(got)} vs {list(want)}"
        for k in want:
            _assert_same(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_same(g, w, f"{where}/{i}")
    else:
        assert got == want, f"{where}: {got!r} vs {want!r}"


def _full(out: Path) -> dict:
    return torch.load(out / "full.pt", weights_only=True)


@pytest.fixture(scope="module")
def store(s3_server):
    """moto's S3 server on loopback with a bucket ``nodes``; the agents find it through
    the environment (``S3Server.env``), as tests/distributed/test_fsdp_s3.py points its
    ranks at it."""
    s3_server.bucket("nodes")
    return s3_server


@pytest.fixture(scope="module")
def saved_on_two_nodes(tmp_path_factory, store) -> tuple[Path, Path]:
    """Two nodes train, then save step STEPS into a local folder and into ``URL`` (one
    Checkpointer each); rank 0's gathered state after the saves is in ``saved/full.pt``."""
    root = tmp_path_factory.mktemp("many_nodes")
    ckpt, saved = root / "ckpt", root / "saved"
    saved.mkdir()
    args = [str(ckpt), URL, "--out", str(saved), "--steps", str(STEPS)]
    _launch(2, args, saved / "logs", store.env)
    records = _records(saved, 2)
    assert sorted(r["node"] for r in records) == [0, 1]  # one rank per node
    for r in records:
        assert r["world"] == 2 and r["losses"][-1] < r["losses"][0], r  # it learns
    return ckpt, saved


def _resume(folder: str, nodes: int, saved: Path, out: Path, env: dict[str, str] | None = None):
    """Resume on ``nodes`` nodes: every rank's report says restored, verified, resharded;
    the gathered state equals the saved one bit for bit."""
    out.mkdir(parents=True)
    _launch(nodes, [folder, "--out", str(out), "--resume"], out / "logs", env)
    for r in _records(out, nodes):
        assert r["restored"] and r["step"] == STEPS, r
        assert r["verified"] and r["resharded"], r
        assert (r["saved_world_size"], r["world_size"]) == (2, nodes), r
        restored = {"model": "restored", "optimizer": "restored", "scheduler": "restored"}
        assert r["components"] == {**restored, "rng": "reset"}, r
        assert r["last_epoch"] == STEPS, r
    _assert_same(_full(out), _full(saved))


def test_two_nodes_write_one_folder(saved_on_two_nodes):
    """Each node's rank writes its own shard into the shared folder; one manifest."""
    ckpt, _ = saved_on_two_nodes
    step = ckpt / f"step_{STEPS:08d}"
    files = ["manifest.json", "rank_00000.bin", "rank_00001.bin"]
    assert sorted(p.name for p in step.iterdir()) == files
    assert json.loads((step / "manifest.json").read_text())["world_size"] == 2


@pytest.mark.parametrize("nodes", [1, 3], ids=["on-one-node", "on-three-nodes"])
def test_resume_on_another_number_of_nodes_is_bit_exact(saved_on_two_nodes, tmp_path, nodes):
    ckpt, saved = saved_on_two_nodes
    _resume(str(ckpt), nodes, saved, tmp_path / "resumed")


def test_two_nodes_save_to_s3_resumed_on_one(saved_on_two_nodes, store, tmp_path):
    """The same through an object store: each node's rank uploads its own shard object
    of the one save, rank 0 commits the manifest; one node restores it bit for bit."""
    _, saved = saved_on_two_nodes
    got = store.client().list_objects_v2(Bucket="nodes", Prefix=f"run/step_{STEPS:08d}/")
    names = sorted(o["Key"].rsplit("/", 1)[1] for o in got["Contents"])
    assert names[0] == "manifest.json" and len(names) == 3, names
    assert [n.split("-")[0] for n in names[1:]] == ["rank_00000", "rank_00001"], names
    assert len({n.removesuffix(".bin").split("-")[1] for n in names[1:]}) == 1, names
    _resume(URL, 1, saved, tmp_path / "resumed", store.env)
