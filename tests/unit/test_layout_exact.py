"""Restored state keeps its memory layout (issue 10, item 1; DESIGN.md F5: restored exactly).

Fused optimizer kernels pair a parameter's elements with its state's elements by memory
position: optimizer state of a channels_last conv or a transposed parameter restored
contiguous changes the first step after a resume, while the values alone still verify.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import unbroken as ub


class ConvNet(nn.Module):
    """A channels_last conv and a parameter stored transposed (as tied/transposed weights are)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.proj = nn.Parameter(torch.randn(5, 6).t())  # shape (6, 5), strides (1, 6)
        self.to(memory_format=torch.channels_last)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x)).mean(dim=(2, 3))
        return h @ self.proj


def _build(seed: int, fused: bool):
    torch.manual_seed(seed)
    model = ConvNet()
    opt_kwargs = {"fused": True} if fused else {"foreach": False}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **opt_kwargs)
    return model, opt


def _train(model, opt, steps: int, start: int) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(4, 3, 8, 8, generator=g).to(memory_format=torch.channels_last)
        target = x.mean(dim=(1, 2, 3)).unsqueeze(1).expand(4, 6)[:, :5] * 2
        loss = (model(x) - target).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "for-loop"])
def test_channels_last_and_transposed_state_resume_bit_exact(tmp_path, fused):
    """Memory layout: optimizer state of channels_last/transposed parameters keeps its
    strides, so a fused AdamW continues exactly as an uninterrupted run."""
    straight_model, straight_opt = _build(0, fused)
    straight = _train(straight_model, straight_opt, 12, 0)

    model, opt = _build(0, fused)
    _train(model, opt, 6, 0)
    ub.Checkpointer(tmp_path, model=model, optimizer=opt).save(6)

    model2, opt2 = _build(1, fused)  # different initial weights, empty optimizer
    report = ub.Checkpointer(tmp_path, model=model2, optimizer=opt2).restore()
    assert report.verified
    layouts = [
        (v.stride(), p.stride())
        for p in model2.parameters()
        for v in opt2.state[p].values()
        if v.dim()
    ]
    resumed = _train(model2, opt2, 6, 6)
    assert resumed == straight[6:]
    for a, b in zip(straight_model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b) and a.stride() == b.stride()
    assert all(state == param for state, param in layouts), layouts


def test_manifest_records_strides(tmp_path):
    """Memory layout: the manifest records each dense tensor's strides."""
    from unbroken.format import manifest

    model, opt = _build(0, False)
    _train(model, opt, 1, 0)
    folder = ub.Checkpointer(tmp_path, model=model, optimizer=opt).save(1)
    doc = manifest.read(__import__("pathlib").Path(folder))
    conv = doc["tensors"]["model/conv.weight"]
    assert conv["stride"] == list(model.conv.weight.stride()) != [27, 9, 3, 1]
    moments = [e for k, e in doc["tensors"].items() if k.endswith("conv.weight/exp_avg")]
    assert moments and moments[0]["stride"] == conv["stride"]


def test_live_model_with_another_layout_is_refused_before_install(tmp_path):
    """Memory layout: a resumed model left contiguous while the saved one was channels_last
    would not continue bit for bit; restore says so, names the FQN, changes nothing."""
    model, opt = _build(0, False)
    _train(model, opt, 2, 0)
    ub.Checkpointer(tmp_path, model=model, optimizer=opt).save(2)

    torch.manual_seed(3)
    plain = ConvNet().to(memory_format=torch.contiguous_format)
    before = {k: v.clone() for k, v in plain.state_dict().items()}
    opt2 = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    with pytest.raises(ub.StateMismatchError, match=r"model/conv\.weight.*memory_format"):
        ub.Checkpointer(tmp_path, model=plain, optimizer=opt2).restore()
    for k, v in plain.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not opt2.state


def test_a_damaged_stride_is_corruption(tmp_path):
    """Memory layout: a manifest whose stride cannot lay out the shape is damage, not a crash."""
    import tamper
    from unbroken.format import manifest

    model, opt = _build(0, False)
    folder = __import__("pathlib").Path(
        ub.Checkpointer(tmp_path, model=model, optimizer=opt).save(0)
    )
    tamper.edit(folder, lambda d: d["tensors"]["model/conv.weight"].update(stride=[10**9, 1, 1, 1]))
    with pytest.raises(ub.CorruptCheckpointError, match="stride"):
        manifest.read(folder)
