"""``frozen="verify"`` on 2 gloo ranks: DDP, FSDP2 (frozen parameters sharded, a unit
mixing frozen and trainable ones) and FSDP1 with ``use_orig_params=True``; the frozen
base checked across ranks (a base that differs on one rank only is refused on all), and
an FSDP2 checkpoint resharded into one process (DESIGN.md F2, F3: the base a run resumes
on is the one it trained on, and nothing it learned is left out)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from . import launcher

pytestmark = pytest.mark.distributed

FROZEN = {"0.weight", "0.bias", "2.weight"}  # 2.bias trains: one unit mixes both


def _flip_last_bit(t) -> None:
    import torch

    with torch.no_grad():
        t.view(-1)[-1:].view(torch.int32)[0] ^= 1


def build(wrap: str, mesh=None, flip: bool = False):
    """The model (the same base on every rank and call); ``flip``: one bit of this
    rank's copy of the frozen ``2.weight`` flipped, in its last element (which every
    wrapper keeps on the last rank)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)
    )
    for name, p in model.named_parameters():
        p.requires_grad_(name not in FROZEN)
    if flip and wrap != "ddp":  # FSDP keeps each rank's own part of its local copy
        _flip_last_bit(model[2].weight)
    if wrap == "ddp":
        model = nn.parallel.DistributedDataParallel(model)  # broadcasts rank 0's values
        if flip:
            _flip_last_bit(model.module[2].weight)
    elif wrap == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for i in (0, 2, 4):
            fully_shard(model[i], mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif wrap == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        model = FSDP(model, use_orig_params=True, device_id=torch.device("cpu"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, opt


def train(model, opt, rank: int, start: int, end: int) -> None:
    import torch

    w = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    for step in range(start, end):
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(100 * step + rank))
        torch.nn.functional.mse_loss(model(x), x @ w).backward()
        opt.step()
        opt.zero_grad()


def full_model(model) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k.removeprefix("module."): v.clone() for k, v in state.items()}


def _job(rank: int, world: int, root: str) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import unbroken as ub

    out: dict = {}
    mesh = init_device_mesh("cpu", (world,))
    for wrap in ("ddp", "fsdp2", "fsdp1"):
        path = f"{root}/{wrap}"
        model, opt = build(wrap, mesh)
        with ub.Checkpointer(path, model=model, optimizer=opt, frozen="verify") as ck:
            ck.restore()
            train(model, opt, rank, 0, 3)
            ck.save(3)
        saved = full_model(model)

        model, opt = build(wrap, mesh)
        with ub.Checkpointer(path, model=model, optimizer=opt, frozen="verify") as ck:
            report = ck.restore()
            train(model, opt, rank, 3, 4)
            ck.save(4)
        out[wrap] = {"report": report, "saved": saved, "after": full_model(model)}

        # one rank's base differs by one bit: every rank refuses, nothing changes
        model, opt = build(wrap, mesh, flip=rank == world - 1)
        before = full_model(model)
        with ub.Checkpointer(path, model=model, optimizer=opt, frozen="verify") as ck:
            try:
                ck.restore()
                out[wrap]["refused"] = None
            except ub.StateMismatchError as exc:
                out[wrap]["refused"] = str(exc)
        out[wrap]["unchanged"] = all(
            torch.equal(v, before[k]) for k, v in full_model(model).items()
        )
        out[wrap]["reference"] = None
        if wrap == "fsdp2":  # the uninterrupted run, to compare with the resumed one
            model, opt = build(wrap, mesh)
            train(model, opt, rank, 0, 4)
            out[wrap]["reference"] = full_model(model)
    return out


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("frozen")
    return root, launcher.run(_job, 2, str(root), timeout=400)


@pytest.mark.parametrize("wrap", ["ddp", "fsdp2", "fsdp1"])
def test_trainable_only_saves_and_resumes(job, wrap):
    """Each wrapper: the frozen parameters are not stored, the resume verifies them and
    restores the rest bit for bit; a base differing on one rank is refused on both."""
    import torch

    root, results = job
    for r in results:
        got = r[wrap]
        assert got["report"].verified and got["report"].frozen_verified == len(FROZEN)
        assert got["refused"] is not None and "the base model differs" in got["refused"]
        assert "2.weight: its values differ" in got["refused"]
        assert got["unchanged"]
    doc = json.loads((Path(root) / wrap / "step_00000004" / "manifest.json").read_text())
    frozen = {k.split("/", 1)[1] for k, r in doc["frozen"].items() if not r["stored"]}
    assert frozen == FROZEN
    assert not any(k.split("/", 1)[1] in FROZEN for k in doc["tensors"] if k.startswith("model/"))
    if wrap == "fsdp2":
        ref = results[0][wrap]["reference"]
        for k, v in results[0][wrap]["after"].items():
            assert torch.equal(v, ref[k]), k


def test_fsdp2_trainable_only_reshards_into_one_process(job):
    """The 2-rank FSDP2 checkpoint restores into one plain process on the same base,
    verified, bit for bit the saved state."""
    import torch

    import unbroken as ub

    root, results = job
    model, opt = build("plain")
    with ub.Checkpointer(root / "fsdp2", model=model, optimizer=opt, frozen="verify") as ck:
        report = ck.restore(step=3, reset={"rng"})
    assert report.resharded and report.frozen_verified == len(FROZEN)
    for k, v in model.state_dict().items():
        assert torch.equal(v, results[0]["fsdp2"]["saved"][k]), k
