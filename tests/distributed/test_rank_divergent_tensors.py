"""Plain tensors that differ between ranks are never restored as a mix (issue 36, item 13).

DCP writes a plain (non-DTensor) tensor several ranks hold once, from whichever rank its
plan deduplication picks, tensor by tensor. Before the fix, per-rank experts kept by hand
in one plain parameter, their Adam moments and BatchNorm statistics under DDP with
``broadcast_buffers=False`` were written from one rank or another and restored on every
rank with verified=True; DDP's own broadcast buffers (``broadcast_buffers=True``) were
written from whichever rank, so a resumed run trained on another rank's statistics than
the one DDP broadcasts. Both cases share one launched job.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from . import launcher

pytestmark = pytest.mark.distributed

D, H, E = 6, 5, 3
TEACHER = torch.Generator().manual_seed(77)
W_TRUE = torch.randn(D, 1, generator=TEACHER)


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable regression (a fixed linear teacher), another batch on each rank."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, D, generator=g)
    return x, x @ W_TRUE


class HandMoE(nn.Module):
    """Experts by hand: each rank's own experts in one plain (E, D, H) parameter; a shared
    input layer and head kept equal by averaging their gradients; a BatchNorm whose
    statistics stay each rank's own (as DDP with broadcast_buffers=False leaves them)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(D, D)
        self.bn = nn.BatchNorm1d(H)
        self.head = nn.Linear(H, 1)
        self.experts = nn.Parameter(
            torch.randn(E, D, H, generator=torch.Generator().manual_seed(10 + rank))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.einsum("bd,edh->bh", torch.relu(self.shared(x)), self.experts) / E
        return self.head(self.bn(h))


def _train_by_hand(model: HandMoE, opt, steps: int, rank: int) -> None:
    import torch.distributed as dist

    for step in range(steps):
        x, y = _batch(step, rank)
        opt.zero_grad()
        (model(x) - y).pow(2).mean().backward()
        for name, p in model.named_parameters():
            if name != "experts":  # the experts' gradients stay each rank's own
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        opt.step()


def _ddp_model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(D, H), nn.BatchNorm1d(H), nn.ReLU(), nn.Linear(H, 1))


class Wrapper(nn.Module):
    """What Lightning puts between its DDP and the LightningModule."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def _train_ddp(ddp, opt, start: int, stop: int, rank: int) -> list[float]:
    losses = []
    for step in range(start, stop):
        x, y = _batch(step, rank)
        opt.zero_grad()
        loss = (ddp(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _state(module: nn.Module, opt) -> dict:
    return {
        "model": {k: v.clone() for k, v in module.state_dict().items()},
        "optimizer": {
            i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(opt.state.values())
        },
    }


def _broadcast_buffers(ddp: nn.Module) -> tuple[list[str], list[str]] | None:
    """The buffer keys found broadcast by ``ddp`` (around the model passed) and by a DDP
    with broadcast_buffers=False; None before the fix (no such search)."""
    try:
        from unbroken.core import replicas
    except ImportError:
        return None
    from unbroken.live.state import ModelComponent

    with warnings.catch_warnings():  # torch 2.13 renames it forward_sync_buffers
        warnings.simplefilter("ignore", FutureWarning)
        quiet = nn.parallel.DistributedDataParallel(_ddp_model(), broadcast_buffers=False)
    return (
        sorted(replicas.broadcast_buffer_keys([ModelComponent(ddp.module.inner)])),
        sorted(replicas.broadcast_buffer_keys([ModelComponent(quiet)])),
    )


def _job(rank: int, world: int, root: str) -> dict:
    import unbroken as ub

    out: dict = {}
    # Hand-made experts and per-rank BatchNorm statistics: the save is refused.
    moe = HandMoE(rank)
    opt = torch.optim.Adam(moe.parameters(), lr=0.01)
    _train_by_hand(moe, opt, 3, rank)
    ckpt = ub.Checkpointer(f"{root}/moe", model=moe, optimizer=opt)
    try:
        ckpt.save(3)
        out["moe_saved"] = True
    except ub.CheckpointError as exc:
        out["moe_error"] = str(exc)
    out["moe_steps"] = ckpt.steps()
    ckpt.close()
    # The same in a background save: refused at close(), nothing committed.
    later = ub.Checkpointer(f"{root}/moe_async", model=moe, optimizer=opt, async_save=True)
    later.save(3)
    try:
        later.close()
    except ub.CheckpointError as exc:
        out["moe_async_error"] = str(exc)
    out["moe_async_steps"] = later.steps()

    # DDP (broadcast_buffers=True): rank 0's buffers are the ones DDP trains on next.
    ddp = nn.parallel.DistributedDataParallel(Wrapper(_ddp_model()))
    opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
    _train_ddp(ddp, opt, 0, 3, rank)
    out["ddp_at_save"] = _state(ddp.module.inner, opt)
    # The module inside DDP, as Lightning and the HF Trainer pass it; and the DDP itself.
    ckpt = ub.Checkpointer(f"{root}/ddp", model=ddp.module.inner, optimizer=opt)
    ckpt.save(3)
    ckpt.close()
    out["found"] = _broadcast_buffers(ddp)
    inside = ub.Checkpointer(f"{root}/ddp_inside", model=ddp, optimizer=opt)
    inside.save(3)
    out["ddp_inside_steps"] = inside.steps()
    inside.close()
    out["ddp_losses"] = _train_ddp(ddp, opt, 3, 6, rank)
    out["ddp_final"] = _state(ddp.module.inner, opt)

    resumed = nn.parallel.DistributedDataParallel(Wrapper(_ddp_model()))
    opt = torch.optim.Adam(resumed.parameters(), lr=0.01)
    report = ub.Checkpointer(f"{root}/ddp", model=resumed.module.inner, optimizer=opt).restore()
    out["ddp_restored"] = _state(resumed.module.inner, opt)
    out["ddp_report"] = report
    out["ddp_resumed_losses"] = _train_ddp(resumed, opt, 3, 6, rank)
    out["ddp_resumed_final"] = _state(resumed.module.inner, opt)
    return out


def _equal(a: dict, b: dict) -> list[str]:
    """The keys at which two nested dicts of tensors differ (bit for bit, dtype too)."""
    if a.keys() != b.keys():
        return [f"keys {sorted(a)} vs {sorted(b)}"]
    out = []
    for k, v in a.items():
        if isinstance(v, dict):
            out += [f"{k}/{d}" for d in _equal(v, b[k])]
        elif v.dtype != b[k].dtype or not torch.equal(v, b[k]):
            out.append(str(k))
    return out


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("divergent")
    return root, launcher.run(_job, 2, str(root))


def test_plain_tensors_that_differ_by_rank_refuse_the_save_naming_them(job):
    """Item 13: per-rank experts (a plain parameter), their Adam moments and BatchNorm
    statistics that differ by rank refuse the save, naming each FQN and the ranks; the
    tensors equal on every rank are not named, and nothing is committed. Before: saved
    from one rank or another tensor by tensor and restored on every rank, verified."""
    root, results = job
    for r in results:
        assert "moe_saved" not in r, "a save of tensors that differ by rank was committed"
        assert r["moe_steps"] == []
        message = r["moe_error"]
        for key in (
            "model/experts",
            "model/bn.running_mean",
            "model/bn.running_var",
            "optimizer/state/experts/exp_avg",
            "optimizer/state/experts/exp_avg_sq",
        ):
            assert f"{key} (rank 0 holds one value, rank 1 another)" in message, (key, message)
        for equal in ("model/shared.weight", "model/head.bias", "state/experts/step", "bn.weight"):
            assert equal not in message, (equal, message)
        assert "step 3 was not saved" in message and "Nothing was committed" in message
        assert "model/experts (rank 0 holds one value" in r.get("moe_async_error", "")
        assert r["moe_async_steps"] == []
        assert "broadcast_buffers=True" in message and "DTensor sharded" in message
    assert not list(Path(root, "moe").glob("step_*"))


def test_ddp_broadcast_buffers_are_rank_zeros_and_resume_exactly(job):
    """Item 13: under DDP (broadcast_buffers=True) BatchNorm statistics differ by rank at a
    save (each rank's forward updated its copy after DDP broadcast rank 0's), whether the
    Checkpointer is given the DDP or the module it wraps; rank 0's,
    the ones every rank trains on next, are written, each tensor once (replicated ones
    stay deduplicated: no per-rank copies), every rank gets them back, and the resumed
    run matches the uninterrupted one bit for bit. Before: another rank's could be
    written, and the resumed run trained on statistics DDP never broadcast."""
    root, results = job
    zero, one = (r["ddp_at_save"]["model"] for r in results)
    assert not torch.equal(zero["1.running_mean"], one["1.running_mean"])  # the case at hand
    for rank, r in enumerate(results):
        assert r["ddp_inside_steps"] == [3]
        assert r["ddp_report"].verified and r["ddp_report"].step == 3
        assert _equal(r["ddp_restored"]["model"], zero) == [], rank
        assert _equal(r["ddp_restored"]["optimizer"], results[0]["ddp_at_save"]["optimizer"]) == []
        assert r["ddp_resumed_losses"] == r["ddp_losses"], rank
        assert _equal(r["ddp_resumed_final"], r["ddp_final"]) == [], rank
    doc = json.loads(next(Path(root, "ddp").glob("step_*/manifest.json")).read_text())
    for key, entry in doc["tensors"].items():
        one_copy = torch.Size(entry["shape"]).numel() * getattr(torch, entry["dtype"]).itemsize
        assert sum(c["length"] for c in entry["chunks"]) == one_copy, key
        if key.startswith(("model/1.running", "model/1.num_batches")):  # buffers: rank 0's
            assert all(c["file"].startswith("rank_00000") for c in entry["chunks"]), entry
    import unbroken as ub

    # On one process (another world size): rank 0's statistics, verified; the per-rank
    # RNG streams are refused unless reset.
    single = _ddp_model()
    alone = ub.Checkpointer(
        Path(root, "ddp"), model=single, optimizer=torch.optim.Adam(single.parameters())
    )
    with pytest.raises(ub.IncompleteCheckpointError, match="'rng'"):
        alone.restore()
    report = alone.restore(reset={"rng"})
    assert report.verified and report.resharded
    assert _equal(dict(single.state_dict()), zero) == []
    alone.close()
    checked = ub.verify_checkpoint(Path(root, "ddp"))
    assert checked.ok, [c.failures for c in checked.checkpoints]
    shown = ub.inspect_checkpoint(Path(root, "ddp"), step=3)
    assert "model/1.running_mean" in {t.key for t in shown.tensors}
    buffers = ["model/1.num_batches_tracked", "model/1.running_mean", "model/1.running_var"]
    for r in results:
        assert r["found"] == (buffers, [])  # none under broadcast_buffers=False
