"""`unbroken import`: torch.save files and DCP folders become checkpoints that resume exactly."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

import unbroken as ub

from . import factories
from .conftest import run_cli, run_json

SCHED = {"step_size": 2, "gamma": 0.5}


def _trained(factory=factories.model_and_adamw, steps=3):
    model, opt = factory()
    sched = torch.optim.lr_scheduler.StepLR(opt, **SCHED)
    factories.train(model, opt, range(steps), sched)
    return model, opt, sched


def _torch_save(path, model, opt, sched=None, **extra):
    obj = {"model": model.state_dict(), "optimizer": opt.state_dict(), **extra}
    if sched is not None:
        obj["scheduler"] = sched.state_dict()
    torch.save(obj, path)
    return path


def _restore(dest, factory=factories.model_and_adamw, with_sched=True):
    model, opt = factory()
    sched = torch.optim.lr_scheduler.StepLR(opt, **SCHED) if with_sched else None
    report = ub.Checkpointer(dest, model=model, optimizer=opt, scheduler=sched).restore()
    return model, opt, sched, report


def _assert_same(a, b):
    (ma, oa), (mb, ob) = a, b
    for (ka, va), (kb, vb) in zip(ma.state_dict().items(), mb.state_dict().items(), strict=True):
        assert ka == kb and va.dtype == vb.dtype and torch.equal(va, vb), ka
    assert oa.state_dict()["param_groups"] == ob.state_dict()["param_groups"]
    for pa, pb in zip(ma.parameters(), mb.parameters(), strict=True):
        sa, sb = oa.state[pa], ob.state[pb]
        assert sa.keys() == sb.keys() and sa, "optimizer state lost"
        for k in sa:
            assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


def _one_more_step_matches(a, b):
    (ma, oa, sa), (mb, ob, sb) = a, b
    assert factories.train(ma, oa, range(3, 4), sa) == factories.train(mb, ob, range(3, 4), sb)
    _assert_same((ma, oa), (mb, ob))


@pytest.mark.parametrize("factory", ["model_and_adamw", "model_only", "model_and_grouped_adamw"])
def test_torch_save_round_trip_resumes_bit_exactly(tmp_path, factory):
    builder = (
        factories.model_and_grouped_adamw if "grouped" in factory else factories.model_and_adamw
    )
    original = _trained(builder)
    src = _torch_save(tmp_path / "ckpt.pt", *original, step=3)
    info = run_json("import", src, tmp_path / "run", "--model", f"cli.factories:{factory}")
    assert info["step"] == 3 and info["scheduler"] and info["optimizer_params"] == 4
    assert info["optimizer"] == ("factory" if factory != "model_only" else
                                 "AdamW from the imported param groups")  # fmt: skip
    assert run_cli("verify", tmp_path / "run").exit_code == 0
    model, opt, sched, report = _restore(tmp_path / "run", builder)
    assert report.step == 3 and report.verified
    assert sched.state_dict() == original[2].state_dict()
    _assert_same(original[:2], (model, opt))
    _one_more_step_matches(original, (model, opt, sched))


def test_grouped_optimizer_needs_its_factory(tmp_path):
    src = _torch_save(tmp_path / "ckpt.pt", *_trained(factories.model_and_grouped_adamw), step=3)
    result = run_cli("import", src, tmp_path / "run", "--model", "cli.factories:model_only")
    assert result.exit_code == 1 and "StateMismatchError" in result.stderr
    assert "exp_avg" in result.stderr and "return (model, optimizer)" in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda o: o["optimizer"]["state"].update({99: {"step": torch.tensor(1.0)}}),
         "position(s) 99 belongs to no param group"),
        (lambda o: o["optimizer"]["param_groups"][0]["params"].pop(), "holds 3 parameter(s)"),
        (lambda o: o.update(config={"lr": 1}), "config"),
        (lambda o: o["model"].update(extra=torch.zeros(1)), "extra"),
        (lambda o: o["model"].pop("out.bias"), "out.bias"),
        (lambda o: o["model"].update({"inp.weight": o["model"]["inp.weight"].double()}),
         "float64"),
    ],
    ids=["orphan-state", "param-count", "unknown-entry", "unexpected-tensor", "missing-tensor",
         "dtype"],
)  # fmt: skip
def test_unmappable_entries_are_errors(tmp_path, edit, match):
    model, opt, _ = _trained()
    obj = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 3}
    edit(obj)
    torch.save(obj, tmp_path / "bad.pt")
    result = run_cli("import", tmp_path / "bad.pt", tmp_path / "run", "--model",
                     "cli.factories:model_only")  # fmt: skip
    assert result.exit_code == 1, result.stdout
    assert match in result.stderr
    assert not (tmp_path / "run").exists()


def test_ignore_leaves_a_top_level_entry_out(tmp_path):
    src = _torch_save(tmp_path / "c.pt", *_trained()[:2], step=3, config={"lr": 1})
    dest = tmp_path / "run"
    info = run_json("import", src, dest, "--model", "cli.factories:model_and_adamw",
                    "--ignore", "config")  # fmt: skip
    assert info["ignored"] == ["config"] and info["scheduler"] is False


def test_optimizer_of_another_kind_needs_its_factory(tmp_path):
    model, opt = factories.model_and_sgd()
    factories.train(model, opt, range(2))
    src = _torch_save(tmp_path / "sgd.pt", model, opt, step=2)
    bad = run_cli("import", src, tmp_path / "a", "--model", "cli.factories:model_only")
    assert bad.exit_code == 1 and "momentum_buffer" in bad.stderr
    ok = run_cli("import", src, tmp_path / "b", "--model", "cli.factories:model_and_sgd")
    assert ok.exit_code == 0, ok.stderr


def test_usage_errors(tmp_path):
    src = _torch_save(tmp_path / "c.pt", *_trained()[:2])  # no step recorded
    cases = [
        ((tmp_path / "absent.pt", tmp_path / "r", "--model", "cli.factories:model_only"),
         "does not exist"),
        ((src, tmp_path / "r", "--model", "no_such_module:f"), "cannot import"),
        ((src, tmp_path / "r", "--model", "cli.factories"), "package.module:factory"),
        ((src, tmp_path / "r", "--model", "cli.factories:not_a_model"), "returned int"),
        ((src, tmp_path / "r", "--model", "cli.factories:model_only"), "--step"),
    ]  # fmt: skip
    for args, match in cases:
        result = run_cli("import", *args)
        assert result.exit_code == 2, (args, result.stdout, result.stderr)
        assert match in result.stderr, result.stderr
    assert run_cli("import", src, tmp_path / "r", "--model", "cli.factories:model_only",
                   "--step", 5).exit_code == 0  # fmt: skip
    again = run_cli("import", src, tmp_path / "r", "--model", "cli.factories:model_only",
                    "--step", 5)  # fmt: skip
    assert again.exit_code == 2 and "already holds" in again.stderr


def _dcp_save(path, state):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path), no_dist=True)


@pytest.mark.parametrize("style", ["torchtitan", "unprefixed-nested"])
def test_dcp_round_trip_resumes_bit_exactly(tmp_path, style):
    model, opt, sched = _trained()
    flat = style == "torchtitan"
    osd = get_optimizer_state_dict(
        model, opt, options=StateDictOptions(flatten_optimizer_state_dict=flat)
    )
    if flat:
        state = {"model": get_model_state_dict(model), "optimizer": osd,
                 "lr_scheduler": sched.state_dict(), "train_state": {"step": 3}}  # fmt: skip
    else:
        state = {**get_model_state_dict(model), **osd}
    _dcp_save(tmp_path / "dcp", state)
    args = ["import", tmp_path / "dcp", tmp_path / "run", "--model", "cli.factories:model_only"]
    if flat:
        refused = run_cli(*args)
        assert refused.exit_code == 1 and "lr_scheduler" in refused.stderr
        args += ["--ignore", "lr_scheduler"]
    else:
        args += ["--step", 3]
    info = run_json(*args)
    assert info["source_kind"] == "dcp" and info["step"] == 3 and info["optimizer_params"] == 4
    restored_model, restored_opt, _, report = _restore(tmp_path / "run", with_sched=False)
    assert report.step == 3
    _assert_same((model, opt), (restored_model, restored_opt))
    x, _ = factories.batch(9)
    with torch.no_grad():
        assert torch.equal(model(x), restored_model(x))
    assert factories.train(model, opt, range(3, 4)) == factories.train(
        restored_model, restored_opt, range(3, 4)
    )


def test_arbitrary_pickled_objects_are_refused(tmp_path):
    model, opt = factories.model_and_adamw()
    torch.save({"model": model, "optimizer": opt.state_dict(), "step": 1}, tmp_path / "obj.pt")
    result = run_cli("import", tmp_path / "obj.pt", tmp_path / "run", "--model",
                     "cli.factories:model_only")  # fmt: skip
    assert result.exit_code == 1
    assert result.stderr.startswith("CorruptCheckpointError:") and "weights_only" in result.stderr
    assert not (tmp_path / "run").exists()
