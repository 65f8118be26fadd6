"""Optimizers that wrap others, groups built in another order, another optimizer class
(issue 26, items 12, 14 and 18).

A timm-style ``Lookahead`` (an Optimizer subclass over a base optimizer, never calling
``Optimizer.__init__``) resumes bit for bit and is never a crash of the health check; the
same parameters in another order inside a param group restore by FQN; a switch of
optimizer class is named as one, before anything changes.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, defaultdict

import pytest
import torch

import unbroken as ub
from conftest import Problem, assert_same_training_state
from unbroken.live import optimizer as live_optimizer

# Lookahead, modelled on timm.optim.Lookahead ------------------------------------------------


class Lookahead(torch.optim.Optimizer):
    """timm's Lookahead: the base optimizer's param groups (and here its state) shared,
    ``super().__init__()`` not called on purpose, plain dicts for the step hooks (as
    several copies of timm's code have it: they cannot be weakly referenced)."""

    def __init__(self, base, alpha=0.5, k=3, hooks=dict, share_state=True) -> None:
        self._optimizer_step_pre_hooks = hooks()
        self._optimizer_step_post_hooks = hooks()
        defaults = {"lookahead_alpha": alpha, "lookahead_k": k, "lookahead_step": 0}
        self._base_optimizer = base
        self.param_groups = base.param_groups
        self.defaults = base.defaults
        self.defaults.update(defaults)
        self.share_state = share_state
        self.state = base.state if share_state else defaultdict(dict)
        for name, default in defaults.items():
            for group in base.param_groups:
                group.setdefault(name, default)

    @torch.no_grad()
    def update_slow(self, group):
        for fast in group["params"]:
            if fast.grad is None:
                continue
            state = self._base_optimizer.state[fast]
            if "lookahead_slow_buff" not in state:
                state["lookahead_slow_buff"] = torch.empty_like(fast)
                state["lookahead_slow_buff"].copy_(fast)
            slow = state["lookahead_slow_buff"]
            slow.add_(fast - slow, alpha=group["lookahead_alpha"])
            fast.copy_(slow)

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._base_optimizer.step(closure)
        for group in self._base_optimizer.param_groups:
            group["lookahead_step"] += 1
            if group["lookahead_step"] % group["lookahead_k"] == 0:
                self.update_slow(group)
        return loss

    def state_dict(self):
        return self._base_optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self._base_optimizer.load_state_dict(state_dict)
        self.param_groups = self._base_optimizer.param_groups
        if self.share_state:
            self.state = self._base_optimizer.state


class PropertyLookahead(Lookahead):
    """A wrapper whose ``state`` and ``param_groups`` are read-only properties giving the
    base optimizer's (its step hooks can be registered: the watch watches it)."""

    def __init__(self, base, alpha=0.5, k=3) -> None:
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._base_optimizer = base
        self.defaults = base.defaults
        for group in base.param_groups:
            group.update(lookahead_alpha=alpha, lookahead_k=k, lookahead_step=0)

    @property
    def state(self):
        return self._base_optimizer.state

    @property
    def param_groups(self):
        return self._base_optimizer.param_groups

    def load_state_dict(self, state_dict):
        self._base_optimizer.load_state_dict(state_dict)


WRAPPERS = {
    "dict-hooks-shared-state": lambda base: Lookahead(base),
    "timm-own-empty-state": lambda base: Lookahead(base, hooks=OrderedDict, share_state=False),
    "read-only-properties": lambda base: PropertyLookahead(base),
}


def _wrapped(kind: str) -> Problem:
    p = Problem()
    base = torch.optim.AdamW(p.model.parameters(), lr=3e-2, weight_decay=0.01)
    p.opt = WRAPPERS[kind](base)
    p.sched = torch.optim.lr_scheduler.LambdaLR(base, lambda s: min(1.0, (s + 1) / 4))
    return p


def _base_state(p: Problem) -> dict:
    return p.opt._base_optimizer.state_dict()


@pytest.mark.parametrize("kind", list(WRAPPERS))
def test_lookahead_wrapper_resumes_exactly_and_the_health_check_never_raises(
    tmp_path, kind, caplog
):
    """restore() and track() never raise from the health check's optimizer watch (a raw
    TypeError "cannot create weak reference to 'dict' object" before), the resumed run
    equals the straight one bit for bit (slow buffers and lookahead counters included), and
    no warning blames the wrapper, which is stepping."""
    straight = _wrapped(kind)
    expected = [straight.step() for _ in range(12)]

    first = _wrapped(kind)
    ckpt = first.checkpointer(tmp_path)
    for step in range(1, 6):
        ckpt.track(step, loss=first.step())
    ckpt.save(5)
    ckpt.close()

    resumed = _wrapped(kind)
    ckpt = resumed.checkpointer(tmp_path)
    with caplog.at_level(logging.WARNING, logger="unbroken"):
        report = ckpt.restore()
    assert report.verified and report.step == 5
    losses = []
    for step in range(6, 13):
        losses.append(resumed.step())
        ckpt.track(step, loss=losses[-1])
    ckpt.close()
    assert losses == expected[5:]
    assert_same_training_state(straight, resumed)
    want, got = _base_state(straight), _base_state(resumed)
    assert want["param_groups"] == got["param_groups"]
    for i, entries in want["state"].items():
        assert entries.keys() == got["state"][i].keys()
        for k, v in entries.items():
            assert torch.equal(v, got["state"][i][k]), (i, k)
    assert ckpt.warnings == []
    if kind == "dict-hooks-shared-state":  # its step hook cannot be registered: named
        (line,) = [r.getMessage() for r in caplog.records if "not watched" in r.getMessage()]
        assert "Lookahead" in line and "optimizer" in line


class _Unreadable(dict):
    """Optimizer state whose ``get`` fails (as a wrapper's odd state container might)."""

    def get(self, *args, **kwargs):
        raise RuntimeError("this state cannot be read that way")


def test_the_optimizer_watch_never_raises_into_track(tmp_path, caplog):
    """An optimizer whose state the watch cannot read after the restore: track() goes on,
    the optimizer is named as not watched, the run is not failed."""
    p = Problem()
    ckpt = p.checkpointer(tmp_path)
    for step in range(1, 4):
        ckpt.track(step, loss=p.step())
    ckpt.save(3)
    ckpt.close()

    q = Problem(seed=1)
    ckpt = q.checkpointer(tmp_path)
    ckpt.restore()
    q.opt.state = _Unreadable(q.opt.state)
    with caplog.at_level(logging.WARNING, logger="unbroken"):
        for step in range(4, 8):
            ckpt.track(step, loss=q.step())
    ckpt.close()
    assert any("not watched" in r.getMessage() for r in caplog.records)
    assert ckpt.warnings == []


# The same parameters in another order inside a group -----------------------------------


def _ordered(order: str) -> Problem:
    p = Problem()
    named = dict(p.model.named_parameters())
    names = list(named) if order == "module" else sorted(named, key=lambda n: n[::-1])
    p.opt = torch.optim.AdamW([named[n] for n in names], lr=3e-2, weight_decay=0.01)
    p.sched = torch.optim.lr_scheduler.LambdaLR(p.opt, lambda s: min(1.0, (s + 1) / 4))
    return p


def _by_fqn(p: Problem) -> dict:
    names = {param: n for n, param in p.model.named_parameters()}
    return {names[param]: entries for param, entries in p.opt.state.items()}


def test_a_group_in_another_order_restores_by_fqn(tmp_path):
    """A param group built from a set of names changes order between processes: the state
    is matched by FQN, the resume is bit-exact, and a later save and restore still are."""
    straight = _ordered("module")
    expected = [straight.step() for _ in range(12)]

    first = _ordered("module")
    for _ in range(5):
        first.step()
    first.checkpointer(tmp_path).save(5)

    resumed = _ordered("reversed")
    ckpt = resumed.checkpointer(tmp_path)
    report = ckpt.restore()
    assert report.verified and report.step == 5
    assert [resumed.step() for _ in range(4)] == expected[5:9]
    ckpt.save(9)
    ckpt.close()

    again = _ordered("module")
    assert again.checkpointer(tmp_path).restore().step == 9
    assert [again.step() for _ in range(3)] == expected[9:]
    for a, b in zip(straight.model.parameters(), again.model.parameters(), strict=True):
        assert torch.equal(a, b)
    want, got = _by_fqn(straight), _by_fqn(again)
    assert want.keys() == got.keys()
    for fqn, entries in want.items():
        for k, v in entries.items():
            assert v.dtype == got[fqn][k].dtype and torch.equal(v, got[fqn][k]), (fqn, k)


def test_a_parameter_moved_to_another_group_is_still_refused(tmp_path):
    """Only the order within a group is free: other group memberships are refused."""
    p = Problem()
    m = p.model
    p.opt = torch.optim.AdamW(
        [{"params": [m.inp.weight, m.inp.bias]}, {"params": [m.out.weight, m.out.bias]}]
    )
    p.sched = torch.optim.lr_scheduler.LambdaLR(p.opt, lambda s: 1.0)
    p.step()
    p.checkpointer(tmp_path).save(1)

    q = Problem()
    m = q.model
    q.opt = torch.optim.AdamW(
        [{"params": [m.inp.weight, m.out.bias]}, {"params": [m.out.weight, m.inp.bias]}]
    )
    q.sched = torch.optim.lr_scheduler.LambdaLR(q.opt, lambda s: 1.0)
    with pytest.raises(ub.CheckpointError, match=r"group 0.*out\.bias"):
        q.checkpointer(tmp_path).restore()


# Another optimizer class ----------------------------------------------------------------


def _sgd(p: Problem) -> Problem:
    p.opt = torch.optim.SGD(p.model.parameters(), lr=0.1, momentum=0.9)
    p.sched = torch.optim.lr_scheduler.LambdaLR(p.opt, lambda s: 1.0)
    return p


def _saved_adamw(path, monkeypatch=None) -> None:
    p = Problem()
    for _ in range(3):
        p.step()
    if monkeypatch is not None:  # a checkpoint from before the class was recorded
        capture = live_optimizer.OptimizerComponent._capture_one

        def unrecorded(self, name, opt):
            out = capture(self, name, opt)
            del out[live_optimizer.OPTIMIZER_CLASS]
            return out

        monkeypatch.setattr(live_optimizer.OptimizerComponent, "_capture_one", unrecorded)
    p.checkpointer(path).save(3)
    if monkeypatch is not None:
        monkeypatch.undo()


def test_another_optimizer_class_is_named_before_anything_changes(tmp_path):
    """AdamW saved, SGD live: "saved AdamW, live SGD" with the state and group keys that
    tell, and what to do; not a diff of param_group keys after installing."""
    _saved_adamw(tmp_path)
    q = _sgd(Problem(seed=1))
    before = {k: v.clone() for k, v in q.model.state_dict().items()}
    with pytest.raises(ub.StateMismatchError) as info:
        q.checkpointer(tmp_path).restore()
    message = str(info.value)
    assert "saved AdamW, live SGD" in message
    for told in ("exp_avg", "betas", "momentum", "reset={'optimizer'}"):
        assert told in message
    assert "nothing was changed" not in message  # refused before any install
    for k, v in q.model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_another_optimizer_class_without_a_recorded_class_is_told_by_its_keys(
    tmp_path, monkeypatch
):
    """A checkpoint that does not record its optimizer's class: the tell-tale state and
    param group keys name it as another optimizer class."""
    _saved_adamw(tmp_path, monkeypatch)
    q = _sgd(Problem(seed=1))
    with pytest.raises(ub.StateMismatchError) as info:
        q.checkpointer(tmp_path).restore()
    message = str(info.value)
    assert "another optimizer class than the live SGD" in message
    for told in ("exp_avg", "betas", "momentum"):
        assert told in message


def test_a_checkpoint_without_a_recorded_class_still_restores(tmp_path, monkeypatch):
    """Checkpoints saved before the class was recorded restore, verified, into the same
    optimizer."""
    _saved_adamw(tmp_path, monkeypatch)
    q = Problem(seed=1)
    assert q.checkpointer(tmp_path).restore().verified


class RenamedAdamW(torch.optim.AdamW):
    """Another class whose state and param groups are AdamW's."""


def test_another_class_whose_state_fits_restores(tmp_path):
    """A recorded class that differs is not refused where the state and groups fit (a
    subclass, a rename): the saved ones are installed and verified."""
    _saved_adamw(tmp_path)
    q = Problem(seed=1)
    q.opt = RenamedAdamW(q.model.parameters(), lr=3e-2, weight_decay=0.01)
    q.sched = torch.optim.lr_scheduler.LambdaLR(q.opt, lambda s: min(1.0, (s + 1) / 4))
    assert q.checkpointer(tmp_path).restore().verified


class _Refusing:
    """An extra that saves fine and refuses to load: the restore rolls back."""

    def state_dict(self):
        return {"n": 1}

    def load_state_dict(self, state):
        raise ValueError("refused on purpose")


def test_a_failed_restore_puts_a_read_only_wrapper_back(tmp_path):
    """The undo of a wrapper whose ``state``/``param_groups`` cannot be assigned puts the
    previous state back into the ones it gives."""
    p = _wrapped("read-only-properties")
    for _ in range(4):
        p.step()
    p.checkpointer(tmp_path, extra={"x": _Refusing()}).save(4)

    q = _wrapped("read-only-properties")
    q.step()
    before = _base_state(q)
    with pytest.raises(ValueError, match="refused on purpose"):
        q.checkpointer(tmp_path, extra={"x": _Refusing()}).restore()
    after = _base_state(q)
    assert before["param_groups"] == after["param_groups"]
    for i, entries in before["state"].items():
        for k, v in entries.items():
            assert torch.equal(v, after["state"][i][k]), (i, k)
    q.step()  # still a working optimizer
