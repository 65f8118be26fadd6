"""Exports of `frozen="verify"` checkpoints, which store no frozen parameter: the frozen
part comes from `--base`, each tensor checked against the fingerprint recorded at save,
or the export is refused (never a model with holes, never one on another base)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

import unbroken as ub

from . import hf_models as hf
from .conftest import run_cli, tree_digest

FROZEN_PREFIXES = ("model.embed_tokens.", "model.layers.0.")


def _frozen_llama():
    model = hf.llama()
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith(FROZEN_PREFIXES))
    return model


def _saved(tmp_path, model):
    """Save the untrained model as the base folder, train 2 steps, save frozen="verify"."""
    model.save_pretrained(tmp_path / "base")
    opt = hf.adamw(model)
    hf.train(model, opt, range(2))
    ckpt = ub.Checkpointer(tmp_path / "run", model=model, optimizer=opt, frozen="verify")
    ckpt.save(2)
    ckpt.close()
    return tmp_path / "run"


def test_without_base_the_export_is_refused(tmp_path):
    """The frozen part is not stored: an export without --base names it and says what
    to pass, and writes nothing."""
    run = _saved(tmp_path, _frozen_llama())
    before = tree_digest(tmp_path)
    result = run_cli("export", run, "--to", tmp_path / "hf", "--format", "hf")
    assert result.exit_code == 1, result.stdout + result.stderr
    assert "IncompleteCheckpointError" in result.stderr and "--base" in result.stderr
    assert "model.embed_tokens.weight" in result.stderr
    with pytest.raises(ub.IncompleteCheckpointError, match="pass --base"):
        ub.export_checkpoint(run, tmp_path / "w.safetensors")
    assert tree_digest(tmp_path) == before


@pytest.mark.parametrize("base_kind", ["hf folder", "safetensors file", "folder of files"])
def test_with_base_the_export_is_the_whole_trained_model(tmp_path, base_kind):
    """With --base (an HF folder, one .safetensors file, or a folder of them) every frozen
    tensor is taken from it, checked, and the export loads bit for bit."""
    from transformers import AutoModelForCausalLM

    trained = _frozen_llama()
    run = _saved(tmp_path, trained)
    base = tmp_path / "base"
    if base_kind != "hf folder":
        state = load_file(str(base / "model.safetensors"))
        if base_kind == "safetensors file":
            base = tmp_path / "base.safetensors"
            save_file(state, str(base))
        else:
            base = tmp_path / "parts"
            base.mkdir()
            names = sorted(state)
            save_file({k: state[k] for k in names[:5]}, str(base / "a.safetensors"))
            save_file({k: state[k] for k in names[5:]}, str(base / "b.safetensors"))
    result = ub.export_checkpoint(
        run, tmp_path / "hf", format="hf", base=base, max_shard_size="20KB",
        config=tmp_path / "base",
    )  # fmt: skip
    assert result.from_base == sorted(
        n for n, p in trained.named_parameters() if not p.requires_grad
    )
    hf.assert_same_state(trained, AutoModelForCausalLM.from_pretrained(tmp_path / "hf"))
    single = ub.export_checkpoint(run, tmp_path / "w.safetensors", base=base)
    assert single.from_base == result.from_base
    written = load_file(str(tmp_path / "w.safetensors"))
    assert all(torch.equal(written[k], v) for k, v in trained.state_dict().items())


def test_a_different_base_is_refused_naming_the_tensor(tmp_path):
    """One element of one frozen tensor differs in the base: StateMismatchError naming it,
    nothing written at the destination."""
    run = _saved(tmp_path, _frozen_llama())
    state = load_file(str(tmp_path / "base" / "model.safetensors"))
    state["model.layers.0.mlp.up_proj.weight"][3, 5] += 1e-3
    save_file(state, str(tmp_path / "other.safetensors"))
    with pytest.raises(ub.StateMismatchError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*"):
        ub.export_checkpoint(run, tmp_path / "hf", format="hf", base=tmp_path / "other.safetensors")
    assert not (tmp_path / "hf").exists()
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]
    del state["model.layers.0.mlp.up_proj.weight"]
    save_file(state, str(tmp_path / "less.safetensors"))
    with pytest.raises(
        ub.IncompleteCheckpointError, match=r"model\.layers\.0\.mlp\.up_proj\.weight"
    ):
        ub.export_checkpoint(run, tmp_path / "hf", format="hf", base=tmp_path / "less.safetensors")


def test_a_base_of_another_dtype_is_refused(tmp_path):
    run = _saved(tmp_path, _frozen_llama())
    state = load_file(str(tmp_path / "base" / "model.safetensors"))
    save_file({k: v.half() for k, v in state.items()}, str(tmp_path / "half.safetensors"))
    with pytest.raises(ub.StateMismatchError, match="base differs"):
        ub.export_checkpoint(run, tmp_path / "w.safetensors", base=tmp_path / "half.safetensors")


def test_a_peft_run_exports_its_adapter_without_base_and_its_model_with_it(tmp_path):
    """A PEFT model saved with frozen="verify" (the base stored nowhere): --format peft
    needs no base and loads bit for bit; --format hf takes the base's tensors under
    PEFT's wrapped names (`base_model.model.` and `.base_layer` removed)."""
    from peft import PeftModel

    base = hf.llama()
    base.save_pretrained(tmp_path / "base")
    trained = hf.lora(base)
    opt = hf.adamw(trained)
    hf.train(trained, opt, range(2))
    ckpt = ub.Checkpointer(tmp_path / "run", model=trained, optimizer=opt, frozen="verify")
    ckpt.save(2)
    ckpt.close()
    ub.export_checkpoint(tmp_path / "run", tmp_path / "adapter", format="peft")
    hf.assert_same_state(trained, PeftModel.from_pretrained(hf.llama(), tmp_path / "adapter"))
    with pytest.raises(ub.IncompleteCheckpointError, match="--base"):
        ub.export_checkpoint(tmp_path / "run", tmp_path / "full.safetensors")
    result = ub.export_checkpoint(
        tmp_path / "run", tmp_path / "full.safetensors", base=tmp_path / "base"
    )
    assert "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight" in result.from_base
    written = load_file(str(tmp_path / "full.safetensors"))
    state = trained.state_dict()
    assert written.keys() == state.keys()
    assert all(torch.equal(written[k], state[k]) for k in state)
