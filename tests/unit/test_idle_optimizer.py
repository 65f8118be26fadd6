"""An optimizer that never steps while the model trains is named (issue 26, item 10).

Bug class: the Checkpointer is handed an optimizer built before the real one (which it
never sees): every checkpoint holds empty optimizer state while the model trains, the
restore says verified, ``unbroken verify`` exits 0 and nothing warns; a resume starts
the real optimizer from nothing. A save now compares the trained parameters'
fingerprints with the previous save's: changed, while an optimizer covering them holds
no state and did not step, is a warning (logged, ``ckpt.warnings``, the manifest's
``save_warnings``, the next restore's report, ``unbroken verify``), never an error.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from typer.testing import CliRunner

import unbroken as ub
from unbroken.errors import CorruptCheckpointError
from unbroken.format import manifest


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = 2) -> None:
    for _ in range(steps):
        loss = model(torch.randn(16, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _saved_warnings(folder, step: int) -> list[str]:
    doc = json.loads((folder / f"step_{step:08d}" / "manifest.json").read_text())
    return doc.get("save_warnings", [])


@pytest.mark.parametrize(
    "idle_kind",
    [
        lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        lambda ps: torch.optim.SGD(ps, lr=0.1),  # keeps no state, and also never steps
    ],
    ids=["adamw", "sgd-momentum", "sgd-plain"],
)
def test_an_optimizer_that_never_steps_is_named_at_the_next_save(ckpt_dir, caplog, idle_kind):
    model = _model()
    idle = idle_kind(model.parameters())  # built first, handed to the Checkpointer
    real = torch.optim.AdamW(model.parameters(), lr=1e-2)  # the one that trains
    ckpt = ub.Checkpointer(ckpt_dir, model=model, optimizer=idle)
    ckpt.restore()
    _train(model, real)
    ckpt.save(2)  # nothing to compare with yet: a fresh start
    assert ckpt.warnings == [] and _saved_warnings(ckpt_dir, 2) == []
    _train(model, real)
    with caplog.at_level(logging.WARNING, logger="unbroken"):
        ckpt.save(4)
    (warning,) = ckpt.warnings
    assert "holds no state at all and did not step since the checkpoint of step 2" in warning
    assert "'0.weight'" in warning and "4 of the 4 parameters" in warning
    assert "Seen: no per-parameter state, 0 optimizer steps" in warning
    assert _saved_warnings(ckpt_dir, 4) == [warning]
    assert any("holds no state at all" in r.getMessage() for r in caplog.records)
    ckpt.close()

    report = ub.verify_checkpoint(ckpt_dir)
    assert report.ok
    assert any("holds no state at all" in w for w in report.checkpoints[0].warnings)
    from unbroken.cli import app

    result = CliRunner().invoke(app, ["verify", str(ckpt_dir)], catch_exceptions=False)
    assert result.exit_code == 0 and "holds no state at all" in " ".join(result.stdout.split())

    relaunch = _model()
    again = ub.Checkpointer(ckpt_dir, model=relaunch, optimizer=idle_kind(relaunch.parameters()))
    restored = again.restore()
    assert any("saved with a warning" in w and "no state" in w for w in restored.warnings)
    again.close()


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.1),  # torch's SGD without momentum: no state
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    ],
    ids=["sgd-plain", "sgd-momentum", "adamw"],
)
def test_no_warning_for_the_optimizer_that_trains(ckpt_dir, make):
    """No false warning: an optimizer that steps is never named, even when it keeps no
    per-parameter state at all (plain SGD: ``state`` stays empty after every step)."""
    model = _model()
    opt = make(model.parameters())
    with ub.Checkpointer(ckpt_dir, model=model, optimizer=opt, keep_last=None) as ckpt:
        ckpt.restore()
        for step in (1, 2, 3):
            _train(model, opt)
            ckpt.save(step)
            assert ckpt.warnings == [], step
    assert all(_saved_warnings(ckpt_dir, s) == [] for s in (1, 2, 3))
    assert all(
        w.startswith("at save") is False
        for w in ub.verify_checkpoint(ckpt_dir).checkpoints[0].warnings
    )


def test_a_model_that_did_not_change_is_no_finding(ckpt_dir):
    """Saving twice without training (an evaluation pause) names nothing."""
    model = _model()
    idle = torch.optim.AdamW(model.parameters())
    with ub.Checkpointer(ckpt_dir, model=model, optimizer=idle, keep_last=None) as ckpt:
        ckpt.save(1)
        ckpt.save(2)
        assert ckpt.warnings == []


def test_after_a_restore_the_first_save_compares_with_the_restored_checkpoint(ckpt_dir):
    model = _model()
    real = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with ub.Checkpointer(ckpt_dir, model=model, optimizer=real) as ckpt:
        _train(model, real)
        ckpt.save(2)
    relaunch = _model()
    idle = torch.optim.AdamW(relaunch.parameters())
    ckpt = ub.Checkpointer(ckpt_dir, model=relaunch, optimizer=idle)
    assert ckpt.restore(reset={"optimizer"}).step == 2
    _train(relaunch, torch.optim.AdamW(relaunch.parameters(), lr=1e-2))
    ckpt.save(4)
    assert len(ckpt.warnings) == 1 and "since the checkpoint of step 2" in ckpt.warnings[0]
    ckpt.close()


def test_a_dict_of_optimizers_names_only_the_idle_one(ckpt_dir):
    torch.manual_seed(0)
    actor, critic = torch.nn.Linear(4, 2), torch.nn.Linear(4, 1)
    a_opt = torch.optim.AdamW(actor.parameters(), lr=1e-2)
    c_idle = torch.optim.AdamW(critic.parameters())
    c_real = torch.optim.AdamW(critic.parameters(), lr=1e-2)
    models, opts = {"actor": actor, "critic": critic}, {"actor": a_opt, "critic": c_idle}
    with ub.Checkpointer(ckpt_dir, model=models, optimizer=opts, keep_last=None) as ckpt:
        for step in (1, 2):
            _train(actor, a_opt, 1)
            _train(critic, c_real, 1)
            ckpt.save(step)
        (warning,) = ckpt.warnings
    assert warning.startswith("optimizer['critic'] holds no state") and "'critic.weight'" in warning


def test_the_manifest_field_is_optional_and_checked(ckpt_dir):
    """Old manifests (no ``save_warnings``) stay valid; a malformed one is damage."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    with ub.Checkpointer(ckpt_dir, model=model, optimizer=opt) as ckpt:
        ckpt.save(1)
    folder = ckpt_dir / "step_00000001"
    doc = manifest.read(folder)
    assert "save_warnings" not in doc
    doc.pop("format"), doc.pop("format_version")
    manifest.write(folder, {**doc, "save_warnings": ["a note"]})
    assert manifest.read(folder)["save_warnings"] == ["a note"]
    manifest.write(folder, {**doc, "save_warnings": [3]})
    with pytest.raises(CorruptCheckpointError, match="save_warnings/0"):
        manifest.read(folder)
