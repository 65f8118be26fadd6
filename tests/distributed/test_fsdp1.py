"""FSDP1 (``FullyShardedDataParallel``) checkpoints restore bit-exactly anywhere (DESIGN.md
F2, F3, F5).

Saved on 2 FSDP1 ranks (``use_orig_params`` False and True, nested auto-wrap, AdamW), they
restore into one plain process, 3 FSDP1 ranks, 2 FSDP2 ranks, and into FSDP1 wrapped
differently (another auto-wrap policy, activation checkpointing added: the postmortem's
"second reset"); FSDP2 checkpoints restore into FSDP1; bf16 mixed precision keeps its fp32
master state fp32. After each restore, one more training step must match an
uninterrupted reference bit for bit, parameters and optimizer state.

The cases share three spawned jobs (save on 2 ranks, restore on 2, restore on 3). The
last tests check, one each, the private torch behaviours ``unbroken.live.torch_compat``
relies on, so a torch upgrade that changes one fails here by name.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from . import launcher, models

pytestmark = pytest.mark.distributed

# What each checkpoint was saved from, on 2 ranks: FSDP1 build options, or None for FSDP2.
SAVED = {
    "flat": {"use_orig_params": False, "policy": "block"},
    "orig": {"use_orig_params": True, "policy": "size"},
    "bf16": {"use_orig_params": False, "policy": "block", "bf16": True},
    "fsdp2": None,
}
# Restores on 2 ranks: case -> (checkpoint, FSDP1 build options or None for FSDP2).
ON_TWO = {
    "other_policy": ("flat", {"use_orig_params": False, "policy": "size"}),
    "checkpointing_added": ("flat", {"policy": "block", "checkpointing": True}),
    "orig_rewrapped": ("orig", {"use_orig_params": True, "policy": "none", "checkpointing": True}),
    "bf16": ("bf16", {"policy": "size", "bf16": True}),
    "to_fsdp2": ("flat", None),
    "from_fsdp2": ("fsdp2", {"use_orig_params": False, "policy": "block"}),
    "no_shard": ("orig", {"use_orig_params": True, "policy": "block", "sharding": "NO_SHARD"}),
}
# Restores on 3 ranks: checkpoint -> FSDP1 build options.
ON_THREE = {
    "flat": {"use_orig_params": False, "policy": "block"},
    "orig": {"use_orig_params": True, "policy": "size"},
}


def _build(spec: dict | None, world: int, seed: int) -> tuple:
    if spec is None:
        from torch.distributed.device_mesh import init_device_mesh

        return models.build(seed, fsdp_mesh=init_device_mesh("cpu", (world,)))
    return models.build_fsdp1(seed, **spec)


def _full(model, opt) -> dict:
    return models.full_state(model, opt, cpu_offload=False)


def _save_all(rank: int, world: int, root: str) -> dict | None:
    """Worker: each SAVED model trained 3 steps and saved as step 3; the full state at the
    save (``want``) and after one more uninterrupted step (``ref``); the compat probes."""
    import unbroken as ub

    out: dict = {}
    for name, spec in SAVED.items():
        model, opt = _build(spec, world, seed=0)
        models.train_steps(model, opt, 3, rank=rank)
        ub.Checkpointer(f"{root}/{name}", model=model, optimizer=opt).save(3)
        want = _full(model, opt)
        models.train_steps(model, opt, 1, rank=rank, start=3)
        out[name] = {"want": want, "ref": _full(model, opt)}
    out["compat"] = {orig: _compat_probe(orig) for orig in (False, True)}
    model, opt = models.build_fsdp1(sharding="NO_SHARD")  # with flat parameters
    try:
        ub.Checkpointer(f"{root}/refused", model=model, optimizer=opt)
        out["refused"] = None
    except ValueError as exc:
        out["refused"] = str(exc)
    return out if rank == 0 else None


def _restore_on(rank: int, world: int, root: str, cases: dict, want: dict) -> dict | None:
    """Worker: restore each case into a model built otherwise (another seed), then one more
    step; on 3 ranks also a reference loaded by torch from the gathered saved state."""
    import unbroken as ub

    out = {}
    for case, (saved, spec) in cases.items():
        model, opt = _build(spec, world, seed=123)
        report = ub.Checkpointer(f"{root}/{saved}", model=model, optimizer=opt).restore(
            reset={"rng"} if world != 2 else set()
        )
        restored = _full(model, opt)
        models.train_steps(model, opt, 1, rank=rank, start=3)
        result = {"report": report, "restored": restored, "stepped": _full(model, opt)}
        if world != 2:  # no uninterrupted run on this world size: torch loads the saved state
            ref_model, ref_opt = _build(spec, world, seed=7)
            _torch_load(ref_model, ref_opt, want[saved])
            models.train_steps(ref_model, ref_opt, 1, rank=rank, start=3)
            result["ref"] = _full(ref_model, ref_opt)
        out[case] = result
    return out if rank == 0 else None


def _torch_load(model, opt, full: dict) -> None:
    """Load a gathered state with torch's own API (the reference, not the code tested)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    groups = get_optimizer_state_dict(model, opt, options=options)["param_groups"]
    set_state_dict(
        model,
        opt,
        model_state_dict=copy.deepcopy(full["model"]),
        optim_state_dict={"state": copy.deepcopy(full["optimizer"]), "param_groups": groups},
        options=options,
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, dict]:
    root = str(tmp_path_factory.mktemp("fsdp1"))
    return root, launcher.run(_save_all, 2, root)[0]


@pytest.fixture(scope="module")
def on_two(saved) -> dict:
    return launcher.run(_restore_on, 2, saved[0], ON_TWO, {})[0]


@pytest.fixture(scope="module")
def on_three(saved) -> dict:
    root, states = saved
    cases = {name: (name, spec) for name, spec in ON_THREE.items()}
    want = {name: states[name]["want"] for name in ON_THREE}
    return launcher.run(_restore_on, 3, root, cases, want)[0]


@pytest.mark.parametrize("case", sorted(ON_TWO))
def test_two_ranks_restore_then_step_matches_uninterrupted(saved, on_two, case):
    """F2/F3: same world size, other wrapping (auto-wrap policy, activation checkpointing,
    FSDP1 <-> FSDP2, use_orig_params, NO_SHARD): the restored state is the saved one, and
    one more step equals the uninterrupted run's, parameters and optimizer state, bit for
    bit."""
    _, states = saved
    source = ON_TWO[case][0]
    result = on_two[case]
    assert result["report"].verified
    # NO_SHARD holds whole tensors where the save held halves: another layout on the same
    # world size, which the report says; the others cut every tensor as it was saved.
    assert result["report"].resharded == (case == "no_shard")
    assert result["report"].components["optimizer"] == "restored"
    models.assert_same_full_state(result["restored"], states[source]["want"])
    models.assert_same_full_state(result["stepped"], states[source]["ref"])


@pytest.mark.parametrize("source", sorted(ON_THREE))
def test_two_ranks_to_three_fsdp1_ranks(saved, on_three, source):
    """F2: an FSDP1 checkpoint of 2 ranks restores exactly into FSDP1 on 3 ranks, and one
    more step equals that of the saved state loaded through torch's own API."""
    _, states = saved
    result = on_three[source]
    report = result["report"]
    assert report.verified and report.resharded
    assert (report.saved_world_size, report.world_size) == (2, 3)
    models.assert_same_full_state(result["restored"], states[source]["want"])
    models.assert_same_full_state(result["stepped"], result["ref"])


@pytest.mark.parametrize("source", ["flat", "orig"])
def test_two_ranks_to_one_plain_process(saved, source):
    """F2: an FSDP1 checkpoint restores exactly into the unwrapped model in one process
    (no process group), and one more step equals that of the saved state loaded by hand."""
    import unbroken as ub

    root, states = saved
    want = states[source]["want"]
    model, opt = models.build(seed=123)
    report = ub.Checkpointer(f"{root}/{source}", model=model, optimizer=opt).restore(reset={"rng"})
    assert report.verified and report.saved_world_size == 2 and report.world_size == 1
    names = [fqn for fqn, _ in model.named_parameters()]
    got = {
        "model": model.state_dict(),
        "optimizer": {n: opt.state[p] for n, p in zip(names, model.parameters(), strict=True)},
    }
    models.assert_same_full_state(got, want)

    ref_model, ref_opt = models.build(seed=7)
    ref_model.load_state_dict(want["model"])
    loaded = ref_opt.state_dict()
    loaded["state"] = {i: copy.deepcopy(want["optimizer"][n]) for i, n in enumerate(names)}
    ref_opt.load_state_dict(loaded)
    models.train_steps(model, opt, 1, start=3)
    models.train_steps(ref_model, ref_opt, 1, start=3)
    for n, p in zip(names, ref_model.parameters(), strict=True):
        assert torch.equal(model.get_parameter(n), p), n
        for k, v in ref_opt.state[p].items():
            assert torch.equal(opt.state[model.get_parameter(n)][k], v), (n, k)


def test_no_shard_with_flat_parameters_is_refused_at_construction(saved):
    """FSDP1 NO_SHARD with flat parameters (what use_orig_params=False gets on a world size
    of 1) is refused when the Checkpointer is built, naming what is supported, rather than
    at the first save."""
    message = saved[1]["refused"]
    assert message is not None
    assert "NO_SHARD" in message and "use_orig_params=True" in message


def test_bf16_mixed_precision_keeps_fp32_master_state(saved, on_two):
    """F5: FSDP1 MixedPrecision(param_dtype=bf16) over fp32 master parameters saves every
    model and optimizer tensor as fp32 (never the bf16 compute copy), and restores it so."""
    root, states = saved
    folder = Path(root) / "bf16" / "step_00000003"
    tensors = json.loads((folder / "manifest.json").read_text())["tensors"]
    dtypes = {
        key: entry["dtype"]
        for key, entry in tensors.items()
        if key.startswith(("model/", "optimizer/state/"))
    }
    assert len(dtypes) == 14 * 4  # 14 parameters and, for each, exp_avg, exp_avg_sq, step
    assert set(dtypes.values()) == {"float32"}
    for fqn, t in on_two["bf16"]["restored"]["model"].items():
        assert t.dtype == torch.float32, fqn
    models.assert_same_full_state(on_two["bf16"]["restored"], states["bf16"]["want"])


# --- the private torch behaviours unbroken.live.torch_compat relies on --------------------


def _compat_probe(use_orig_params: bool) -> dict:
    """Worker side (2 ranks): what torch_compat reports for an FSDP1 model wrapped per
    Block, and the types its state comes in with and without fsdp1_dtensor_state."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.tensor import DTensor

    from unbroken.live import fsdp1, torch_compat

    model, opt = models.build_fsdp1(use_orig_params=use_orig_params, policy="block")
    models.train_steps(model, opt, 1)
    found: dict = {
        "fqns": {
            name: sorted(torch_compat.normalized_fqns(model, name))
            for name, _ in model.named_parameters()
        },
        "orig_params": [torch_compat.fsdp1_uses_orig_params(m) for m in FSDP.fsdp_modules(model)],
        "unwrapped": torch_compat.is_unwrapped(model),
        "originals": {
            fqn: (tuple(o.shape), type(o.owner).__name__, o.index, isinstance(o.fsdp, FSDP))
            for fqn, o in torch_compat.fsdp1_originals(model).items()
        },
    }

    def kinds(state: dict) -> set[str]:
        return {
            f"{type(t).__name__}{tuple(t.placements) if isinstance(t, DTensor) else ''}"
            for t in state.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        }

    with torch_compat.fsdp1_dtensor_state(model):
        found["meshes_inside"] = [m._device_mesh is not None for m in FSDP.fsdp_modules(model)]
        found["model_inside"] = kinds(get_model_state_dict(model))
        with fsdp1.sharded_state(model):
            osd = FSDP.optim_state_dict(model, opt)
        found["optimizer_inside"] = set().union(*(kinds(s) for s in osd["state"].values()))
    found["meshes_after"] = [m._device_mesh is not None for m in FSDP.fsdp_modules(model)]
    return found


PLAIN_ORDER = [
    f"blocks.{i}.{leaf}"
    for i in range(3)
    for leaf in ("fc.weight", "fc.bias", "norm.weight", "norm.bias")
] + ["head.weight", "head.bias"]


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_compat_normalized_fqns(saved, use_orig_params):
    """torch's _get_fqns drops FSDP1 prefixes; a flat parameter (use_orig_params=False)
    maps to the FQNs of the original parameters it holds, an original to its own."""
    fqns = saved[1]["compat"][use_orig_params]["fqns"]
    assert sorted(f for names in fqns.values() for f in names) == sorted(PLAIN_ORDER)
    assert not saved[1]["compat"][use_orig_params]["unwrapped"]  # so FQNs go through torch
    if use_orig_params:
        assert all(len(names) == 1 for names in fqns.values())
    else:  # one flat parameter per Block, one for the root (the head)
        assert sorted(fqns.values()) == sorted(
            [[f"blocks.{i}.{leaf}" for leaf in ("fc.bias", "fc.weight", "norm.bias",
              "norm.weight")] for i in range(3)] + [["head.bias", "head.weight"]]
        )  # fmt: skip


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_compat_fsdp1_originals(saved, use_orig_params):
    """FlatParameter._shapes/_param_infos through _get_fqn_to_fsdp_param_info: every
    original parameter's unsharded shape, owning module, position in its flat parameter
    (the owner's registration order) and FSDP module, under the FQNs FSDP keys state by."""
    originals = saved[1]["compat"][use_orig_params]["originals"]
    assert sorted(originals) == sorted(PLAIN_ORDER)
    plain = dict(models.Net().named_parameters())
    for fqn, (shape, owner, index, is_fsdp) in originals.items():
        assert shape == tuple(plain[fqn].shape), fqn
        assert owner == ("LayerNorm" if ".norm." in fqn else "Linear"), fqn
        position = {"fc.weight": 0, "fc.bias": 1, "norm.weight": 2, "norm.bias": 3}
        leaf = fqn.split(".", 2)[-1] if fqn.startswith("blocks.") else fqn.split(".")[-1]
        assert index == position.get(leaf, {"weight": 0, "bias": 1}.get(leaf)), fqn
        assert is_fsdp, fqn


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_compat_fsdp1_dtensor_state(saved, use_orig_params):
    """FSDP1 modules given a device mesh (_device_mesh) yield model and optimizer sharded
    state as DTensors sharded on dim 0, never ShardedTensors; the meshes lent for the
    duration are taken back after."""
    found = saved[1]["compat"][use_orig_params]
    assert found["meshes_inside"] and all(found["meshes_inside"])
    assert found["model_inside"] == {"DTensor(Shard(dim=0),)"}
    assert found["optimizer_inside"] == {"DTensor(Shard(dim=0),)"}
    assert not any(found["meshes_after"])


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_compat_fsdp1_uses_orig_params(saved, use_orig_params):
    """FSDP's _use_orig_params tells each module's use_orig_params."""
    found = saved[1]["compat"][use_orig_params]["orig_params"]
    assert found and set(found) == {use_orig_params}
