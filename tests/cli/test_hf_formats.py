"""`unbroken export --format hf` and `--format peft`: folders that transformers and peft
load bit for bit, split and named as transformers and peft write them."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

import unbroken as ub
from unbroken.tools.hf_export import parse_shard_size

from . import hf_models as hf
from .conftest import flip_bit, run_cli, run_json, tree_digest


def _saved(root, *, tie: bool = False, peft: bool = False, **lora):
    model = hf.llama(tie=tie)
    if peft:
        model = hf.lora(model, **lora)
    opt = hf.adamw(model)
    hf.train(model, opt, range(2))
    ub.Checkpointer(root / "run", model=model, optimizer=opt).save(2)
    return model, root / "run"


def _file_tensors(folder) -> dict[str, str]:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                assert name not in out
                out[name] = path.name
    return out


@pytest.mark.parametrize("tie", [False, True])
def test_hf_export_loads_in_transformers_bit_for_bit(tmp_path, tie):
    """The sharded folder loads with from_pretrained to exactly the trained values (a tied
    head included), and its index names exactly the tensors the shards hold: guards
    against a shard or index entry lost, a tensor written twice, values cast or altered."""
    from transformers import AutoModelForCausalLM

    trained, run = _saved(tmp_path, tie=tie)
    trained.config.save_pretrained(tmp_path / "cfg")
    out = tmp_path / "hf"
    info = run_json(
        "export", run, "--to", out, "--format", "hf", "--max-shard-size", "20KB",
        "--config", tmp_path / "cfg",
    )  # fmt: skip
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == _file_tensors(out)
    assert index["metadata"]["total_size"] == info["bytes"]
    assert ("lm_head.weight" in index["weight_map"]) is not tie
    assert info["format"] == "hf" and set(info["files"]) == {p.name for p in out.iterdir()}
    # transformers itself splits the same model into as many shards, of the same size
    trained.save_pretrained(tmp_path / "tf", max_shard_size="20KB")
    theirs = json.loads((tmp_path / "tf" / "model.safetensors.index.json").read_text())
    assert theirs["weight_map"].keys() == index["weight_map"].keys()
    assert theirs["metadata"]["total_size"] == index["metadata"]["total_size"]
    assert len(set(theirs["weight_map"].values())) == len(shards)
    loaded = AutoModelForCausalLM.from_pretrained(out)
    hf.assert_same_state(trained, loaded)
    if tie:
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


def test_one_shard_is_model_safetensors_alone(tmp_path):
    """Everything in one shard: `model.safetensors` and no index, as save_pretrained
    writes it (guards against an index that transformers would not expect)."""
    from transformers import AutoModelForCausalLM

    trained, run = _saved(tmp_path)
    trained.config.save_pretrained(tmp_path / "cfg")
    out = tmp_path / "hf"
    ub.export_checkpoint(run, out, format="hf", config=tmp_path / "cfg" / "config.json")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    trained.save_pretrained(tmp_path / "tf")
    assert (tmp_path / "tf" / "model.safetensors").is_file()
    assert not (tmp_path / "tf" / "model.safetensors.index.json").exists()
    hf.assert_same_state(trained, AutoModelForCausalLM.from_pretrained(out))


def test_hf_export_casts_with_dtype(tmp_path):
    """--dtype bf16 writes every floating-point tensor as the bf16 of the saved value."""
    trained, run = _saved(tmp_path)
    out = tmp_path / "hf"
    ub.export_checkpoint(run, out, format="hf", dtype="bf16", max_shard_size=30_000)
    state = trained.state_dict()
    for name in _file_tensors(out):
        with safe_open(str(out / _file_tensors(out)[name]), framework="pt") as f:
            t = f.get_tensor(name)
        assert t.dtype == torch.bfloat16 and torch.equal(t, state[name].to(torch.bfloat16))


def test_an_existing_destination_is_refused_and_kept(tmp_path):
    """A destination that exists and is not an empty folder is never written into or
    replaced; an empty folder is filled."""
    _, run = _saved(tmp_path)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = run_cli("export", run, "--to", out, "--format", "hf")
    assert result.exit_code == 1 and "already exists and is not an empty folder" in result.stderr
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    (out / "keep.txt").unlink()
    assert run_cli("export", run, "--to", out, "--format", "hf").exit_code == 0
    assert (out / "model.safetensors").is_file()


def test_a_failed_export_leaves_nothing(tmp_path):
    """A tensor that fails its checksum mid-export: the partial folder is removed and
    nothing appears at the destination (guards against half a model shipped)."""
    _, run = _saved(tmp_path)
    step = run / "step_00000002"
    doc = json.loads((step / "manifest.json").read_text())
    chunk = doc["tensors"]["model/model.norm.weight"]["chunks"][0]  # the last one written
    flip_bit(step / chunk["file"], chunk["offset"] + 4)
    before = tree_digest(tmp_path)
    with pytest.raises(ub.CheckpointError):
        ub.export_checkpoint(run, tmp_path / "hf", format="hf", max_shard_size="20KB")
    assert tree_digest(tmp_path) == before


@pytest.mark.parametrize(
    ("text", "size"),
    [("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("2KB", 2000), ("1.5MB", 1_500_000),
     ("1TB", 10**12), (4096, 4096), ("4096", 4096), ("20kb", 20_000)],
)  # fmt: skip
def test_shard_sizes_parse_as_huggingface_hub_parses_them(text, size):
    """Same decimal units as transformers' max_shard_size (guards against 1KB = 1024)."""
    from huggingface_hub.serialization._base import parse_size_to_int

    assert parse_shard_size(text) == size
    if isinstance(text, str) and not text.isdigit():
        assert parse_size_to_int(text) == size


@pytest.mark.parametrize("text", ["5XB", "GB", "-1KB", 0, "many"])
def test_a_bad_shard_size_is_a_usage_error(tmp_path, text):
    """A malformed --max-shard-size is named, exit 2, nothing written."""
    with pytest.raises(ValueError, match="max_shard_size"):
        parse_shard_size(text)


def _peft_config_folder(model, folder):
    model.peft_config["default"].save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    "lora",
    [{}, {"bias": "lora_only"}, {"bias": "all"}, {"modules_to_save": ["model.norm"]}],
    ids=["plain", "bias-lora-only", "bias-all", "modules-to-save"],
)
def test_peft_export_loads_in_peft_bit_for_bit(tmp_path, lora):
    """adapter_model.safetensors holds exactly what peft's own save writes (names without
    the adapter's name, same values), and PeftModel.from_pretrained on a fresh base
    gives the trained model back bit for bit."""
    from peft import PeftModel, get_peft_model_state_dict

    trained, run = _saved(tmp_path, peft=True, **lora)
    config = _peft_config_folder(trained, tmp_path / "cfg")
    out = tmp_path / "adapter"
    info = run_json("export", run, "--to", out, "--format", "peft", "--config", config)
    assert sorted(info["files"]) == ["adapter_config.json", "adapter_model.safetensors"]
    theirs = get_peft_model_state_dict(trained)
    with safe_open(str(out / "adapter_model.safetensors"), framework="pt") as f:
        ours = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    loaded = PeftModel.from_pretrained(hf.llama(), out)
    hf.assert_same_state(trained, loaded)


def test_peft_export_takes_the_config_the_manifest_records(tmp_path, monkeypatch):
    """Without --config, the adapter config is the one the save recorded in the manifest
    (its `peft` field); a manifest without one is a clear error and nothing is written."""
    from peft import PeftModel

    from unbroken.format import manifest

    trained, run = _saved(tmp_path, peft=True)
    out = tmp_path / "adapter"
    ub.export_checkpoint(run, out, format="peft")
    hf.assert_same_state(trained, PeftModel.from_pretrained(hf.llama(), out))
    read = manifest.read
    monkeypatch.setattr(
        manifest, "read", lambda *a, **k: {k: v for k, v in read(*a, **k).items() if k != "peft"}
    )
    with pytest.raises(ub.IncompleteCheckpointError, match="no config for adapter 'default'"):
        ub.export_checkpoint(run, tmp_path / "again", format="peft")
    assert not (tmp_path / "again").exists()


def test_peft_export_of_an_unknown_adapter_names_the_ones_there(tmp_path):
    """--adapter naming no adapter of the checkpoint is an error listing those it has."""
    trained, run = _saved(tmp_path, peft=True)
    config = _peft_config_folder(trained, tmp_path / "cfg")
    with pytest.raises(ub.StateMismatchError, match=r"no tensor of adapter 'other'.*default"):
        ub.export_checkpoint(run, tmp_path / "a", format="peft", config=config, adapter="other")


def test_peft_export_of_a_model_with_two_adapters_keeps_them_apart(tmp_path):
    """With two adapters, each export holds exactly its adapter's tensors, as peft's own
    get_peft_model_state_dict(adapter_name=...) gives them (guards against one adapter's
    weights shipped under the other's name)."""
    from peft import LoraConfig, get_peft_model_state_dict

    model = hf.lora(hf.llama())
    model.add_adapter("second", LoraConfig(r=2, target_modules=["k_proj"], lora_dropout=0.0))
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    opt = hf.adamw(model)
    hf.train(model, opt, range(2))
    ub.Checkpointer(tmp_path / "run", model=model, optimizer=opt).save(2)
    for adapter in ("default", "second"):
        out = tmp_path / adapter
        ub.export_checkpoint(tmp_path / "run", out, format="peft", adapter=adapter)
        theirs = get_peft_model_state_dict(model, adapter_name=adapter)
        with safe_open(str(out / "adapter_model.safetensors"), framework="pt") as f:
            ours = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k], theirs[k]) for k in ours)
        recorded = json.loads((out / "adapter_config.json").read_text())
        assert recorded["target_modules"] == sorted(model.peft_config[adapter].target_modules)
