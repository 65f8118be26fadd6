"""A save in the middle of gradient accumulation (issue 36 item 6).

Before: a save between two micro-batches committed without the pending gradients, with no
warning and nothing in the manifest; the restore said verified and the resumed run
diverged. Now the save warns and records it, and ``gradients="save"`` keeps them so that
a stop between micro-batches resumes bit for bit.
"""

from __future__ import annotations

import pytest
import torch

import unbroken as ub
from conftest import Problem, assert_same_training_state
from unbroken.format import manifest

ACCUMULATE = 3  # micro-batches per optimizer step
PARAMETERS = ["inp.bias", "inp.weight", "out.bias", "out.weight"]


class Accumulating(Problem):
    """The learnable Problem trained with gradient accumulation: ``micro(i)`` runs the
    ``i``-th micro-batch (1-based) and steps the optimizer after every ``ACCUMULATE``."""

    def __init__(self, seed: int = 0, *, set_to_none: bool = True) -> None:
        super().__init__(seed)
        self.set_to_none = set_to_none

    def micro(self, i: int) -> float:
        x = torch.randn(16, 4)
        loss = (self.model(x) - torch.sin(x).sum(dim=1, keepdim=True)).pow(2).mean()
        (loss / ACCUMULATE).backward()
        if i % ACCUMULATE == 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad(set_to_none=self.set_to_none)
        return loss.item()


def _train(p: Accumulating, first: int, last: int) -> list[float]:
    return [p.micro(i) for i in range(first, last + 1)]


def _doc(ckpt_dir, step: int) -> dict:
    return manifest.read(ckpt_dir / f"step_{step:08d}")


def test_a_save_between_micro_batches_warns_and_records(ckpt_dir):
    """Item 6: a save holding pending gradients (4 micro-batches: one step, then one
    micro-batch's backward) warns naming how many parameters and which, says what to do,
    and the manifest records it; the restore repeats the warning. Old code: silent."""
    p = Accumulating()
    ckpt = p.checkpointer(ckpt_dir)
    ckpt.restore()
    _train(p, 1, 4)
    ckpt.save(4)
    ckpt.close()
    found = [w for w in ckpt.warnings if "gradient accumulation" in w]
    assert len(found) == 1, ckpt.warnings
    assert "4 parameter(s) hold nonzero gradients" in found[0]
    assert "inp.weight" in found[0] and 'gradients="save"' in found[0]
    assert "optimizer.step()" in found[0]
    doc = _doc(ckpt_dir, 4)
    assert doc["gradients"] == {"held": 4, "saved": False, "parameters": PARAMETERS}
    assert found[0] in doc["save_warnings"]
    report = Accumulating(seed=3).checkpointer(ckpt_dir).restore()
    assert report.verified and any("gradient accumulation" in w for w in report.warnings)


def test_a_save_at_a_step_boundary_says_nothing(ckpt_dir):
    """Item 6, no false alarm: after zero_grad() (None, torch's default) or
    zero_grad(set_to_none=False) (all-zero gradients: no pending work) the save neither
    warns nor records gradients."""
    for set_to_none in (True, False):
        p = Accumulating(set_to_none=set_to_none)
        folder = ckpt_dir / str(set_to_none)
        ckpt = p.checkpointer(folder)
        ckpt.restore()
        _train(p, 1, 6)
        assert all((q.grad is None) == set_to_none for q in p.model.parameters())
        ckpt.save(6)
        ckpt.close()
        assert not [w for w in ckpt.warnings if "gradient" in w], ckpt.warnings
        assert "gradients" not in _doc(folder, 6)


def test_gradients_an_optimizer_step_consumed_are_not_pending(ckpt_dir):
    """Item 6, no false alarm: a loop that calls zero_grad() at the start of each step
    keeps the gradients its last step used; they are no pending work (no warning). A
    backward after that step accumulates into them: pending again, warned."""
    p = Problem()
    ckpt = p.checkpointer(ckpt_dir)
    ckpt.restore()
    p.step(), p.step()
    assert all(q.grad is not None and q.grad.any() for q in p.model.parameters())
    ckpt.save(2)
    assert not [w for w in ckpt.warnings if "gradient" in w], ckpt.warnings
    assert "gradients" not in _doc(ckpt_dir, 2)
    p.model(torch.randn(4, 4)).sum().backward()
    ckpt.save(3)
    ckpt.close()
    assert _doc(ckpt_dir, 3)["gradients"]["held"] == 4


def test_a_gradient_of_one_parameter_is_named(ckpt_dir):
    """Item 6: one nonzero gradient among zero ones is found and named alone."""
    p = Accumulating(set_to_none=False)
    ckpt = p.checkpointer(ckpt_dir)
    ckpt.restore()
    _train(p, 1, 3)
    p.model.out.bias.grad.add_(1e-30)
    ckpt.save(3)
    ckpt.close()
    assert _doc(ckpt_dir, 3)["gradients"] == {
        "held": 1,
        "saved": False,
        "parameters": ["out.bias"],
    }


def _resume(ckpt_dir, stop: int, last: int, **options) -> tuple[Accumulating, list[float]]:
    torch.manual_seed(999)
    p = Accumulating(seed=7)
    ckpt = p.checkpointer(ckpt_dir, **options)
    report = ckpt.restore()
    assert report.step == stop and report.verified
    losses = _train(p, stop + 1, last)
    ckpt.close()
    return p, losses


@pytest.mark.parametrize("stop", [4, 5])
def test_saved_gradients_resume_bit_for_bit(tmp_path, stop):
    """Item 6, the exact path: with gradients="save" a stop between micro-batches (after
    one or two of three) resumes bit for bit: the gradients come back as saved, and
    parameters, AdamW state and losses after several more steps equal an uninterrupted
    run's. Without it the same resume diverges (what the warning is about)."""
    last = 12
    straight = Accumulating()
    expected = _train(straight, 1, last)

    first = Accumulating()
    ckpt = first.checkpointer(tmp_path / "saved", gradients="save")
    ckpt.restore()
    _train(first, 1, stop)
    held = {n: q.grad.clone() for n, q in first.model.named_parameters()}
    ckpt.save(stop)
    ckpt.close()
    assert not [w for w in ckpt.warnings if "gradient" in w]
    assert _doc(tmp_path / "saved", stop)["gradients"] == {
        "held": 4,
        "saved": True,
        "parameters": PARAMETERS,
    }

    torch.manual_seed(999)
    probe = Accumulating(seed=7)
    report = probe.checkpointer(tmp_path / "saved", gradients="save").restore()
    assert report.components["gradients"] == "restored"
    for n, q in probe.model.named_parameters():
        assert q.grad.dtype == held[n].dtype and torch.equal(q.grad, held[n]), n

    resumed, losses = _resume(tmp_path / "saved", stop, last, gradients="save")
    assert losses == expected[stop:]
    assert_same_training_state(straight, resumed)

    # The same stop without the gradients: the run diverges.
    lost = Accumulating()
    ckpt = lost.checkpointer(tmp_path / "lost")
    ckpt.restore()
    _train(lost, 1, stop)
    ckpt.save(stop)
    ckpt.close()
    diverged, losses = _resume(tmp_path / "lost", stop, last)
    assert losses != expected[stop:]
    assert not torch.equal(diverged.model.inp.weight, straight.model.inp.weight)


def test_saved_gradients_come_back_as_none_where_there_were_none(ckpt_dir):
    """Item 6: gradients="save" at a step boundary holds no gradients; the restore sets
    every live .grad to None, as at the save (a stale gradient would be stepped)."""
    p = Accumulating()
    ckpt = p.checkpointer(ckpt_dir, gradients="save")
    ckpt.restore()
    _train(p, 1, 3)
    ckpt.save(3)
    ckpt.close()
    assert "gradients" not in _doc(ckpt_dir, 3)
    q = Accumulating(seed=7)
    _train(q, 1, 2)  # stale gradients in the live model
    report = q.checkpointer(ckpt_dir, gradients="save").restore()
    assert report.components["gradients"] == "restored"
    assert all(t.grad is None for t in q.model.parameters())


def test_gradients_option_and_components_must_match(ckpt_dir):
    """Item 6: a bad ``gradients`` value is refused naming it; a checkpoint with saved
    gradients restored without gradients="save", or one without them restored with it,
    is refused naming 'gradients' and what to do."""
    p = Accumulating()
    with pytest.raises(ValueError, match="gradients must be 'warn' or 'save'"):
        p.checkpointer(ckpt_dir, gradients="keep")
    ckpt = p.checkpointer(ckpt_dir, gradients="save")
    ckpt.restore()
    _train(p, 1, 4)
    ckpt.save(4)
    ckpt.close()
    with pytest.raises(ub.StateMismatchError, match="'gradients'"):
        Accumulating(seed=7).checkpointer(ckpt_dir).restore()
    report = Accumulating(seed=7).checkpointer(ckpt_dir).restore(skip={"gradients"})
    assert report.components["gradients"] == "absent"

    other = ckpt_dir.parent / "other"
    q = Accumulating()
    ckpt = q.checkpointer(other)
    ckpt.restore()
    _train(q, 1, 3)
    ckpt.save(3)
    ckpt.close()
    with pytest.raises(ub.IncompleteCheckpointError, match="reset=\\{'gradients'\\}"):
        Accumulating(seed=7).checkpointer(other, gradients="save").restore()


def _tracked_run(folder, first: int, last: int, *, save: tuple[int, ...], **options) -> None:
    """Micro-batches ``first``..``last`` of one process's run, each loss tracked, saved at
    ``save`` (every checkpoint kept), after a restore of what ``folder`` holds."""
    torch.manual_seed(999)
    p = Accumulating(seed=7)
    ckpt = p.checkpointer(folder, keep_last=None, **options)
    assert ckpt.restore().step == first - 1
    for i in range(first, last + 1):
        ckpt.track(i, loss=p.micro(i))
        if i in save:
            ckpt.save(i)
    ckpt.close()


def _resume_test(tmp_path, stop: int, **options):
    from unbroken.proof.replay import compare

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _tracked_run(straight, 1, 12, save=(stop, 12), **options)
    _tracked_run(resumed, 1, stop, save=(stop,), **options)
    _tracked_run(resumed, stop + 1, 12, save=(12,), **options)
    return compare(straight, resumed, stop_at=stop)


def test_resume_test_cause_names_the_lost_gradients(tmp_path):
    """Item 6: the resume test of a stop between micro-batches fails, and its cause line
    says the checkpoint of the stop was saved in the middle of gradient accumulation
    without the gradients (old code: "the resume lost or changed something", no why)."""
    result = _resume_test(tmp_path, 4)
    assert not result.passed
    assert "identical at step 4" in result.cause
    assert "checkpoint of step 4 (4 parameter(s): inp.bias" in result.cause
    assert "middle of gradient accumulation" in result.cause
    assert 'gradients="save"' in result.cause


def test_resume_test_of_saved_gradients_is_identical(tmp_path):
    """Item 6: the same stop with gradients="save" proves identical."""
    result = _resume_test(tmp_path, 4, gradients="save")
    assert result.passed, (result.first_difference, result.cause)


@pytest.mark.parametrize("mode", [True, "overlap"])
def test_saved_gradients_are_those_of_the_save_with_async_save(tmp_path, mode):
    """Item 6 with async_save: the gradients are copied when save() returns, so the next
    micro-batches' backward (accumulating into them in place while the background save
    writes) does not reach the checkpoint; the resume is bit for bit."""
    straight = Accumulating()
    expected = _train(straight, 1, 9)
    p = Accumulating()
    ckpt = p.checkpointer(tmp_path, gradients="save", async_save=mode)
    ckpt.restore()
    _train(p, 1, 4)
    ckpt.save(4)
    _train(p, 5, 6)  # in place into the saved gradients, then a step
    ckpt.close()
    resumed, losses = _resume(tmp_path, 4, 9, gradients="save")
    assert losses == expected[4:]
    assert_same_training_state(straight, resumed)


def test_a_saved_gradient_that_does_not_fit_is_refused_by_name(ckpt_dir):
    """Item 6: a saved gradient whose parameter is now of another dtype is refused naming
    the parameter and what to do; the live model is left as it was."""
    p = Accumulating()
    ckpt = p.checkpointer(ckpt_dir, gradients="save")
    ckpt.restore()
    _train(p, 1, 4)
    ckpt.save(4)
    ckpt.close()
    q = Accumulating(seed=7)
    q.model.out.bias.data = q.model.out.bias.data.double()
    before = q.model.out.weight.detach().clone()
    with pytest.raises(ub.CheckpointError, match=r"'out.bias'.*reset=") as caught:
        q.checkpointer(ckpt_dir, gradients="save").restore()
    assert "gradient" in str(caught.value)
    assert torch.equal(q.model.out.weight, before) and q.model.out.weight.grad is None


@pytest.mark.parametrize(
    ("record", "field"),
    [
        (5, "gradients"),
        ({"held": "4", "saved": False, "parameters": []}, "gradients/held"),
        ({"held": 4, "saved": "no", "parameters": []}, "gradients/saved"),
        ({"held": 4, "saved": False, "parameters": [7]}, "gradients/parameters/0"),
    ],
    ids=["not-an-object", "held", "saved", "parameters"],
)
def test_a_hostile_gradients_record_is_damage(tmp_path, record, field):
    """Item 6: the manifest's new ``gradients`` record is checked by the schema like every
    field a reader uses (resume-test reads it): a malformed one, re-sealed, is damage
    named by its field, and restore() falls back to the older step."""
    import tamper
    from conftest import save_steps

    root = tmp_path / "run"
    save_steps(root)
    work = tamper.edited_copy(root, tmp_path / "work", lambda d: d.update(gradients=record))
    with pytest.raises(ub.CorruptCheckpointError, match=field):
        manifest.read(work / "step_00000002")
    report = Problem(seed=3).checkpointer(work).restore()
    assert report.step == 1 and any(field in w for w in report.warnings), report.warnings


def test_steps_taken_before_the_checkpointer_existed_are_not_pending(tmp_path):
    """No false alarm (issue 36, item 6): a run that trains a while before it builds its
    Checkpointer (a warm-up, a Checkpointer made at the first save) holds gradients that
    those steps used; the step watch runs from the import of unbroken, not from the
    Checkpointer, so they are not taken for accumulation in progress."""
    p = Problem()
    for _ in range(3):
        p.step()  # zero_grad() at the start of each step: the last gradients stay
    assert all(q.grad is not None for q in p.model.parameters())
    ckpt = p.checkpointer(tmp_path / "c")
    ckpt.save(3)
    assert not [w for w in ckpt.warnings if "gradient" in w], ckpt.warnings
    ckpt.close()
