"""Everything in an optimizer's state_dict() comes back exactly (issue 10, items 2 and 7).

DESIGN.md F1 (every saved tensor restored or named in an error) and F5 (exact dtype and
value): wrappers' extra top-level entries, state under keys that are not parameters and
fp32 state nested in lists of a bf16 model were dropped, crashed or were cast; optimizer
state that no longer fits its parameter was installed without a word.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import unbroken as ub
from conftest import Problem


class CountingAdamW(torch.optim.AdamW):
    """A wrapper that keeps its own entry beside ``state`` and ``param_groups``."""

    def __init__(self, params, **kwargs) -> None:
        super().__init__(params, **kwargs)
        self.lookahead = {"counter": 0, "slow": [p.detach().clone() for p in self._all()]}

    def _all(self):
        return [p for g in self.param_groups for p in g["params"]]

    def step(self, closure=None):
        out = super().step(closure)
        self.lookahead["counter"] += 1
        if self.lookahead["counter"] % 3 == 0:  # pull weights halfway to the slow copy
            with torch.no_grad():
                for p, slow in zip(self._all(), self.lookahead["slow"], strict=True):
                    slow.add_(p - slow, alpha=0.5)
                    p.copy_(slow)
        return out

    def state_dict(self):
        sd = super().state_dict()
        sd["lookahead"] = {"counter": self.lookahead["counter"], "slow": self.lookahead["slow"]}
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        saved = state_dict.pop("lookahead")
        self.lookahead = {"counter": saved["counter"], "slow": list(saved["slow"])}
        super().load_state_dict(state_dict)


class HistorySGD(torch.optim.Optimizer):
    """Keeps fp32 state nested in a list and a dict, and a global entry under a str key."""

    def __init__(self, params, lr=0.05, global_key=True) -> None:
        super().__init__(params, {"lr": lr})
        self.global_key = global_key

    @torch.no_grad()
    def step(self, closure=None):
        if self.global_key:
            self.state["global"] = self.state.get("global", 0) + 1  # not a parameter key
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                if not st:
                    zeros = torch.zeros_like(p, dtype=torch.float32)
                    st["history"] = [zeros.clone(), zeros.clone()]
                    st["stats"] = {"ema": zeros.clone()}
                grad = p.grad.float()
                st["history"] = [st["history"][1], grad.clone()]
                st["stats"]["ema"].mul_(0.9).add_(grad, alpha=0.1)
                upd = st["stats"]["ema"] + 0.5 * (st["history"][1] - st["history"][0])
                p.sub_((group["lr"] * upd).to(p.dtype))


def _run(problem: Problem, steps: int) -> list[float]:
    return [problem.step() for _ in range(steps)]


def _with_optimizer(factory, dtype=torch.float32) -> Problem:
    p = Problem(dtype=dtype)
    p.opt = factory(p.model.parameters())
    p.sched = torch.optim.lr_scheduler.LambdaLR(p.opt, lambda s: 1.0)
    return p


@pytest.mark.parametrize(
    ("factory", "dtype"),
    [
        (lambda ps: CountingAdamW(ps, lr=3e-2), torch.float32),
        (lambda ps: HistorySGD(ps), torch.float32),
        (lambda ps: HistorySGD(ps, global_key=False), torch.bfloat16),
    ],
    ids=["extra-top-level-entry", "non-param-key", "nested-fp32-in-bf16"],
)
def test_whole_optimizer_state_dict_resumes_exactly(tmp_path, factory, dtype):
    """Everything in an optimizer's state_dict(): extra entries, non-parameter keys and
    nested fp32 state of a bf16 model come back exactly; the resumed run equals the straight
    one bit for bit."""
    straight = _with_optimizer(factory, dtype)
    expected = _run(straight, 10)

    first = _with_optimizer(factory, dtype)
    _run(first, 5)
    first.checkpointer(tmp_path).save(5)

    resumed = _with_optimizer(factory, dtype)
    report = resumed.checkpointer(tmp_path).restore()
    assert report.verified and report.step == 5
    assert _run(resumed, 5) == expected[5:]
    for a, b in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(resumed.opt, HistorySGD):
        if resumed.opt.global_key:
            assert resumed.opt.state["global"] == straight.opt.state["global"] == 10
        for p in resumed.model.parameters():
            assert all(h.dtype == torch.float32 for h in resumed.opt.state[p]["history"])
            assert resumed.opt.state[p]["stats"]["ema"].dtype == torch.float32
    else:
        assert resumed.opt.lookahead["counter"] == straight.opt.lookahead["counter"] == 10


def test_optimizer_state_that_no_longer_fits_its_parameter_is_refused_first(tmp_path):
    """Optimizer state shapes are checked against their parameters before anything is
    installed: a model whose layer grew, restored with reset={'model'}, must not get AdamW
    moments of the old shape (nor a changed scheduler or RNG)."""
    p = Problem()
    _run(p, 3)
    p.checkpointer(tmp_path).save(3)

    grown = Problem(seed=1)
    grown.model.inp = nn.Linear(4, 9)
    grown.model.out = nn.Linear(9, 1)
    grown.opt = torch.optim.AdamW(grown.model.parameters(), lr=3e-2)
    grown.sched = torch.optim.lr_scheduler.LambdaLR(grown.opt, lambda s: 1.0)
    sched_before = grown.sched.state_dict()
    rng_before = torch.get_rng_state()
    with pytest.raises(ub.StateMismatchError, match=r"inp\.weight/exp_avg: saved shape \(8, 4\)"):
        grown.checkpointer(tmp_path).restore(reset={"model"})
    assert not grown.opt.state
    assert grown.sched.state_dict() == sched_before
    assert torch.equal(torch.get_rng_state(), rng_before)
