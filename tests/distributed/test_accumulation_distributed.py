"""A stop between micro-batches of gradient accumulation resumes exactly on DDP (under
``no_sync()``, each rank's own gradients) and FSDP2 (sharded DTensor gradients) with
``Checkpointer(gradients="save")`` (issue 36 item 6)."""

from __future__ import annotations

import pytest
import torch

from . import launcher, models

pytestmark = pytest.mark.distributed

ACCUMULATE = 3
STOP, TOTAL = 4, 9  # micro-batches: the stop holds one micro-batch's pending gradients


def _build(kind: str, seed: int, world: int):
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh

        return models.build(seed, fsdp_mesh=init_device_mesh("cpu", (world,)))
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, _ = models.build(seed)
    ddp = DDP(model)
    return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.1)


def _micro(kind: str, model, opt, rank: int, i: int) -> None:
    """Micro-batch ``i`` (1-based) of a learnable regression, this rank's own data; the
    optimizer steps after every ``ACCUMULATE``-th (DDP synchronizes only then)."""
    import contextlib

    g = torch.Generator().manual_seed(1000 * i + rank)
    x = torch.randn(8, 13, generator=g)
    last = i % ACCUMULATE == 0
    sync = contextlib.nullcontext() if kind == "fsdp2" or last else model.no_sync()
    with sync:
        (model(x) - x[:, :5].sin()).pow(2).mean().div(ACCUMULATE).backward()
    if last:
        opt.step()
        opt.zero_grad()


def _named(model):
    return getattr(model, "module", model).named_parameters()  # DDP's without "module."


def _local(t):
    from torch.distributed.tensor import DTensor

    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def _state(model, opt) -> dict:
    return {
        "params": {n: _local(p) for n, p in _named(model)},
        "opt": {n: {k: _local(v) for k, v in opt.state[p].items()} for n, p in _named(model)},
    }


def _straight(rank: int, world: int, kind: str) -> dict:
    model, opt = _build(kind, 0, world)
    for i in range(1, TOTAL + 1):
        _micro(kind, model, opt, rank, i)
    return _state(model, opt)


def _stopped(rank: int, world: int, kind: str, path: str) -> dict:
    import unbroken as ub

    model, opt = _build(kind, 0, world)
    ckpt = ub.Checkpointer(path, model=model, optimizer=opt, gradients="save")
    ckpt.restore()
    for i in range(1, STOP + 1):
        _micro(kind, model, opt, rank, i)
    grads = {n: _local(p.grad) for n, p in _named(model)}
    ckpt.save(STOP)
    ckpt.close()
    return grads


def _resumed(rank: int, world: int, kind: str, path: str) -> dict:
    import unbroken as ub

    model, opt = _build(kind, 5, world)
    ckpt = ub.Checkpointer(path, model=model, optimizer=opt, gradients="save")
    report = ckpt.restore()
    assert report.step == STOP and report.verified, report
    assert report.components["gradients"] == "restored"
    grads = {n: _local(p.grad) for n, p in _named(model)}
    for i in range(STOP + 1, TOTAL + 1):
        _micro(kind, model, opt, rank, i)
    ckpt.close()
    return {"grads": grads, **_state(model, opt)}


KINDS = ("ddp", "fsdp2")


def _straight_and_stopped(rank: int, world: int, paths: dict) -> dict:
    """Per kind, with fresh objects each time: the uninterrupted run, then the run that
    stops (both from seed 0; the stop's checkpoint in ``paths[kind]``)."""
    return {
        kind: (_straight(rank, world, kind), _stopped(rank, world, kind, paths[kind]))
        for kind in KINDS
    }


def _resumed_all(rank: int, world: int, paths: dict) -> dict:
    return {kind: _resumed(rank, world, kind, paths[kind]) for kind in KINDS}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Both kinds in two launches (was six): one runs each kind straight and stopped, a
    second, fresh one resumes each (the resume never shares a process with its stop)."""
    base = tmp_path_factory.mktemp("accumulation")
    paths = {kind: str(base / kind) for kind in KINDS}
    first = launcher.run(_straight_and_stopped, 2, paths)
    resumed = launcher.run(_resumed_all, 2, paths)
    return {
        kind: ([r[kind][0] for r in first], [r[kind][1] for r in first], [r[kind] for r in resumed])
        for kind in KINDS
    }


@pytest.mark.parametrize("kind", KINDS)
def test_a_stop_between_micro_batches_resumes_bit_for_bit(runs, kind):
    """Item 6, the exact path on 2 ranks: the gradients come back on each rank bit for
    bit (DDP under no_sync: each rank's own, saved per rank; FSDP2: each rank's shard),
    and parameters and AdamW state after two more optimizer steps equal the
    uninterrupted run's."""
    want, held, got = runs[kind]
    if kind == "ddp":  # accumulated locally: the ranks' gradients differ
        assert not torch.equal(held[0]["head.weight"], held[1]["head.weight"])
    for rank in range(2):
        for n, g in held[rank].items():
            assert g.dtype == got[rank]["grads"][n].dtype, n
            assert torch.equal(g, got[rank]["grads"][n]), (rank, n)
        for n, p in want[rank]["params"].items():
            assert torch.equal(p, got[rank]["params"][n]), (rank, n)
        for n, state in want[rank]["opt"].items():
            for k, v in state.items():
                assert torch.equal(v, got[rank]["opt"][n][k]), (rank, n, k)
