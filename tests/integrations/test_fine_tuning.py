"""Fine-tunes checkpointed with ``frozen="verify"``: the recipes of docs/fine-tuning.md.

The ``lora`` (PEFT LoRA on a small Llama, a plain loop) and ``hand-frozen`` (the first
layers of a plain network frozen by hand) recipes run as printed under ``resume-test``,
stopped at step 15 and resumed: the resume must be IDENTICAL, the loss must fall (the
tasks are learnable, so an optimizer or adapter reset would show), and the checkpoint
must hold the trainable parameters and their AdamW state and nothing of the base (its
size within 5% of those bytes). The ``trainer-lora`` recipe (UnbrokenTrainer with
``UnbrokenCallback(frozen="verify")``) runs the same way, stopped mid-epoch.

In this process: a checkpoint of the ``lora`` recipe resumed onto another base (one bit
of a frozen weight flipped; the base in bfloat16) is refused before anything changes,
naming the parameter (DESIGN.md F1, F3: a resume on the wrong base must not pass).
"""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import unbroken as ub
from unbroken.integrations.transformers import UnbrokenCallback
from unbroken.testing import resume_test

from .recipes import ROOT, recipes, write_recipe

pytestmark = pytest.mark.e2e
PAGE = ROOT / "docs" / "fine-tuning.md"
STOP, STEPS = 15, 40
BUILD = {"lora": "lora_model", "hand-frozen": "partly_frozen"}  # the recipe's model builder
ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}


def _recipe(name: str) -> dict:
    """The recipe's names, without running its script (it runs under ``__main__`` only)."""
    namespace = {"__name__": f"fine_tuning_{name.replace('-', '_')}"}
    exec(compile(recipes(PAGE)[name], f"fine-tuning.md:{name}", "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def recipe_runs(tmp_path_factory) -> dict:
    """Both plain-loop recipes under resume-test at once (each run is one process);
    name -> (result, runs folder, seconds)."""
    root = tmp_path_factory.mktemp("fine-tuning")

    def run(name: str):
        script = write_recipe(PAGE, name, root)
        workdir = root / f"{name}-runs"
        began = time.monotonic()
        result = resume_test([sys.executable, str(script), "{dir}"], stop_at=STOP,
                             workdir=workdir, env=ENV, plot=False, timeout=240)  # fmt: skip
        return result, workdir, time.monotonic() - began

    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(run, name) for name in BUILD}
    return {name: future.result() for name, future in futures.items()}


def _losses(folder: Path) -> list[float]:
    lines = (folder / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["metrics"]["loss"] for line in lines if '"metrics"' in line]


def _manifest(run: Path, step: int) -> dict:
    return json.loads((run / f"step_{step:08d}" / "manifest.json").read_text(encoding="utf-8"))


def _stored_bytes(doc: dict) -> int:
    """The bytes of the model's and the optimizer's stored tensors (the RNGs add ~8 KB)."""
    return sum(
        chunk["length"]
        for key, entry in doc["tensors"].items()
        if key.startswith(("model/", "optimizer/"))
        for chunk in entry["chunks"]
    )


@pytest.mark.parametrize("name", list(BUILD))
def test_the_recipe_resumes_exactly_and_stores_no_base(recipe_runs, name, record_property):
    """Stopped at 15 and resumed in a fresh process on the same base (verified by
    fingerprint): every loss after 15 and the final state equal the straight run's; the
    loss falls; the checkpoint holds the trainable parameters, their AdamW state
    (exp_avg, exp_avg_sq, step) and no frozen parameter."""
    result, workdir, seconds = recipe_runs[name]
    assert result.passed and result.compared_steps == STEPS - STOP, str(result)
    losses = _losses(workdir / "straight")
    assert losses[-1] < losses[0] / 2, f"the model did not learn: {losses[0]} -> {losses[-1]}"

    model = _recipe(name)[BUILD[name]]()
    trainable = [p for p in model.parameters() if p.requires_grad]
    expected = sum(p.numel() * p.element_size() * 3 + 4 for p in trainable)  # p, m, v, step
    frozen = {f"model/{fqn}" for fqn, p in model.named_parameters() if not p.requires_grad}
    doc = _manifest(workdir / "straight", STEPS)
    stored = _stored_bytes(doc)
    base = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    record_property("checkpoint_bytes", stored)
    record_property("seconds", round(seconds, 1))
    print(f"{name}: {stored} bytes stored (trainable + AdamW: {expected}; base not stored: "
          f"{base}), resume-test in {seconds:.1f} s")  # fmt: skip
    assert abs(stored - expected) <= 0.05 * expected, (stored, expected)
    assert frozen and not frozen & set(doc["tensors"])
    assert set(doc["frozen"]) == frozen
    assert not any(record["stored"] for record in doc["frozen"].values())
    assert doc["format_version"] == 2


# -- the Trainer ----------------------------------------------------------------------------


def test_the_trainer_lora_recipe_resumes_exactly(tmp_path, record_property):
    """UnbrokenTrainer on a PEFT model with UnbrokenCallback(frozen="verify"), stopped at
    step 10 (mid-epoch): IDENTICAL, and its checkpoints leave the base out."""
    script = write_recipe(PAGE, "trainer-lora", tmp_path)
    began = time.monotonic()
    result = resume_test([sys.executable, str(script), "{dir}"], stop_at=10,
                         workdir=tmp_path / "runs", env=ENV, plot=False, timeout=240,
                         parallel=True)  # fmt: skip
    seconds = time.monotonic() - began
    record_property("seconds", round(seconds, 1))
    print(f"trainer-lora: resume-test in {seconds:.1f} s")
    assert result.passed and result.compared_steps > 0, str(result)
    doc = _manifest(tmp_path / "runs" / "straight", 24)
    assert doc["frozen"] and not any(r["stored"] for r in doc["frozen"].values())
    assert not set(doc["frozen"]) & set(doc["tensors"])
    assert "default" in doc["peft"]


def test_the_callback_checks_its_frozen_option(tmp_path):
    """A wrong value is refused when the callback is built, not at the first save."""
    with pytest.raises(ValueError, match='frozen must be "save" or "verify"'):
        UnbrokenCallback(tmp_path, frozen="skip")


# -- another base ---------------------------------------------------------------------------

FLIPPED = "model/base_model.model.model.layers.1.self_attn.v_proj.base_layer.weight"


@pytest.mark.parametrize(
    "change, named",
    [
        pytest.param("bit", f"{FLIPPED}: its values differ", id="one-bit-flipped"),
        pytest.param("bfloat16", "saved as float32, live bfloat16", id="bfloat16"),
    ],
)
def test_a_lora_resume_on_another_base_is_refused(tmp_path, change, named):
    """The lora recipe's checkpoint, resumed onto its base with one bit of a frozen weight
    flipped, or onto the base in bfloat16: refused naming the parameter, before anything
    changes (the model, the optimizer)."""
    recipe = _recipe("lora")
    recipe["main"](str(tmp_path / "run"), steps=3)
    model = recipe["lora_model"]()
    if change == "bit":
        fqn = FLIPPED.removeprefix("model/")
        with torch.no_grad():
            model.get_parameter(fqn).view(-1).view(torch.int32)[5] ^= 1  # lowest mantissa bit
    else:
        model.to(torch.bfloat16)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt = ub.Checkpointer(tmp_path / "run", model=model, optimizer=opt, frozen="verify")
    with ckpt, pytest.raises(ub.StateMismatchError) as err:
        ckpt.restore()
    text = str(err.value)
    assert "the base model differs" in text and named in text, text
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert not opt.state
