"""One test per failure class of DESIGN.md (F1-F5); each fails on the buggy behaviour."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

import unbroken as ub
from conftest import Problem, assert_same_training_state


def _saved_after(ckpt_dir, steps: int = 3, **kwargs) -> Problem:
    p = Problem()
    for _ in range(steps):
        p.step()
    p.checkpointer(ckpt_dir, **kwargs).save(steps)
    return p


# F1 -------------------------------------------------------------------------------------


def test_f1_moments_restored_when_grads_exist_before_restore(ckpt_dir):
    """F1: a fresh AdamW with gradients already present has no lazy state to use as a load
    template; torch's get_state_dict then offers no moments and a template-driven load
    skips them silently. Every saved moment must come back anyway."""
    saved = _saved_after(ckpt_dir)
    fresh = Problem(seed=3)
    fresh.model(torch.randn(2, 4)).sum().backward()  # a warm-up backward: grads exist
    assert get_optimizer_state_dict(fresh.model, fresh.opt)["state"] == {}  # the trap
    fresh.checkpointer(ckpt_dir).restore()
    assert_same_training_state(saved, fresh)
    assert all(
        {"exp_avg", "exp_avg_sq", "step"} <= fresh.opt.state[p].keys()
        for p in fresh.model.parameters()
    )


# F3 -------------------------------------------------------------------------------------


def test_f3_missing_component_is_an_error_naming_it(ckpt_dir):
    """F3: the checkpoint has no optimizer (model-only save); restoring with one must not
    silently leave AdamW fresh."""
    p = Problem()
    p.step()
    ub.Checkpointer(ckpt_dir, model=p.model).save(1)
    with pytest.raises(ub.IncompleteCheckpointError, match="'optimizer'"):
        Problem().checkpointer(ckpt_dir).restore()


def test_f3_reset_is_explicit_reported_and_recorded(ckpt_dir):
    """F3: starting a component fresh is allowed only on request, and leaves a trace."""
    p = Problem()
    p.step()
    ub.Checkpointer(ckpt_dir, model=p.model).save(1)
    q = Problem(seed=1)
    ckpt = q.checkpointer(ckpt_dir)
    report = ckpt.restore(reset={"optimizer", "scheduler"})
    assert report.components == {
        "model": "restored",
        "optimizer": "reset",
        "scheduler": "reset",
        "rng": "restored",
    }
    assert not q.opt.state  # really fresh
    q.step()
    ckpt.save(2)
    lineage = json.loads((ckpt_dir / "step_00000002" / "manifest.json").read_text())["lineage"]
    assert lineage[-1]["event"] == "resume" and lineage[-1]["from_step"] == 1
    assert lineage[-1]["reset"] == ["optimizer", "scheduler"]


def test_f3_parameter_without_optimizer_entry_is_named(ckpt_dir):
    """F3: a parameter the live optimizer holds but the saved one did not (its state would
    silently start from zero) is an error naming its FQN."""
    p = Problem()
    p.opt = torch.optim.AdamW([p.model.inp.weight, p.model.inp.bias], lr=1e-2)
    p.sched = torch.optim.lr_scheduler.LambdaLR(p.opt, lambda s: 1.0)
    p.step()
    p.checkpointer(ckpt_dir).save(1)
    with pytest.raises(ub.IncompleteCheckpointError, match=r"out\.weight"):
        Problem().checkpointer(ckpt_dir).restore()


def _wrapped(kind: str, model: nn.Module) -> nn.Module:
    if kind == "compile":
        return torch.compile(model, backend="eager")
    if kind == "checkpoint_wrapper":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            checkpoint_wrapper,
        )

        model.inp = checkpoint_wrapper(model.inp)
        return model
    return model


@pytest.mark.parametrize(
    ("save_as", "restore_as"),
    [("compile", "plain"), ("plain", "compile"), ("checkpoint_wrapper", "plain"),
     ("plain", "checkpoint_wrapper"), ("compile", "checkpoint_wrapper")],
)  # fmt: skip
def test_f3_wrapping_change_keeps_optimizer_state(ckpt_dir, save_as, restore_as):
    """F3: adding or removing torch.compile / activation checkpointing between save and
    restore must not orphan optimizer state (FQNs are normalized)."""
    a = Problem()
    a.model = _wrapped(save_as, a.model)
    for _ in range(3):
        a.step()
    a.checkpointer(ckpt_dir).save(3)
    b = Problem(seed=4)
    b.model = _wrapped(restore_as, b.model)
    report = b.checkpointer(ckpt_dir).restore()
    assert report.components["optimizer"] == "restored"
    for pa, pb in zip(
        a.opt.param_groups[0]["params"], b.opt.param_groups[0]["params"], strict=True
    ):
        assert torch.equal(pa, pb)
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(a.opt.state[pa][k], b.opt.state[pb][k])


# F4 -------------------------------------------------------------------------------------


class MasterCopyLinear(nn.Module):
    """A layer whose forward reads a low-precision compute copy of its master weight.

    ``refresh_on_load`` False reproduces the shipped bug: the compute copy is refreshed
    only after an optimizer step, so right after a restore the forward uses stale weights.
    """

    def __init__(self, refresh_on_load: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 4))
        self.register_buffer("compute", self.weight.detach().to(torch.bfloat16), persistent=False)
        if refresh_on_load:
            self.register_load_state_dict_post_hook(lambda module, keys: module.refresh())

    def refresh(self) -> None:
        self.compute.copy_(self.weight.detach())

    def forward(self, x):
        return x.to(torch.bfloat16) @ self.compute.t()


def _probe(model):
    return model(torch.ones(2, 4)).float().sum()


@pytest.mark.parametrize("refresh_on_load", [True, False])
def test_f4_probe_catches_late_installation(ckpt_dir, refresh_on_load):
    """F4: weights loaded into the master copy but not yet into the compute copy. The probe
    recorded at save differs after restore when the module installs late; a module that
    refreshes in its load hook (which restore runs, through load_state_dict) passes."""
    torch.manual_seed(0)
    saved = MasterCopyLinear(refresh_on_load)
    with torch.no_grad():
        saved.weight.add_(1.0)
    saved.refresh()
    ub.Checkpointer(ckpt_dir, model=saved, probe=_probe).save(1)
    torch.manual_seed(1)
    fresh = MasterCopyLinear(refresh_on_load)
    ckpt = ub.Checkpointer(ckpt_dir, model=fresh, probe=_probe)
    if refresh_on_load:
        assert ckpt.restore().verified
        assert torch.equal(fresh.compute, saved.compute)
    else:
        with pytest.raises(ub.StateMismatchError, match="probe differs"):
            ckpt.restore()


def test_probe_does_not_perturb_training(ckpt_dir):
    """A probe that draws random numbers (dropout in train mode) must leave the RNG as it
    was, or saving would change the run."""

    def run(save: bool) -> list[float]:
        torch.manual_seed(0)
        p = Problem()
        ckpt = p.checkpointer(ckpt_dir, probe=lambda m: m.drop(torch.ones(3, 4)).sum())
        losses = [p.step()]
        if save:
            ckpt.save(1)
        return losses + [p.step() for _ in range(3)]

    assert run(save=True) == run(save=False)


# F5 -------------------------------------------------------------------------------------


class Fp32MomentumSGD(torch.optim.Optimizer):
    """SGD with momentum kept in float32 whatever the parameter dtype (like mixed-precision
    optimizers that keep fp32 state for bf16 weights)."""

    def __init__(self, params, lr=0.1, momentum=0.9):
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum", torch.zeros_like(p, dtype=torch.float32))
                buf.mul_(group["momentum"]).add_(p.grad.float())
                p.add_(buf.to(p.dtype), alpha=-group["lr"])


def test_f5_fp32_state_of_bf16_params_keeps_its_dtype(ckpt_dir):
    """F5: torch's Optimizer.load_state_dict casts floating state to the parameter dtype,
    so fp32 momentum of a bf16 parameter silently comes back as bf16. It must not."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4).to(torch.bfloat16)
    opt = Fp32MomentumSGD(model.parameters())
    model(torch.randn(2, 4, dtype=torch.bfloat16)).float().pow(2).sum().backward()
    opt.step()
    ub.Checkpointer(ckpt_dir, model=model, optimizer=opt).save(1)
    saved = {k: opt.state[p]["momentum"].clone() for k, p in model.named_parameters()}

    torch.manual_seed(1)
    fresh = nn.Linear(4, 4).to(torch.bfloat16)
    fresh_opt = Fp32MomentumSGD(fresh.parameters())
    plain = Fp32MomentumSGD(nn.Linear(4, 4).to(torch.bfloat16).parameters())
    plain.load_state_dict(opt.state_dict())
    assert next(iter(plain.state.values()))["momentum"].dtype == torch.bfloat16  # the trap

    ub.Checkpointer(ckpt_dir, model=fresh, optimizer=fresh_opt).restore()
    for k, p in fresh.named_parameters():
        got = fresh_opt.state[p]["momentum"]
        assert got.dtype == torch.float32 and torch.equal(got, saved[k]), k


def test_f5_muon_on_bf16_next_to_adamw(ckpt_dir):
    """F5: Muon momentum on bf16 matrices and AdamW on the rest come back in exactly their
    saved dtypes and values, and training continues identically."""

    def build(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2)).to(torch.bfloat16)
        matrices = [p for p in model.parameters() if p.ndim == 2]
        others = [p for p in model.parameters() if p.ndim != 2]
        opts = {
            "muon": torch.optim.Muon(matrices, lr=1e-2),
            "adamw": torch.optim.AdamW(others, lr=1e-2),
        }
        return model, opts

    def step(model, opts, i):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(5, 6, generator=g).to(torch.bfloat16)
        loss = model(x).float().pow(2).mean()
        for o in opts.values():
            o.zero_grad()
        loss.backward()
        for o in opts.values():
            o.step()
        return loss.item()

    model, opts = build(0)
    for i in range(3):
        step(model, opts, i)
    ub.Checkpointer(ckpt_dir, model=model, optimizer=opts).save(3)
    expected = [step(model, opts, i) for i in range(3, 6)]

    model2, opts2 = build(9)
    ub.Checkpointer(ckpt_dir, model=model2, optimizer=opts2).restore()
    momentum = next(iter(opts2["muon"].state.values()))["momentum_buffer"]
    assert momentum.dtype == torch.bfloat16
    assert [step(model2, opts2, i) for i in range(3, 6)] == expected
    for (name, a), b in zip(model.state_dict().items(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
