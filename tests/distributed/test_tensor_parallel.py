"""FSDP2 + tensor parallelism, torchtitan's layout, on a (2, 2) ("dp", "tp") mesh: saved,
resumed bit for bit, and resharded to and from every other layout (issue 28).

Guards DESIGN.md F1/F2 (state dropped or misplaced when the layout changes: FSDP2 itself
shards TP weights again as ``_StridedShard``, which was refused) and the fingerprint that
counted a tensor on the "dp" sub-mesh once per "tp" rank (twice the true value: a sound
checkpoint called corrupt on any other layout, and by ``unbroken verify``).
"""

from __future__ import annotations

import pytest

from . import launcher, models, tp_models

pytestmark = pytest.mark.distributed

SAVED_AT, MORE = 2, 2


def _dp_rank(rank: int, tp: int) -> int:
    return rank // tp


def _straight(rank: int, world: int, path: str) -> dict:
    """Train on (2, 2), save at SAVED_AT, train MORE steps: the uninterrupted run."""
    import unbroken as ub

    model, opt = tp_models.build(0, dp=2, tp=2)
    tp_models.train(model, opt, SAVED_AT, start=0, dp_rank=_dp_rank(rank, 2))
    placements = {n: str(p.placements) for n, p in model.named_parameters()}
    ckpt = ub.Checkpointer(path, model=model, optimizer=opt)
    ckpt.save(SAVED_AT)
    ckpt.close()
    at_save = models.full_state(model, opt)
    losses = tp_models.train(model, opt, MORE, start=SAVED_AT, dp_rank=_dp_rank(rank, 2))
    final = models.full_state(model, opt)
    return {"placements": placements, "at_save": at_save, "losses": losses, "final": final}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fsdp_tp") / "ckpt")
    return path, launcher.run(_straight, 4, path)[0]


def _resume(rank: int, world: int, path: str, plain: str) -> dict:
    """Resume on (2, 2) and train MORE steps; and restore a plain checkpoint into (2, 2)."""
    import unbroken as ub

    model, opt = tp_models.build(7, dp=2, tp=2)
    report = ub.Checkpointer(path, model=model, optimizer=opt).restore()
    losses = tp_models.train(model, opt, MORE, start=SAVED_AT, dp_rank=_dp_rank(rank, 2))
    final = models.full_state(model, opt)
    model2, opt2 = tp_models.build(8, dp=2, tp=2)
    from_plain = ub.Checkpointer(plain, model=model2, optimizer=opt2).restore(reset={"rng"})
    others = {}
    for dp, tp in ((4, 1), (1, 4)):  # FSDP2 only and TP only, on the same 4 ranks
        model3, opt3 = tp_models.build(9, dp=dp, tp=tp)
        other = ub.Checkpointer(path, model=model3, optimizer=opt3).restore(reset={"rng"})
        others[(dp, tp)] = {"report": other, "state": models.full_state(model3, opt3)}
    return {
        "report": report,
        "losses": losses,
        "final": final,
        "from_plain": from_plain,
        "plain_state": models.full_state(model2, opt2),
        "others": others,
    }


def test_fsdp_tp_saves_strided_shards_and_resumes_bit_for_bit(saved, tmp_path):
    """The uninterrupted run and the resumed one give the same losses and final state bit
    for bit; a plain one-process checkpoint restores into FSDP2 + TP exactly; on the same
    4 ranks, FSDP2 only and TP only restore it exactly and say resharded (the world size
    did not change, the layout did); the recorded fingerprints are the true ones
    (``unbroken verify`` recomputes them)."""
    import unbroken as ub

    path, want = saved
    assert "_StridedShard" in want["placements"]["layers.0.up.weight"]
    assert ub.verify_checkpoint(path).ok
    plain = str(tmp_path / "plain")
    model, opt = tp_models.build(0)
    model.load_state_dict(want["at_save"]["model"])
    opt.load_state_dict(_plain_optimizer_state(model, opt, want["at_save"]["optimizer"]))
    ub.Checkpointer(plain, model=model, optimizer=opt).save(SAVED_AT)

    got = launcher.run(_resume, 4, path, plain)
    assert got[0]["report"].verified and not got[0]["report"].resharded
    assert got[0]["losses"] == want["losses"]
    models.assert_same_full_state(got[0]["final"], want["final"])
    report = got[0]["from_plain"]
    assert report.verified and report.resharded
    assert any("reduced in another order" in w for w in report.warnings)
    models.assert_same_full_state(got[0]["plain_state"], want["at_save"])
    for layout, result in got[0]["others"].items():  # the world size stays 4
        assert result["report"].verified and result["report"].resharded, layout
        models.assert_same_full_state(result["state"], want["at_save"])


def _plain_optimizer_state(model, opt, by_fqn: dict) -> dict:
    """AdamW's state_dict for ``model`` from state keyed by parameter FQN."""
    names = [n for n, _ in model.named_parameters()]
    sd = opt.state_dict()
    sd["state"] = {i: {k: v.clone() for k, v in by_fqn[n].items()} for i, n in enumerate(names)}
    return sd


def _restore_into_layouts(rank: int, world: int, path: str) -> dict:
    """On 2 ranks, restore into each other layout in turn: TP only (1, 2), FSDP2 only
    (2, 1)."""
    import unbroken as ub

    out = {}
    for dp, tp in ((1, 2), (2, 1)):
        model, opt = tp_models.build(5, dp=dp, tp=tp)
        report = ub.Checkpointer(path, model=model, optimizer=opt).restore(reset={"rng"})
        out[(dp, tp)] = {"report": report, "state": models.full_state(model, opt)}
    return out


def test_fsdp_tp_reshards_to_tp_only_fsdp_only_and_one_process(saved):
    """Restored into TP only (1, 2), FSDP2 only (2, 1) and one plain process, the state is
    the saved full state bit for bit, verified, and the report says resharded."""
    import unbroken as ub

    path, want = saved
    got = launcher.run(_restore_into_layouts, 2, path)[0]
    for layout, result in got.items():
        assert result["report"].verified and result["report"].resharded, layout
        models.assert_same_full_state(result["state"], want["at_save"])
    model, opt = tp_models.build(6)
    report = ub.Checkpointer(path, model=model, optimizer=opt).restore(reset={"rng"})
    assert report.verified and report.resharded
    models.assert_same_full_state(models.full_state(model, opt), want["at_save"])
