"""`unbroken diff`: logical tensors compared across steps, dtypes and world sizes."""

from __future__ import annotations

import math

import torch
from torch import nn

import unbroken as ub
from conftest import Problem

from .conftest import run_cli, run_json


def test_a_checkpoint_equals_itself(single_run):
    info = run_json("diff", single_run, single_run / "step_00000004")
    assert info["identical"] is True
    assert {t["status"] for t in info["tensors"]} == {"equal"}
    human = run_cli("diff", single_run, single_run)
    assert human.exit_code == 0 and "identical" in human.stdout


def test_two_steps_differ(single_run):
    result = run_cli("diff", single_run / "step_00000002", single_run, "--json")
    assert result.exit_code == 1
    import json

    info = json.loads(result.stdout)
    assert info["identical"] is False
    rows = {t["key"]: t for t in info["tensors"]}
    w = rows["model/inp.weight"]
    assert w["status"] == "values" and 0 < w["differing"] <= 32 and w["max_abs_diff"] > 0
    assert rows["model/seen"]["max_abs_diff"] == 16.0 * 2  # 16 samples a step, 2 more steps
    comps = {c["name"]: c for c in info["components"]}
    assert comps["model"]["status"] == "different" and comps["model"]["different"] >= 4
    assert any("last_epoch" in d for d in comps["scheduler"]["state_differences"])
    human = run_cli("diff", single_run / "step_00000002", single_run)
    assert human.exit_code == 1 and "model/inp.weight" in human.stdout


def test_max_abs_diff_is_exact(tmp_path):
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        b.weight[1, 0] += 0.25
        b.bias[0] = float("nan")
    ub.Checkpointer(tmp_path / "a", model=a).save(1)
    ub.Checkpointer(tmp_path / "b", model=b).save(1)
    info = run_json("diff", tmp_path / "a", tmp_path / "b", "--full", "--ignore", "rng", code=1)
    rows = {t["key"]: t for t in info["tensors"]}
    assert rows["model/weight"]["differing"] == 1
    assert math.isclose(rows["model/weight"]["max_abs_diff"], 0.25, rel_tol=1e-6)
    assert rows["model/bias"]["max_abs_diff"] == "nan" and rows["model/bias"]["differing"] == 1
    assert {c["name"]: c["status"] for c in info["components"]}["rng"] == "skipped"


def test_dtype_shape_and_missing_tensors(tmp_path):
    fp32 = Problem()
    bf16 = Problem(dtype=torch.bfloat16)
    ub.Checkpointer(tmp_path / "a", model=fp32.model).save(1)
    ub.Checkpointer(tmp_path / "b", model=bf16.model).save(1)
    info = run_json("diff", tmp_path / "a", tmp_path / "b", "--ignore", "rng", code=1)
    rows = {t["key"]: t for t in info["tensors"]}
    w = rows["model/inp.weight"]
    assert (w["status"], w["dtype_a"], w["dtype_b"]) == ("dtype", "float32", "bfloat16")
    assert 0 < w["max_abs_diff"] < 0.01  # the same init, rounded to bf16
    assert rows["model/seen"]["status"] == "equal"

    other = nn.Module()
    other.inp, other.out = nn.Linear(4, 9), nn.Linear(9, 1)
    other.extra = nn.Linear(1, 1)
    ub.Checkpointer(tmp_path / "c", model=other).save(1)
    info = run_json("diff", tmp_path / "a", tmp_path / "c", "--ignore", "rng", code=1)
    status = {t["key"]: t["status"] for t in info["tensors"]}
    assert status["model/inp.weight"] == "shape" and status["model/seen"] == "only_a"
    assert status["model/extra.weight"] == "only_b"


def test_fsdp_two_ranks_equals_one_process_resave(fsdp_run, fsdp_resaved):
    info = run_json("diff", fsdp_run[0], fsdp_resaved)
    assert info["a"]["world_size"] == 2 and info["b"]["world_size"] == 1
    assert info["identical"] is True
    comps = {c["name"]: c for c in info["components"]}
    assert comps["rng"]["status"] == "skipped" and "not comparable" in comps["rng"]["note"]
    assert comps["model"]["equal"] == 14 and comps["optimizer"]["status"] == "identical"
    # Bytes too, not only fingerprints.
    assert run_cli("diff", fsdp_run[0], fsdp_resaved, "--full").exit_code == 0


def test_usage_errors(single_run, tmp_path):
    result = run_cli("diff", single_run, tmp_path)
    assert result.exit_code == 2 and "CheckpointNotFoundError" in result.stderr
    assert run_cli("diff", single_run).exit_code == 2  # B missing: click usage error


def _deep_runs(tmp_path):
    """Checkpoints of a 12-layer model one training step apart (with its optimizer, a param
    group per layer, each group's lr halved in between), and between them one draw each
    from Python's and NumPy's global generators."""
    import random

    import numpy as np

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(12)])
    opt = torch.optim.AdamW([{"params": layer.parameters()} for layer in model], lr=0.1)
    for name in ("a", "b"):
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
        ub.Checkpointer(tmp_path / name, model=model, optimizer=opt).save(1)
        random.random(), np.random.rand()
        for group in opt.param_groups:
            group["lr"] /= 2
    return tmp_path / "a", tmp_path / "b"


def test_diff_summarizes_rng_state_one_line_per_generator(tmp_path):
    """The RNG state is summarized one line per generator (same/differs), instead of a line
    per differing state word (Python's generator alone has 624)."""
    a, b = _deep_runs(tmp_path)
    out = run_cli("diff", a, b).stdout
    assert "rng state, per generator:" in out
    lines = [line.split() for line in out.splitlines() if line.startswith("  ")]
    assert [" ".join(words) for words in lines] == [
        "python random differs", "numpy differs", "torch CPU differs"]  # fmt: skip
    assert "rng/python/state" not in out and "rng/rank_00000" not in out
    rng = run_json("diff", a, b, code=1)["rng"]
    assert [(g["label"], g["status"]) for g in rng] == [
        ("python random", "differs"), ("numpy", "differs"), ("torch CPU", "differs")]  # fmt: skip


def test_diff_caps_listings_and_sorts_keys_naturally(tmp_path):
    """Every listing is capped with a count of what was left out, and keys sort naturally
    (layer 2 before layer 10), in the table and in --json."""
    a, b = _deep_runs(tmp_path)
    result = run_cli("diff", a, b)
    assert result.exit_code == 1
    rows = [line for line in result.stdout.splitlines() if line.startswith("│ ")]
    assert len(rows) == 20 + 3  # 20 tensors; components model, optimizer, rng
    differing = 12 * 2 * 4  # weight and bias of 12 layers; the model, exp_avg, _sq, step
    assert f"... and {differing - 20} more tensor(s) differ (--json lists all)" in result.stdout
    state = [line for line in result.stdout.splitlines() if line.startswith("state differs:")]
    assert len(state) == 10 and "param_groups/0/lr: 0.1 vs 0.05" in state[0]
    assert "... and 2 more state difference(s) in optimizer (--json lists all)" in result.stdout
    keys = [row.split()[1] for row in rows if row.split()[1].startswith("model/")]
    assert keys[:6] == ["model/0.bias", "model/0.weight", "model/1.bias", "model/1.weight",
                        "model/2.bias", "model/2.weight"]  # fmt: skip
    listed = [t["key"] for t in run_json("diff", a, b, code=1)["tensors"]]
    assert listed.index("model/2.weight") < listed.index("model/10.weight")
    assert listed.index("optimizer/state/9.bias/step") < listed.index(
        "optimizer/state/10.bias/step"
    )


def test_two_negated_float64_weights_are_a_difference(tmp_path):
    """Issue 36 item 1: with the linear ``wsum64-v2`` fingerprint, two negated float64
    weights cancelled and ``unbroken diff`` (which compares fingerprints) said identical,
    exit 0. Every structured change is a difference now."""
    a, b = nn.Linear(4, 4).double(), nn.Linear(4, 4).double()
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        b.weight[0, 1] *= -1
        b.weight[3, 2] *= -1
    ub.Checkpointer(tmp_path / "a", model=a).save(1)
    ub.Checkpointer(tmp_path / "b", model=b).save(1)
    info = run_json("diff", tmp_path / "a", tmp_path / "b", "--ignore", "rng", code=1)
    rows = {t["key"]: t for t in info["tensors"]}
    assert info["identical"] is False and rows["model/weight"]["status"] == "values"
