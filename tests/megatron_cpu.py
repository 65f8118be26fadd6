"""TEST-ONLY: lets Megatron-Core 0.16 train on a CPU-only torch, for the tests of
``unbroken.integrations.megatron`` on machines without GPUs.

Megatron-Core places tensors on ``"cuda"`` by name in many places. This maps those
requests to the CPU, answers ``Tensor.type()`` with the ``torch.cuda.*`` names Megatron's
optimizer checks, and uses Megatron's no-op RNG tracker (the scripts train with dropout
0, so nothing draws from it). Nothing of it belongs in a real training run: import it
first thing in a test script, never from the library.
"""

from __future__ import annotations

import sys

import torch
from torch.overrides import TorchFunctionMode

_CUDA_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


class _CudaIsCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def _type(self: torch.Tensor, dtype=None, non_blocking=False, **kwargs):
    if dtype is None:
        return _CUDA_NAMES.get(self.dtype, _original_type(self))
    return _original_type(self, dtype, non_blocking, **kwargs)


_original_type = torch.Tensor.type


def install() -> None:
    """Map CUDA requests to the CPU for the rest of this process (idempotent)."""
    if getattr(torch, "_megatron_cpu_shim", False):
        return
    torch._megatron_cpu_shim = True
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.Tensor.type = _type
    _CudaIsCpu().__enter__()
    _import_megatron_lightly()
    from megatron.core.tensor_parallel import random

    random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def _import_megatron_lightly() -> None:
    """Import megatron.core without what these tiny CPU runs never use, which costs 2-3 s
    of CPU in every process (tens of processes a suite): wandb, which Megatron imports
    only to log to it, and torch.compile's compiler, which Megatron's fused kernels load
    at import by decorating themselves with it (megatron/core/jit.py). Here they stay
    plain functions, as with Megatron's own ``disable_jit_fuser()`` (the scripts call
    none of them; a resume compares two runs that run the same code either way)."""
    sys.modules.setdefault("wandb", None)  # `import wandb` raises ImportError: not installed
    compile_ = torch.compile
    torch.compile = lambda model=None, **kwargs: model if model is not None else (lambda f: f)
    try:
        import megatron.core  # noqa: F401
    finally:
        torch.compile = compile_


install()
