"""The GPU data path on a real CUDA device (skipped where there is none, as in CI; the
same code runs on the CPU in test_host_ring.py and test_device_fingerprint.py).

Guards: a sync save or restore of CUDA state that loses or reorders bytes on its way
through the pinned ring (DESIGN.md F1/F2), a restore that installs late or casts (F4/F5)
on the device, and a verification that copies the model back to the host (issue 27: the
copy cost more than the whole restore's floor).
"""

from __future__ import annotations

import pytest
import torch

from unbroken.format import fingerprint, host_ring

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


class _CudaProblem:
    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 1)
        ).cuda()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, fused=True)

    def step(self) -> float:
        x = torch.randn(32, 64, device="cuda")
        loss = (self.model(x) - x.sin().sum(1, keepdim=True)).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return loss.item()

    def checkpointer(self, path):
        import unbroken as ub

        return ub.Checkpointer(path, model=self.model, optimizer=self.opt)


def _state(p: _CudaProblem) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v for k, v in p.model.state_dict().items()}
    for i, s in enumerate(p.opt.state.values()):
        out.update({f"opt.{i}.{k}": v for k, v in s.items()})
    return out


def test_cuda_save_and_restore_go_through_pinned_buffers_and_are_exact(tmp_path, monkeypatch):
    """Bit-exact resume of CUDA state through the ring, pieces smaller than the tensors;
    nothing of the model is fingerprinted on the host."""
    monkeypatch.setattr(host_ring, "pinned_bound", lambda: 4096 * host_ring.RINGS * 2)
    monkeypatch.setattr(host_ring, "_POOL", host_ring._Pool())
    host_prints: list[str] = []
    real = fingerprint._bytes

    def on_host(t):
        if t.device.type != "cpu":
            host_prints.append(str(t.device))
        return real(t)

    monkeypatch.setattr(fingerprint, "_bytes", on_host)
    a = _CudaProblem(0)
    for _ in range(3):
        a.step()
    a.checkpointer(tmp_path).save(3)
    b = _CudaProblem(1)
    b.step()
    report = b.checkpointer(tmp_path).restore()
    assert report.verified and report.step == 3
    sa, sb = _state(a), _state(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sb[k].device == sa[k].device and sb[k].dtype == sa[k].dtype, k
        assert torch.equal(sa[k], sb[k]), k
    assert not host_prints, "CUDA tensors were copied to the host to be fingerprinted"


def test_pinned_ring_buffers_are_pinned():
    with host_ring.borrow(torch.device("cuda", torch.cuda.current_device())) as ring:
        assert all(slot.is_pinned() for slot in ring._slots)
