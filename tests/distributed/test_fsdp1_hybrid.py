"""FSDP1 hybrid sharding (HSDP) checkpoints resume bit-exactly and reshard (DESIGN.md F2).

``HYBRID_SHARD`` and ``_HYBRID_SHARD_ZERO2`` on 4 ranks laid out as (2 replicas, 2
shards), built both ways FSDP1 takes: a 2-D ``device_mesh`` (its state comes as DTensors
on that mesh placed ``(Replicate(), Shard(0))``) and ``process_group=(intra, inter)``
(DTensors on a 1-D mesh over the shard group, one instance per replica). The same shard
lives on two ranks: it must be written once and counted once in the fingerprints.

Saved after 3 steps, each run is restored into the same layout and trained on: losses and
final state equal the uninterrupted run's, bit for bit. Each checkpoint also restores
into FSDP1 ``FULL_SHARD`` on 2 ranks, into FSDP2 HSDP on a 2-D mesh, and into one plain
process. One job saves, one restores on 4 ranks, one on 2.
"""

from __future__ import annotations

import pytest

from . import launcher, models

pytestmark = pytest.mark.distributed

# What each checkpoint is saved from, on 4 ranks: FSDP1 build options.
SAVED = {
    "hybrid_mesh": {"sharding": "HYBRID_SHARD", "hybrid": "mesh", "policy": "block"},
    "zero2_groups": {
        "sharding": "_HYBRID_SHARD_ZERO2",
        "hybrid": "groups",
        "use_orig_params": True,
        "policy": "size",
    },
}
MORE = 2  # steps trained after the save (uninterrupted) and after the restore


def _full(model, opt) -> dict:
    return models.full_state(model, opt, cpu_offload=False)


def _layouts(model, opt) -> set[str]:
    """How this rank's sharded model and optimizer state come: each DTensor's mesh (its
    ranks) and placements, and whether torch_compat.fsdp1_placements says so."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.tensor import DTensor

    from unbroken.live import fsdp1, torch_compat

    with fsdp1.sharded_state(model):
        tensors = list(get_model_state_dict(model).values())
        osd = FSDP.optim_state_dict(model, opt)
    tensors += [t for entry in osd["state"].values() for t in entry.values()]
    return {
        f"mesh {t.device_mesh.mesh.tolist()} placements {tuple(t.placements)}, as said: "
        f"{list(t.placements) == torch_compat.fsdp1_placements(t.device_mesh)}"
        if isinstance(t, DTensor)
        else f"{type(t).__name__} of {t.dim()} dims"
        for t in tensors
    }


def _save_all(rank: int, world: int, root: str) -> dict:
    """Worker (4 ranks): each SAVED run trained 3 steps and saved as step 3, then MORE
    steps on (the uninterrupted run): its losses, the full state at the save and at the
    end, and how its sharded state is laid out."""
    import unbroken as ub

    out: dict = {}
    for name, spec in SAVED.items():
        model, opt = models.build_fsdp1(0, **spec)
        models.train_steps(model, opt, 3, rank=rank)
        ub.Checkpointer(f"{root}/{name}", model=model, optimizer=opt).save(3)
        want = _full(model, opt)
        layouts = _layouts(model, opt)
        losses = models.train_steps(model, opt, MORE, rank=rank, start=3)
        out[name] = {"want": want, "losses": losses, "end": _full(model, opt), "layouts": layouts}
    return out


def _restore_on_four(rank: int, world: int, root: str) -> dict:
    """Worker (4 ranks): each checkpoint restored into its own layout (another seed) and
    trained MORE steps; the hybrid-mesh one also into FSDP2 HSDP."""
    from torch.distributed.device_mesh import init_device_mesh

    import unbroken as ub

    out: dict = {}
    for name, spec in SAVED.items():
        model, opt = models.build_fsdp1(123, **spec)
        report = ub.Checkpointer(f"{root}/{name}", model=model, optimizer=opt).restore()
        restored = _full(model, opt)
        losses = models.train_steps(model, opt, MORE, rank=rank, start=3)
        out[name] = {"report": report, "restored": restored, "losses": losses,
                     "end": _full(model, opt)}  # fmt: skip
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model, opt = models.build(123, fsdp_mesh=mesh)
    report = ub.Checkpointer(f"{root}/hybrid_mesh", model=model, optimizer=opt).restore()
    out["fsdp2_hsdp"] = {"report": report, "restored": _full(model, opt)}
    return out


def _restore_full_shard(rank: int, world: int, root: str) -> dict:
    """Worker (2 ranks): each checkpoint restored into FSDP1 FULL_SHARD, wrapped as saved."""
    import unbroken as ub

    out: dict = {}
    for name, spec in SAVED.items():
        plain = {k: v for k, v in spec.items() if k not in ("sharding", "hybrid")}
        model, opt = models.build_fsdp1(123, **plain)
        report = ub.Checkpointer(f"{root}/{name}", model=model, optimizer=opt).restore(
            reset={"rng"}
        )
        out[name] = {"report": report, "restored": _full(model, opt)}
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, list[dict]]:
    root = str(tmp_path_factory.mktemp("fsdp1_hybrid"))
    return root, launcher.run(_save_all, 4, root)


@pytest.fixture(scope="module")
def on_four(saved) -> list[dict]:
    return launcher.run(_restore_on_four, 4, saved[0])


@pytest.mark.parametrize("name", sorted(SAVED))
def test_hybrid_state_layout(saved, name):
    """F2 (a torch behaviour unbroken.live.torch_compat relies on): FSDP1 hybrid state
    comes as DTensors, on the 2-D mesh placed (Replicate, Shard(0)) or on a 1-D mesh over
    the shard group placed (Shard(0),), as fsdp1_placements says (the optimizer's load
    targets are placed so); never ShardedTensors."""
    _, per_rank = saved
    for rank, result in enumerate(per_rank):
        layouts = result[name]["layouts"] - {"Tensor of 0 dims"}  # AdamW's step
        if SAVED[name]["hybrid"] == "mesh":
            want = "mesh [[0, 1], [2, 3]] placements (Replicate(), Shard(dim=0))"
        else:
            want = f"mesh {[0, 1] if rank < 2 else [2, 3]} placements (Shard(dim=0),)"
        assert layouts == {want + ", as said: True"}, rank


@pytest.mark.parametrize("name", sorted(SAVED))
def test_restore_then_train_matches_uninterrupted(saved, on_four, name):
    """F2: a hybrid-sharded run saved and restored into the same layout (built from
    another seed) holds the saved state, is verified against fingerprints counting each
    replicated shard once, and trains on with the uninterrupted run's losses on every
    rank and its final parameters and optimizer state, bit for bit."""
    _, straight = saved
    for rank, result in enumerate(on_four):
        got = result[name]
        assert got["report"].verified and not got["report"].resharded, rank
        assert got["report"].components["optimizer"] == "restored", rank
        assert got["report"].components["rng"] == "restored", rank
        assert got["losses"] == straight[rank][name]["losses"], rank
    models.assert_same_full_state(on_four[0][name]["restored"], straight[0][name]["want"])
    models.assert_same_full_state(on_four[0][name]["end"], straight[0][name]["end"])


def test_hybrid_into_fsdp2_hsdp(saved, on_four):
    """F2: an FSDP1 HYBRID_SHARD checkpoint restores exactly into FSDP2 HSDP (fully_shard
    on a ("replicate", "shard") mesh), the layout FSDP1 users move to."""
    _, straight = saved
    for rank, result in enumerate(on_four):
        report = result["fsdp2_hsdp"]["report"]
        assert report.verified and report.components["optimizer"] == "restored", rank
    models.assert_same_full_state(
        on_four[0]["fsdp2_hsdp"]["restored"], straight[0]["hybrid_mesh"]["want"]
    )


def test_hybrid_to_full_shard_on_two_ranks(saved):
    """F2: a hybrid checkpoint of 4 ranks restores exactly into FSDP1 FULL_SHARD on 2
    (each shard read once, whichever replica wrote it; verified)."""
    root, straight = saved
    results = launcher.run(_restore_full_shard, 2, root)
    for name in SAVED:
        for rank, result in enumerate(results):
            report = result[name]["report"]
            assert report.verified and report.resharded, (name, rank)
            assert (report.saved_world_size, report.world_size) == (4, 2), (name, rank)
        models.assert_same_full_state(results[0][name]["restored"], straight[0][name]["want"])


@pytest.mark.parametrize("name", sorted(SAVED))
def test_hybrid_to_one_plain_process(saved, name):
    """F2: a hybrid checkpoint restores exactly into the unwrapped model in one process;
    its fingerprints, added up at save over 4 ranks holding each shard twice, match those
    of the whole tensors (a replica counted twice would fail verification)."""
    import unbroken as ub

    root, straight = saved
    model, opt = models.build(seed=123)
    report = ub.Checkpointer(f"{root}/{name}", model=model, optimizer=opt).restore(reset={"rng"})
    assert report.verified and report.saved_world_size == 4 and report.world_size == 1
    got = {
        "model": model.state_dict(),
        "optimizer": {fqn: opt.state[p] for fqn, p in model.named_parameters()},
    }
    models.assert_same_full_state(got, straight[0][name]["want"])
