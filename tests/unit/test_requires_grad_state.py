"""A tensor saved with requires_grad=True comes back with it (an extra's learnable value);
skeletons written before the flag existed decode as they always did."""

from __future__ import annotations

import json

import pytest
import torch

import tamper
import unbroken as ub
from conftest import Problem
from unbroken.format import manifest, state_compare, tree


class Learnable:
    """An extra whose state holds a leaf that requires grad, and one that does not."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.temperature = torch.randn(3, generator=g).requires_grad_(True)
        self.count = torch.tensor([seed])

    def state_dict(self) -> dict:
        return {"temperature": self.temperature, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.temperature, self.count = state["temperature"], state["count"]


def test_an_extra_tensor_keeps_requires_grad_and_its_bits(tmp_path):
    p = Problem()
    p.step()
    saved = Learnable(seed=1)
    p.checkpointer(tmp_path / "c", extra={"learn": saved}).save(1)

    fresh, back = Problem(seed=3), Learnable(seed=2)
    report = fresh.checkpointer(tmp_path / "c", extra={"learn": back}).restore()
    assert report.step == 1 and report.verified
    assert back.temperature.requires_grad and back.temperature.is_leaf
    assert back.temperature.dtype == saved.temperature.dtype
    assert torch.equal(back.temperature.detach(), saved.temperature.detach())
    assert not back.count.requires_grad and torch.equal(back.count, saved.count)
    # Parameters and optimizer state go through their own components: unchanged.
    assert all(q.requires_grad for q in fresh.model.parameters())
    for state in fresh.opt.state.values():
        assert not any(v.requires_grad for v in state.values() if isinstance(v, torch.Tensor))
    doc = manifest.read(tmp_path / "c" / "step_00000001")
    model_refs = json.dumps(doc["components"]["model"]) + json.dumps(doc["components"]["optimizer"])
    assert "requires_grad" not in model_refs


def test_the_flag_round_trips_and_old_references_decode_as_before():
    tensors: dict = {}
    value = {"w": torch.ones(2, requires_grad=True), "b": torch.zeros(2)}
    skeleton = json.loads(json.dumps(tree.encode(value, "x", tensors)))
    assert skeleton["w"] == {tree.TAG: "tensor", "key": "x/w", "requires_grad": True}
    assert skeleton["b"] == {tree.TAG: "tensor", "key": "x/b"}  # as older versions wrote
    tree.check_skeleton(skeleton, {"x/w", "x/b"})
    loaded = {k: v.detach().clone() for k, v in tensors.items()}
    back = tree.decode(skeleton, loaded)
    assert back["w"].requires_grad and back["w"].is_leaf and not back["b"].requires_grad
    assert not loaded["x/w"].requires_grad  # the loaded tensor itself is left as read


@pytest.mark.parametrize("flag", [False, 1, "true", None])
def test_a_malformed_flag_is_refused(flag):
    node = {"s": {tree.TAG: "tensor", "key": "x/s", "requires_grad": flag}}
    with pytest.raises(tree.SkeletonError, match=r"/s: a 'tensor' tag's 'requires_grad'"):
        tree.check_skeleton(node, None)


def test_an_integer_tensor_marked_requires_grad_is_refused():
    node = {tree.TAG: "tensor", "key": "x/n", "requires_grad": True}
    with pytest.raises(tree.SkeletonError, match=r"'x/n' is marked requires_grad"):
        tree.decode(node, {"x/n": torch.arange(3)})


def test_difference_names_a_lost_requires_grad():
    saved = {"w": {tree.TAG: "tensor", "key": "x/w", "requires_grad": True}}
    live = {"w": {tree.TAG: "tensor", "key": "x/w"}}
    assert state_compare.difference(saved, live, "extra") == (
        "extra/w (saved requires_grad=True, live requires_grad=False)"
    )
    assert state_compare.difference(saved, saved, "extra") is None


def test_a_sealed_manifest_marking_an_integer_tensor_is_damage_and_restore_falls_back(tmp_path):
    """A manifest (sealed with a valid checksum) that marks an integer tensor
    requires_grad is damage: restore() falls back to the older step with a warning naming
    the component, and restore(step=) raises CorruptCheckpointError, never a raw
    ValueError; nothing live changes."""
    p = Problem()
    ckpt = p.checkpointer(tmp_path / "c", extra={"learn": Learnable(seed=1)}, keep_last=None)
    p.step()
    ckpt.save(1)
    p.step()
    ckpt.save(2)
    ckpt.close()
    folder = tmp_path / "c" / "step_00000002"
    tamper.edit(
        folder, lambda d: d["components"]["learn"]["state"]["count"].update(requires_grad=True)
    )

    back = Learnable(seed=5)
    report = Problem(seed=3).checkpointer(tmp_path / "c", extra={"learn": back}).restore()
    assert report.step == 1
    assert any("step 2" in w and "'learn'" in w for w in report.warnings), report.warnings
    with pytest.raises(ub.CorruptCheckpointError, match="'learn'"):
        Problem(seed=3).checkpointer(tmp_path / "c", extra={"learn": Learnable(5)}).restore(step=2)
