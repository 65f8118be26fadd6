"""``frozen="verify"``: trainable-only checkpoints whose frozen base is proven by
fingerprint (core/frozen.py).

The failures guarded against: a checkpoint that carries the frozen base every time (its
size), a resume on another base than the run trained on (nothing checks it: a changed
revision, another dtype, one flipped bit), a frozen parameter changed in place (an EMA)
and then silently lost because it was left out, and a progressive unfreezing whose
resume loses what the unfrozen parameters learned (DESIGN.md F1, F3: state silently
not restored)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

import unbroken as ub
from unbroken.format import manifest

FROZEN = ("0.weight", "0.bias", "2.weight", "2.bias")


def make_model(frozen=FROZEN, dtype=torch.float32) -> nn.Module:
    """The same 'pretrained base' on every call, with a head; ``frozen`` FQNs frozen."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3)
    ).to(dtype)
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    return model


def optimizer_for(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def batches(n: int, start: int = 0):
    """A learnable task (a fixed linear map), so a reset optimizer shows in the loss."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(6, 3, generator=g)
    for i in range(start, n):
        x = torch.randn(16, 6, generator=torch.Generator().manual_seed(100 + i))
        yield x, x @ w


def train(model, opt, start: int, end: int) -> list[float]:
    losses = []
    for x, y in batches(end, start):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def read_doc(ckpt_dir, step: int) -> dict:
    return json.loads((ckpt_dir / f"step_{step:08d}" / "manifest.json").read_text())


def test_trainable_only_resume_is_identical_and_small(tmp_path):
    """Frozen parameters are not written, the resume on the same base is bit for bit the
    uninterrupted run, and the checkpoint holds only the trainable part (F1, F3)."""
    straight = make_model()
    opt = optimizer_for(straight)
    losses = train(straight, opt, 0, 12)

    model = make_model()
    opt = optimizer_for(model)
    with ub.Checkpointer(tmp_path / "run", model=model, optimizer=opt, frozen="verify") as ck:
        ck.restore()
        first = train(model, opt, 0, 6)
        ck.save(6)
    doc = read_doc(tmp_path / "run", 6)
    assert doc["format_version"] == 2
    assert sorted(doc["frozen"]) == sorted(f"model/{f}" for f in FROZEN)
    assert not any(r["stored"] for r in doc["frozen"].values())
    assert not any(f"model/{f}" in doc["tensors"] for f in FROZEN)
    stored = sum(  # the model's and the optimizer's bytes (the RNG states add ~8 KB)
        c["length"]
        for key, entry in doc["tensors"].items()
        if key.startswith(("model/", "optimizer/"))
        for c in entry["chunks"]
    )
    trainable = sum(p.numel() * 4 * 3 for p in model.parameters() if p.requires_grad)  # p, m, v
    assert trainable <= stored <= trainable * 1.05, (stored, trainable)

    resumed = make_model()
    opt = optimizer_for(resumed)
    with ub.Checkpointer(tmp_path / "run", model=resumed, optimizer=opt, frozen="verify") as ck:
        report = ck.restore()
        assert report.frozen_verified == len(FROZEN)
        assert "frozen base: 4 parameter(s)" in str(report)
        rest = train(resumed, opt, 6, 12)
    assert first + rest == losses
    for (name, a), b in zip(
        straight.state_dict().items(), resumed.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name


def _saved(tmp_path, frozen=FROZEN, steps=3):
    model = make_model(frozen)
    opt = optimizer_for(model)
    with ub.Checkpointer(tmp_path / "run", model=model, optimizer=opt, frozen="verify") as ck:
        train(model, opt, 0, steps)
        ck.save(steps)
    return model


@pytest.mark.parametrize(
    "change, named",
    [
        ("bit", "model/2.weight: its values differ"),
        ("dtype", "model/0.weight: saved as float32, live float64"),
        ("unfrozen_elsewhere", None),
    ],
)
def test_another_base_is_refused_before_anything_changes(tmp_path, change, named):
    """A resume on a different base (one bit flipped in a frozen weight, another dtype)
    is refused naming the parameter, and nothing live changed."""
    _saved(tmp_path)
    model = make_model(dtype=torch.float64 if change == "dtype" else torch.float32)
    if change == "bit":
        with torch.no_grad():
            flat = model[2].weight.view(-1).view(torch.int32)
            flat[7] ^= 1  # the lowest mantissa bit of one weight
    if change == "unfrozen_elsewhere":
        model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3))
        named = "model/2.weight: saved shape (32, 32), live (3, 32)"
    opt = optimizer_for(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ck = ub.Checkpointer(tmp_path / "run", model=model, optimizer=opt, frozen="verify")
    with ck, pytest.raises(ub.StateMismatchError) as err:
        ck.restore()
    text = str(err.value)
    assert "the base model differs" in text and named in text
    assert "same base, revision and dtype" in text
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not opt.state


def test_frozen_parameter_changed_in_place_is_saved_in_full(tmp_path, caplog):
    """An EMA written into a frozen parameter between saves: that save stores it in full
    and warns naming it, and so does every later save; a resume from a fresh base gets
    the changed value, bit for bit (it was not silently left out)."""
    model = make_model()
    opt = optimizer_for(model)
    with ub.Checkpointer(tmp_path / "run", model=model, optimizer=opt, frozen="verify") as ck:
        train(model, opt, 0, 2)
        ck.save(2)
        with torch.no_grad():
            model[0].weight.mul_(0.999).add_(model[0].weight, alpha=0.001 * 0.5)
        train(model, opt, 2, 4)
        with caplog.at_level(logging.WARNING, logger="unbroken"):
            ck.save(4)
        assert any("model/0.weight" in w and "saved in full" in w for w in ck.warnings)
        assert any("model/0.weight" in r.getMessage() for r in caplog.records)
        train(model, opt, 4, 5)
        ck.save(5)
        assert not any("changed since the previous save" in w for w in ck.warnings)
    for step in (4, 5):
        doc = read_doc(tmp_path / "run", step)
        assert doc["frozen"]["model/0.weight"]["stored"] is True
        assert "model/0.weight" in doc["tensors"]
        assert doc["frozen"]["model/0.bias"]["stored"] is False
    assert "model/0.weight" in json.dumps(read_doc(tmp_path / "run", 4)["save_warnings"])

    resumed = make_model()
    opt2 = optimizer_for(resumed)
    with ub.Checkpointer(tmp_path / "run", model=resumed, optimizer=opt2, frozen="verify") as ck:
        ck.restore()
        ck.save(6)
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert read_doc(tmp_path / "run", 6)["frozen"]["model/0.weight"]["stored"] is True


class _Tied(nn.Module):
    """The model, with its head also reachable under a second name."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net
        self.shared = net[4]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_ties_follow_the_trainable_side(tmp_path):
    """A frozen parameter sharing memory with a trainable one, and one Parameter under two
    names (trainable), are saved: training changes them."""
    net = make_model()
    # a frozen Parameter over the memory of a trainable one (another object)
    net[4].register_parameter("alias", nn.Parameter(net[4].weight.detach(), False))
    model = _Tied(net)
    opt = optimizer_for(model)
    with ub.Checkpointer(tmp_path / "run", model=model, optimizer=opt, frozen="verify") as ck:
        train(model, opt, 0, 2)
        ck.save(2)
    doc = read_doc(tmp_path / "run", 2)
    assert "model/net.4.alias" in doc["tensors"] and "model/net.4.alias" not in doc["frozen"]
    assert "model/shared.weight" in doc["tensors"] or "model/net.4.weight" in doc["tensors"]
    assert "model/net.0.weight" in doc["frozen"] and "model/net.0.weight" not in doc["tensors"]


def _all_parameters(model: nn.Module) -> torch.optim.Optimizer:
    """An optimizer over every parameter, frozen or not (how progressive unfreezing is
    usually written: a frozen parameter gets no gradient, so no state)."""
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_progressive_unfreezing_resumes_both_ways(tmp_path):
    """Frozen at one checkpoint and trainable at the next, and the reverse: each resume
    from a fresh base restores what the run learned, bit for bit."""
    run = tmp_path / "run"
    model = make_model()
    opt = _all_parameters(model)
    with ub.Checkpointer(run, model=model, optimizer=opt, frozen="verify") as ck:
        train(model, opt, 0, 2)
        ck.save(2)

    # resumed with layer 2 unfrozen: it trains, so the next save stores it
    model = make_model(frozen=("0.weight", "0.bias"))
    opt = _all_parameters(model)
    with ub.Checkpointer(run, model=model, optimizer=opt, frozen="verify") as ck:
        assert ck.restore().frozen_verified == 4
        train(model, opt, 2, 4)
        ck.save(4)
    doc = read_doc(run, 4)
    assert "model/2.weight" in doc["tensors"] and "model/2.weight" not in doc["frozen"]

    # resumed with layer 2 frozen again: its trained values come from the checkpoint, and
    # later saves keep storing them (the base a resume loads does not hold them)
    model = make_model()
    opt = _all_parameters(model)
    with ub.Checkpointer(run, model=model, optimizer=opt, frozen="verify") as ck:
        assert ck.restore().frozen_verified == 2
        train(model, opt, 4, 5)
        ck.save(5)
    doc = read_doc(run, 5)
    assert "model/2.weight" in doc["tensors"] and "model/2.weight" not in doc["frozen"]
    assert doc["frozen"]["model/0.weight"]["stored"] is False
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    fresh = make_model()
    with ub.Checkpointer(run, model=fresh, optimizer=_all_parameters(fresh), frozen="verify") as ck:
        ck.restore()
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_either_mode_restores_the_other(tmp_path):
    """A full checkpoint restores under frozen="verify" (whose next save leaves out the
    base it finds unchanged), and a trainable-only one under frozen="save"."""
    model = make_model()
    opt = optimizer_for(model)
    with ub.Checkpointer(tmp_path / "run", model=model, optimizer=opt) as ck:
        train(model, opt, 0, 2)
        ck.save(2)
    assert "frozen" not in read_doc(tmp_path / "run", 2)
    model = make_model()
    opt = optimizer_for(model)
    with ub.Checkpointer(tmp_path / "run", model=model, optimizer=opt, frozen="verify") as ck:
        ck.restore()
        ck.save(3)
    doc = read_doc(tmp_path / "run", 3)
    assert not any(r["stored"] for r in doc["frozen"].values()) and len(doc["frozen"]) == 4
    model = make_model()
    opt = optimizer_for(model)
    with ub.Checkpointer(tmp_path / "run", model=model, optimizer=opt) as ck:
        assert ck.restore().frozen_verified == 4
        ck.save(4)
    assert "frozen" not in read_doc(tmp_path / "run", 4)


def test_frozen_mode_is_checked():
    with pytest.raises(ValueError, match='frozen must be "save" or "verify"'):
        ub.Checkpointer("/tmp/x", model=make_model(), frozen="skip")


def test_older_readers_refuse_a_trainable_only_checkpoint(tmp_path):
    """Format version 2 only where something is left out: older versions would find the
    frozen parameters missing, and say "upgrade" instead."""
    _saved(tmp_path)
    assert read_doc(tmp_path / "run", 3)["format_version"] == 2
    assert manifest.FORMAT_VERSION == 2


def test_inspect_and_verify_show_the_frozen_part(tmp_path):
    """The offline tools say what is not stored: inspect counts the frozen part, verify
    passes on what is stored and says the frozen part cannot be verified alone."""
    _saved(tmp_path)
    detail = ub.inspect_checkpoint(tmp_path / "run", step=3)
    assert detail.frozen is not None and detail.frozen.tensors == 4
    assert detail.frozen.bytes == (6 * 32 + 32 + 32 * 32 + 32) * 4
    assert detail.frozen.keys == sorted(f"model/{f}" for f in FROZEN)
    assert not any(t.key in detail.frozen.keys for t in detail.tensors)
    report = ub.verify_checkpoint(tmp_path / "run")
    assert report.ok
    notes = " ".join(w for c in report.checkpoints for w in c.warnings)
    assert "cannot be verified alone" in notes and "--base" in notes


def test_diff_compares_the_frozen_part_by_fingerprint(tmp_path):
    """diff of a full checkpoint and a trainable-only one of the same state: identical
    (the frozen part compared by fingerprint, not "only in A"); of two trainable-only ones
    on different bases: the changed parameter named."""
    for name, mode, nudge in (("full", "save", False), ("mine", "verify", False),
                              ("other", "verify", True)):  # fmt: skip
        model = make_model()
        if nudge:
            with torch.no_grad():
                model[0].bias[3] += 1
        opt = optimizer_for(model)
        with ub.Checkpointer(tmp_path / name, model=model, optimizer=opt, frozen=mode) as ck:
            train(model, opt, 0, 1)
            ck.save(1)
    same = ub.diff_checkpoints(tmp_path / "full", tmp_path / "mine")
    assert same.identical, [(t.key, t.status) for t in same.tensors if t.status != "equal"]
    other = ub.diff_checkpoints(tmp_path / "mine", tmp_path / "other")
    changed = {t.key: t.status for t in other.tensors if t.status != "equal"}
    assert changed.get("model/0.bias") == "values"
    assert "model/0.weight" not in changed


@pytest.mark.filterwarnings("ignore:LocalTier.*one node:UserWarning")
def test_local_tier_steps_are_trainable_only_too(tmp_path):
    """A local-tier step leaves the base out and proves it like a persistent one: the
    restore from it checks the base (another one is refused, not skipped for an older
    step or a fresh start) and resumes bit for bit."""
    straight = make_model()
    opt = optimizer_for(straight)
    losses = train(straight, opt, 0, 8)

    model = make_model()
    opt = optimizer_for(model)
    tier = ub.LocalTier(tmp_path / "shm")
    with ub.Checkpointer(tmp_path / "run", model=model, optimizer=opt, frozen="verify",
                         local=tier) as ck:  # fmt: skip
        first = train(model, opt, 0, 5)
        folder = ck.save(5, tier="local")
        ck.wait_replicated()
    doc = json.loads((Path(folder) / "manifest.json").read_text())
    assert doc["frozen"]["model/2.weight"]["stored"] is False
    assert "model/2.weight" not in doc["tensors"]

    other = make_model(dtype=torch.float64)
    ck = ub.Checkpointer(tmp_path / "run", model=other, optimizer=optimizer_for(other),
                         frozen="verify", local=ub.LocalTier(tmp_path / "shm"))  # fmt: skip
    with ck, pytest.raises(ub.StateMismatchError, match="base model differs"):
        ck.restore()  # not a fallback to an older step or a fresh start: the base is wrong

    resumed = make_model()
    opt = optimizer_for(resumed)
    with ub.Checkpointer(tmp_path / "run", model=resumed, optimizer=opt, frozen="verify",
                         local=ub.LocalTier(tmp_path / "shm")) as ck:  # fmt: skip
        report = ck.restore()
        assert (report.source, report.frozen_verified) == ("local", len(FROZEN))
        rest = train(resumed, opt, 5, 8)
    assert first + rest == losses


@pytest.mark.parametrize("mode", [True, "overlap"])
def test_async_saves_leave_the_base_out_too(tmp_path, mode):
    """With async_save, the staged copy holds only what is stored (no host copy of the
    base), and the resume is the uninterrupted run's, bit for bit."""
    straight = make_model()
    opt = optimizer_for(straight)
    losses = train(straight, opt, 0, 6)

    model = make_model()
    opt = optimizer_for(model)
    run = tmp_path / "run"
    with ub.Checkpointer(run, model=model, optimizer=opt, frozen="verify", async_save=mode) as ck:
        first = train(model, opt, 0, 3)
        ck.save(3)
        train(model, opt, 3, 4)  # trains while the save is written
    assert not any(f"model/{f}" in read_doc(run, 3)["tensors"] for f in FROZEN)
    resumed = make_model()
    opt = optimizer_for(resumed)
    with ub.Checkpointer(run, model=resumed, optimizer=opt, frozen="verify") as ck:
        assert ck.restore().frozen_verified == len(FROZEN)
        rest = train(resumed, opt, 3, 6)
    assert first + rest == losses
