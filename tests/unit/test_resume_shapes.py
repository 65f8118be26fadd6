"""Tensors whose shape the checkpoint decides (issue 26, items 13 and 15).

A lazy module restored before its first forward is materialized in the saved shapes, as
torch's ``load_state_dict`` does (optimizer state over its parameters included); a buffer
that grows in training and that its module resizes in its own ``_load_from_state_dict``
loads as torch loads it. Both resume bit for bit; shape changes a plain module cannot load
are still refused, and a failed restore leaves a lazy model lazy.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import unbroken as ub

# Lazy modules ------------------------------------------------------------------------------


class LazyProblem:
    """A learnable regression on a model with lazy layers; the first forward initializes."""

    def __init__(self, *, warm: bool, dtype: torch.dtype = torch.float32) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(
            nn.LazyLinear(8, dtype=dtype), nn.LazyBatchNorm1d(dtype=dtype), nn.Tanh(),
            nn.Linear(8, 1, dtype=dtype),
        )  # fmt: skip
        self.dtype = dtype
        if warm:  # what a run that trains from scratch does before its first step
            self.model(torch.zeros(2, 4, dtype=dtype))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-2, weight_decay=0.01)

    def step(self) -> float:
        x = torch.randn(16, 4).to(self.dtype)
        y = torch.sin(x).sum(dim=1, keepdim=True)
        loss = (self.model(x) - y).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return loss.item()

    def checkpointer(self, path, **kwargs):
        return ub.Checkpointer(path, model=self.model, optimizer=self.opt, **kwargs)


def _lazy(model: nn.Module) -> list[str]:
    return [n for n, t in model.state_dict().items() if nn.parameter.is_lazy(t)]


def test_a_lazy_model_restored_before_its_first_forward_resumes_exactly(tmp_path):
    """The restore materializes the lazy parameters and buffers in the saved shapes (a raw
    RuntimeError before), with the optimizer built on them; the first forward then keeps
    the restored values, and the run continues bit for bit."""
    straight = LazyProblem(warm=True)
    expected = [straight.step() for _ in range(10)]

    first = LazyProblem(warm=True)
    for _ in range(5):
        first.step()
    first.checkpointer(tmp_path).save(5)

    resumed = LazyProblem(warm=False)
    assert _lazy(resumed.model)  # nothing initialized yet
    report = resumed.checkpointer(tmp_path).restore()
    assert report.verified and report.step == 5
    assert _lazy(resumed.model) == []
    assert [resumed.step() for _ in range(5)] == expected[5:]
    sa, sb = straight.model.state_dict(), resumed.model.state_dict()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    oa, ob = straight.opt.state_dict(), resumed.opt.state_dict()
    assert oa["param_groups"] == ob["param_groups"]
    for i, entries in oa["state"].items():
        for k, v in entries.items():
            assert torch.equal(v, ob["state"][i][k]), (i, k)


def test_a_lazy_model_in_another_dtype_is_refused_with_what_to_do(tmp_path):
    """Materializing in the live dtype would cast the saved values: a clear error naming
    the tensor and the fix, before anything changes (the model stays lazy)."""
    first = LazyProblem(warm=True, dtype=torch.float64)
    first.step()
    first.checkpointer(tmp_path).save(1)

    resumed = LazyProblem(warm=False)
    with pytest.raises(ub.StateMismatchError) as info:
        resumed.checkpointer(tmp_path).restore()
    message = str(info.value)
    assert "model/0.weight (saved float64, live float32)" in message
    assert "lazy" in message and "dtype" in message and "before restore()" in message
    assert len(_lazy(resumed.model)) == 6  # both lazy modules still uninitialized


class _Refusing:
    """An extra that saves fine and refuses to load: the restore rolls back after the model
    was installed."""

    def state_dict(self):
        return {"n": 1}

    def load_state_dict(self, state):
        raise ValueError("refused on purpose")


def test_a_failed_restore_leaves_a_lazy_model_lazy(tmp_path):
    """The undo makes the materialized tensors uninitialized again: the model's own first
    forward initializes them, as if restore() had not been called."""
    first = LazyProblem(warm=True)
    first.step()
    first.checkpointer(tmp_path, extra={"x": _Refusing()}).save(1)

    resumed = LazyProblem(warm=False)
    rng = torch.get_rng_state()
    lazy = _lazy(resumed.model)
    with pytest.raises(ValueError, match="refused on purpose"):
        resumed.checkpointer(tmp_path, extra={"x": _Refusing()}).restore()
    assert _lazy(resumed.model) == lazy
    assert type(resumed.model[0]) is nn.LazyLinear
    torch.set_rng_state(rng)
    resumed.model(torch.zeros(2, 4))  # initializes from scratch, as a fresh run would
    fresh = LazyProblem(warm=True)
    got = resumed.model.state_dict()
    for k, a in fresh.model.state_dict().items():
        assert torch.equal(a, got[k]), k


# A buffer that grows in training ------------------------------------------------------------


class History(nn.Module):
    """Keeps every step's mean output in a buffer that grows; resizes it to the saved shape
    in its own ``_load_from_state_dict`` before torch copies the values in."""

    def __init__(self, resizes: bool = True) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.out = nn.Linear(8, 1)
        self.resizes = resizes
        self.register_buffer("history", torch.zeros(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.out(torch.tanh(self.inp(x)))
        self.history = torch.cat([self.history, y.detach().mean().reshape(1)])
        scale = 1.0 + 0.01 * self.history[-3:].mean()  # the history feeds the forward
        return y * scale

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        key = prefix + "history"
        if self.resizes and key in state_dict:
            self.history = torch.empty_like(state_dict[key])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class Plain(nn.Module):
    """The same growth without its own loading: torch cannot load a grown buffer into it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.register_buffer("history", torch.zeros(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        self.history = torch.cat([self.history, y.detach().mean().reshape(1)])
        return y


def _train(model: nn.Module, opt, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 4)
        loss = (model(x) - torch.sin(x).sum(dim=1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _history(cls=History, **kwargs):
    torch.manual_seed(0)
    model = cls(**kwargs)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-2)


def test_a_buffer_its_module_resizes_on_load_resumes_exactly(tmp_path):
    """The grown buffer is accepted where the module's own loading resizes it (refused as
    "the architecture changed" before); it comes back bit for bit, verified, and the run
    continues as the straight one."""
    model, opt = _history()
    expected = _train(model, opt, 10)

    first, first_opt = _history()
    _train(first, first_opt, 6)
    ub.Checkpointer(tmp_path, model=first, optimizer=first_opt).save(6)

    resumed, resumed_opt = _history()
    assert resumed.history.shape == (0,)
    report = ub.Checkpointer(tmp_path, model=resumed, optimizer=resumed_opt).restore()
    assert report.verified and report.step == 6
    assert resumed.history.shape == (6,) and torch.equal(resumed.history, first.history)
    assert _train(resumed, resumed_opt, 4) == expected[6:]
    assert torch.equal(resumed.history, model.history)
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_shape_change_a_plain_module_cannot_load_is_still_refused(tmp_path):
    """Without its own loading, a buffer of another shape is refused before anything
    changes, saying why."""
    model, opt = _history(Plain)
    _train(model, opt, 3)
    ub.Checkpointer(tmp_path, model=model, optimizer=opt).save(3)

    fresh, fresh_opt = _history(Plain)
    with pytest.raises(ub.StateMismatchError, match=r"architecture changed.*model/history"):
        ub.Checkpointer(tmp_path, model=fresh, optimizer=fresh_opt).restore()
    assert fresh.history.shape == (0,)


def test_a_module_whose_own_loading_refuses_the_shape_is_refused_and_rolled_back(tmp_path):
    """A module that loads itself but does not resize: torch's own refusal, as a
    StateMismatchError naming the model; every live object as it was."""
    model, opt = _history()
    _train(model, opt, 3)
    ub.Checkpointer(tmp_path, model=model, optimizer=opt).save(3)

    fresh, fresh_opt = _history(resizes=False)
    weight = fresh.inp.weight.detach().clone()
    with pytest.raises(ub.StateMismatchError, match="model refused the saved state"):
        ub.Checkpointer(tmp_path, model=fresh, optimizer=fresh_opt).restore()
    assert fresh.history.shape == (0,) and torch.equal(fresh.inp.weight, weight)


def test_torch_modules_that_load_themselves_still_refuse_a_shape_change(tmp_path):
    """BatchNorm overrides _load_from_state_dict (an old-format shim), but never resizes:
    a wider BatchNorm is the architecture's change, refused before anything changes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
    ub.Checkpointer(tmp_path, model=model).save(1)
    wider = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16))
    with pytest.raises(ub.StateMismatchError, match=r"architecture changed.*model/0\.weight"):
        ub.Checkpointer(tmp_path, model=wider).restore()
