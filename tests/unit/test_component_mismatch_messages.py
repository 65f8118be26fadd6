"""A relaunch whose components differ from the checkpoint's is told about every one of
them at once, with the one ``skip=`` or ``reset=`` that covers them all; the optimizer's
consequence (AdamW silently reset) only when an optimizer is among them."""

from __future__ import annotations

import ast
import re

import pytest
import torch

import unbroken as ub
from conftest import Problem
from unbroken.core import restoring
from unbroken.live.components import build_components


class Position:
    """A data position (the dataloader) or any small stateful extra."""

    def __init__(self, at: int = 0) -> None:
        self.at = at

    def state_dict(self) -> dict:
        return {"at": self.at}

    def load_state_dict(self, state: dict) -> None:
        self.at = state["at"]


def _named(message: str, option: str) -> set[str]:
    """The set that the message's ``option={...}`` names (exactly one such set)."""
    found = re.findall(rf"{option}=(\{{[^}}]*\}})", message)
    assert len(found) == 1, message
    return ast.literal_eval(found[0])


def _save_everything(path) -> Problem:
    p = Problem()
    p.step()
    critic = torch.optim.SGD(p.model.parameters(), lr=0.1, momentum=0.9)
    p.checkpointer(
        path, dataloader=Position(3), extra={"counter": Position(5), "critic_opt": critic}
    ).save(1)
    return p


def test_every_saved_component_left_out_is_named_with_one_skip(tmp_path):
    _save_everything(tmp_path / "c")
    fresh = Problem(seed=2)
    ckpt = ub.Checkpointer(tmp_path / "c", model=fresh.model)
    with pytest.raises(ub.StateMismatchError) as err:
        ckpt.restore()
    message = str(err.value)
    want = {"optimizer", "scheduler", "dataloader", "counter", "critic_opt"}
    assert _named(message, "skip") == want
    for name in want:
        assert repr(name) in message
    reset = re.findall(r"\(for ([^:]*): AdamW silently reset\)", message)
    assert len(reset) == 1 and ast.literal_eval(f"{{{reset[0]}}}") == {"optimizer", "critic_opt"}
    report = ckpt.restore(skip=want)  # the suggestion works as given
    assert report.step == 1 and {report.components[n] for n in want} == {"absent"}


def test_no_optimizer_consequence_when_no_optimizer_is_left_out(tmp_path):
    p = _save_everything(tmp_path / "c")
    critic = torch.optim.SGD(p.model.parameters(), lr=0.1, momentum=0.9)
    ckpt = p.checkpointer(tmp_path / "c", extra={"critic_opt": critic})
    with pytest.raises(ub.StateMismatchError) as err:
        ckpt.restore()
    message = str(err.value)
    assert _named(message, "skip") == {"dataloader", "counter"}
    assert "AdamW" not in message and "optimizer" not in message.replace("critic_opt", "")


def test_every_passed_component_the_checkpoint_lacks_is_named_with_one_reset(tmp_path):
    p = Problem()
    p.step()
    ub.Checkpointer(tmp_path / "c", model=p.model).save(1)
    fresh = Problem(seed=2)
    ckpt = fresh.checkpointer(tmp_path / "c", dataloader=Position(), extra={"counter": Position()})
    with pytest.raises(ub.IncompleteCheckpointError) as err:
        ckpt.restore()
    message = str(err.value)
    want = {"optimizer", "scheduler", "counter", "dataloader"}
    assert _named(message, "reset") == want
    assert "not in the checkpoint of step 1" in message
    report = ckpt.restore(reset=want)
    assert {report.components[n] for n in want} == {"reset"}


def test_absent_and_unmappable_per_rank_state_share_one_reset():
    """Per-rank state of another world size and absent components, named together."""
    model = torch.nn.Linear(2, 2)
    components = build_components(model, None, None, Position(), {"counter": Position()})
    doc = {
        "step": 7,
        "world_size": 2,
        "components": {
            "model": {"state": {}},
            "dataloader": {"per_rank": True, "ranks": {}},
            "rng": {"per_rank": True, "ranks": {}},
        },
    }
    request = restoring.RestoreRequest(reset=set(), skip=set())
    with pytest.raises(ub.IncompleteCheckpointError) as err:
        restoring.plan_components(doc, components, request)
    message = str(err.value)
    assert _named(message, "reset") == {"counter", "dataloader", "rng"}
    assert "'counter' passed to the Checkpointer but not in the checkpoint of step 7" in message
    assert "'dataloader', 'rng': per-rank state saved by 2 rank(s), not mappable onto 1" in message
