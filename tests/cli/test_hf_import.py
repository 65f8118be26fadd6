"""`unbroken import` of Hugging Face model folders and PEFT adapters: the imported
checkpoint resumes training exactly as the exported model would have continued."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from safetensors.torch import load_file, save_file

import unbroken as ub

from . import hf_models as hf
from .conftest import run_json


def _trained(tmp_path, *, tie=False, peft=False):
    model = hf.llama(tie=tie)
    if peft:
        model = hf.lora(model)
    opt = hf.adamw(model)
    hf.train(model, opt, range(2))
    ub.Checkpointer(tmp_path / "run", model=model, optimizer=opt).save(2)
    return model


def _one_more_step(model):
    opt = hf.adamw(model)  # the folders carry no optimizer state: both sides start fresh
    hf.train(model, opt, range(2, 3))
    return model


def _resumed(dest, model):
    opt = hf.adamw(model)
    report = ub.Checkpointer(dest, model=model, optimizer=opt).restore(reset={"optimizer"})
    assert report.step == 2
    hf.train(model, opt, range(2, 3))
    return model


@pytest.mark.parametrize("tie", [False, True])
def test_a_sharded_hf_folder_imports_and_resumes_bit_for_bit(tmp_path, tie):
    """export --format hf -> import -> restore and one more step equals one more step of
    the original: guards against a shard's tensors lost or a tied head left at its
    factory value."""
    trained = _trained(tmp_path, tie=tie)
    ub.export_checkpoint(tmp_path / "run", tmp_path / "hf", format="hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    result = ub.import_checkpoint(tmp_path / "hf", tmp_path / "imported", hf.llama(tie, 7), step=2)
    assert result.source_kind == "hf" and result.optimizer == "none"
    assert result.from_factory == (1 if tie else 0)
    expected = _one_more_step(copy.deepcopy(trained))
    hf.assert_same_state(expected, _resumed(tmp_path / "imported", hf.llama(tie, 9)))


def test_a_single_file_hf_folder_imports_with_the_cli(tmp_path):
    """A folder holding model.safetensors alone imports through the command."""
    trained = _trained(tmp_path)
    ub.export_checkpoint(tmp_path / "run", tmp_path / "hf", format="hf")
    info = run_json(
        "import", tmp_path / "hf", tmp_path / "imported", "--model",
        "cli.hf_models:llama_and_adamw", "--step", "2",
    )  # fmt: skip
    assert info["source_kind"] == "hf" and info["model_tensors"] == len(trained.state_dict())
    model = hf.llama(seed=9)
    ub.Checkpointer(tmp_path / "imported", model=model).restore()
    hf.assert_same_state(trained, model)


def test_a_peft_adapter_imports_onto_the_factorys_base_and_resumes(tmp_path):
    """A PEFT adapter folder lands on the factory's PeftModel: every adapter tensor
    mapped onto its `.default.` FQN, the base from the factory; saved with --frozen
    verify the base is not stored; one more step after restore equals one more step of
    the original."""
    from unbroken.format import manifest

    trained = _trained(tmp_path, peft=True)
    config = tmp_path / "cfg"
    trained.peft_config["default"].save_pretrained(config)
    ub.export_checkpoint(tmp_path / "run", tmp_path / "adapter", format="peft", config=config)
    info = run_json(
        "import", tmp_path / "adapter", tmp_path / "imported", "--model",
        "cli.hf_models:llama_lora", "--step", "2", "--frozen", "verify",
    )  # fmt: skip
    n_adapter = len(load_file(str(tmp_path / "adapter" / "adapter_model.safetensors")))
    assert info["source_kind"] == "peft" and info["model_tensors"] == n_adapter
    assert info["from_factory"] == len(trained.state_dict()) - n_adapter
    doc = manifest.read(tmp_path / "imported" / "step_00000002")
    assert len(doc["frozen"]) == info["from_factory"]
    assert not any(r["stored"] for r in doc["frozen"].values())
    expected = _one_more_step(copy.deepcopy(trained))
    hf.assert_same_state(expected, _resumed(tmp_path / "imported", hf.llama_lora()))


def test_an_adapter_tensor_with_no_place_is_named(tmp_path):
    """A tensor in adapter_model.safetensors that the factory's PeftModel has no place
    for is an error naming it, and nothing is saved."""
    trained = _trained(tmp_path, peft=True)
    config = tmp_path / "cfg"
    trained.peft_config["default"].save_pretrained(config)
    out = tmp_path / "adapter"
    ub.export_checkpoint(tmp_path / "run", out, format="peft", config=config)
    tensors = load_file(str(out / "adapter_model.safetensors"))
    stray = "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"
    tensors[stray] = torch.zeros(4, 32)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ub.StateMismatchError, match=stray):
        ub.import_checkpoint(out, tmp_path / "imported", hf.llama_lora(), step=2)
    assert not (tmp_path / "imported").exists()
    with pytest.raises(ub.StateMismatchError, match="no tensor of adapter 'other'"):
        ub.import_checkpoint(out, tmp_path / "imported", hf.llama_lora(), step=2, adapter="other")


def test_frozen_is_passed_to_the_checkpointer_when_it_takes_it(tmp_path):
    """import's frozen= reaches the Checkpointer that saves (or is refused clearly by a
    Checkpointer that has no such option)."""
    _trained(tmp_path)
    ub.export_checkpoint(tmp_path / "run", tmp_path / "hf", format="hf")
    args = (tmp_path / "hf", tmp_path / "imported", hf.llama(seed=7))
    if "frozen" not in inspect.signature(ub.Checkpointer).parameters:
        with pytest.raises(ValueError, match="takes no 'frozen' option"):
            ub.import_checkpoint(*args, step=2, frozen="verify")
    else:
        ub.import_checkpoint(*args, step=2, frozen="verify")
        assert ub.Checkpointer(tmp_path / "imported", model=hf.llama(seed=9)).restore().step == 2
