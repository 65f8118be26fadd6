"""Ctrl-C during a restore's rollback (issue 29, item 5).

A restore that fails after it began installing puts every live object back. Before, the
rollback caught only ``Exception``: a ``KeyboardInterrupt`` arriving while it put one
component back stopped it there, and the live model was left half old, half new, silently
(the undos of the components not yet reached never ran). Now each undo can be run again
to complete what an interrupt cut short, the rollback runs every one to completion, then
raises the interrupt. Tried here at every line of the undo code in turn (a trace
function), for a model installed by exchanging bytes and one installed through
``load_state_dict`` (it has a load hook), with the optimizer, scheduler and RNG.
"""

from __future__ import annotations

import sys

import pytest
import torch

from conftest import Problem
from unbroken.core import transaction
from unbroken.live import exchange, optimizer, snapshot, state

# The code an interrupt is aimed at: what the rollback runs to put components back.
_TARGETS = {m.__file__ for m in (snapshot, exchange, state, optimizer)}


def _state(p: Problem) -> dict:
    return {
        "model": {k: v.clone() for k, v in p.model.state_dict().items()},
        "opt": {
            i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
            for i, s in enumerate(p.opt.state[q] for q in p.model.parameters())
        },
        "groups": [dict(g, params=None) for g in p.opt.param_groups],
        "sched": p.sched.state_dict(),
        "rng": torch.get_rng_state(),
    }


def _same(a: dict, b: dict) -> bool:
    if a["model"].keys() != b["model"].keys() or a["opt"].keys() != b["opt"].keys():
        return False
    if not all(torch.equal(v, b["model"][k]) for k, v in a["model"].items()):
        return False
    for i, st in a["opt"].items():
        if st.keys() != b["opt"][i].keys():
            return False
        for k, v in st.items():
            w = b["opt"][i][k]
            if not (torch.equal(v, w) if torch.is_tensor(v) else v == w):
                return False
    same_rng = torch.equal(a["rng"], b["rng"])
    return a["groups"] == b["groups"] and a["sched"] == b["sched"] and same_rng


def _with_hook(p: Problem) -> Problem:
    p.model.inp.register_load_state_dict_post_hook(lambda module, keys: None)
    return p


@pytest.mark.parametrize("build", [lambda p: p, _with_hook], ids=["exchanged", "load-state-dict"])
def test_an_interrupt_anywhere_in_the_rollback_leaves_everything_as_before(
    tmp_path, monkeypatch, build
):
    """A restore fails after installing everything (the probe differs) and is rolled
    back; a KeyboardInterrupt raised at each line of the rollback's undo code in turn
    (the model's, the optimizer's, the scheduler's and the RNG's): every time, the
    interrupt reaches the caller and the model, optimizer, scheduler and RNG are
    bit-identical to before the restore (or to the restored state). Before: the
    rollback stopped at the interrupt, the model or optimizer left half put back."""
    saved = Problem()
    for _ in range(3):
        saved.step()
    saved.checkpointer(tmp_path, probe=lambda m: m.out.bias.sum()).save(3)
    restored = _state(saved)
    planned: list[bool] = []
    real_plan = exchange.plan
    monkeypatch.setattr(exchange, "plan", lambda *a: planned.append(real_plan(*a) is not None)
                        or real_plan(*a))  # fmt: skip
    roll_back = transaction.Transaction._roll_back.__code__
    events = 1
    while True:
        live = build(Problem(seed=3))
        live.step()
        before = _state(live)
        seen, rolling = 0, False

        def tracer(frame, event, arg, stop_at=events):
            nonlocal seen, rolling
            if frame.f_code is roll_back:
                rolling = True
                return None
            if rolling and event == "line" and frame.f_code.co_filename in _TARGETS:
                seen += 1
                if seen == stop_at:
                    raise KeyboardInterrupt
            return tracer if rolling else None

        ckpt = live.checkpointer(tmp_path, probe=lambda m: m.out.bias.sum() + 1)
        sys.settrace(tracer)
        try:
            ckpt.restore()
            pytest.fail("the restore should fail (the probe differs)")
        except KeyboardInterrupt as exc:
            interrupted, cause, said = True, exc.__cause__, " ".join(getattr(exc, "__notes__", []))
        except Exception as exc:
            interrupted, cause, said = False, exc, str(exc)
        finally:
            sys.settrace(None)
        now = _state(live)
        assert _same(now, before) or _same(now, restored), f"interrupted at line {events}"
        # The interrupt reaches the caller, the restore's own error its cause, saying that
        # everything was put back.
        assert "probe differs" in str(cause) and "put back as it was" in said, (events, said)
        if not interrupted:
            break
        events += 1
    assert events > 20  # every line of the undos was interrupted once
    assert planned[0] is (build is not _with_hook)
