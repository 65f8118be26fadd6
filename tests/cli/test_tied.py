"""Tied weights (a GPT's `lm_head.weight` *is* `wte.weight`) in export, inspect and verify."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open
from safetensors.torch import load_file, load_model
from torch import nn

import unbroken as ub

from .conftest import run_cli, run_json


class TinyGPT(nn.Module):
    """Embedding, a norm (and a buffer of ones shaped like it), a head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(11, 6)
        self.ln = nn.LayerNorm(6)
        self.register_buffer("scale", torch.ones(6))  # equals the untrained ln.weight
        self.lm_head = nn.Linear(6, 11, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln(self.wte(idx)) * self.scale)


def _saved(tmp_path, steps: int = 2) -> tuple[TinyGPT, object]:
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randint(0, 11, (4, 5))).logsumexp(-1).mean().backward()
        opt.step()
    ub.Checkpointer(tmp_path / "run", model=model, optimizer=opt).save(steps)
    return model, tmp_path / "run"


def test_export_writes_a_tied_weight_once_and_it_loads_back(tmp_path):
    """A tied weight is written once, under the parameter's own name (the embedding, as
    Hugging Face's save_pretrained keeps it), the alias recorded in the metadata; the file
    loads into a fresh tied model with safetensors' strict load_model, and with
    load_state_dict(strict=False) whose only missing key is the alias."""
    trained, run = _saved(tmp_path)
    out = tmp_path / "w.safetensors"
    info = run_json("export", run, "--to", out)
    assert info["tied"] == {"lm_head.weight": "wte.weight"} and info["tensors"] == 4
    assert set(load_file(str(out))) == {"wte.weight", "ln.weight", "ln.bias", "scale"}
    with safe_open(str(out), framework="pt") as f:
        assert json.loads(f.metadata()["tied_weights"]) == {"lm_head.weight": "wte.weight"}
    assert (
        "tied: lm_head.weight = wte.weight, written once"
        in run_cli("export", run, "--to", tmp_path / "again.safetensors").stdout
    )

    fresh = TinyGPT()
    missing, unexpected = load_model(fresh, out, strict=True)
    assert not missing and not unexpected
    for name, value in trained.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name

    fresh = TinyGPT()
    result = fresh.load_state_dict(load_file(str(out)), strict=False)
    assert result.missing_keys == ["lm_head.weight"] and result.unexpected_keys == []
    assert fresh.lm_head.weight is fresh.wte.weight
    assert torch.equal(fresh.lm_head.weight, trained.lm_head.weight)


def test_export_keeps_tensors_that_are_only_equal(tmp_path):
    """Equal values are not a tie: before training, the buffer `scale` (ones) equals the
    trainable `ln.weight` in shape, dtype and value, and both are still written."""
    _, run = _saved(tmp_path, steps=0)
    out = tmp_path / "w.safetensors"
    info = run_json("export", run, "--to", out)
    assert info["tied"] == {"lm_head.weight": "wte.weight"}
    assert set(load_file(str(out))) == {"wte.weight", "ln.weight", "ln.bias", "scale"}


def test_inspect_and_verify_list_a_tied_weight_as_tied(tmp_path):
    """inspect and verify do not report `lm_head.weight` as a tensor in no optimizer param
    group: it is `wte.weight`, optimized under that name, and is listed as tied."""
    _, run = _saved(tmp_path)
    cov = run_json("inspect", run, "--step", 2)["optimizer"]
    assert cov["tied"] == {"lm_head.weight": "wte.weight"}
    assert cov["unoptimized"] == ["scale"]  # the buffer is still named
    assert not any("lm_head" in w for w in cov["warnings"] + cov["failures"])
    human = run_cli("inspect", run, "--step", 2).stdout
    assert "tied: lm_head.weight is wte.weight" in human
    assert "lm_head.weight" not in human.split("optimizer coverage")[1].split("tied:")[0]
    checked = run_json("verify", run)["checkpoints"][0]
    assert checked["failures"] == []
    assert not any("lm_head" in w for w in checked["warnings"])
