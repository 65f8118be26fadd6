"""What the compared training scripts share: the options, the data, the model, the
stop step, and what every run leaves for the harness (``benchmarks/compared.py``).

A run writes into its run folder ``DIR``:

- ``DIR/ckpt/``: the checkpoints, the framework's own or ours;
- ``DIR/steps.jsonl``: per optimizer step ``{"step": s, "batch": d, "loss": x}``: a
  digest of the inputs it trained on and the loss the script logs (the HF Trainer logs
  its loss on lines of their own, at its logging steps); appended: a stopped run's
  steps, then its resumed run's;
- ``DIR/final.safetensors``: written only by a run that trained every step: the model's
  state (``model.<fqn>``) and the optimizer's state tensors (``optimizer.<param
  fqn>.<key>``).

``UNBROKEN_STOP_AT=K`` stops a run at step K, both ways: ours through
``Checkpointer.should_stop``, the frameworks' own recipes through :func:`stop_step`; either
way the run saves at step K and ends there, as if it had been killed right after that save.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

STEPS = "steps.jsonl"
FINAL = "final.safetensors"
STOP_AT_ENV = "UNBROKEN_STOP_AT"
BATCH_SIZE = 16
ACCUMULATE = 2  # micro-batches per optimizer step


def options(doc: str) -> argparse.ArgumentParser:
    """The options every compared script takes (one training set-up, two resumes)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("dir", type=Path, help="the run folder (checkpoints in DIR/ckpt)")
    parser.add_argument("--resume", choices=("own", "unbroken"), required=True,
                        help="the framework's documented resume, or unbroken's integration")  # fmt: skip
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps in all")
    parser.add_argument("--every", type=int, default=10, help="save every this many steps")
    parser.add_argument("--rows", type=int, default=512, help="rows of the dataset")
    parser.add_argument("--accumulate", type=int, default=ACCUMULATE, help="micro-batches per step")
    return parser


def rows(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` rows of y = sum(sin(x)) + x0*x1/2 over 8 inputs: learnable (the loss falls)."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, 8, generator=g)
    y = torch.sin(x).sum(dim=1, keepdim=True) + 0.5 * x[:, :1] * x[:, 1:2]
    return x, y


def mlp() -> nn.Sequential:
    """The network every script trains: dropout makes a lost RNG state show."""
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 1))


def warmup(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """A per-step linear warm-up over 5 steps: a lost scheduler state shows."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))


def stop_step() -> int | None:
    """``UNBROKEN_STOP_AT`` as the framework-own recipes honour it (None: not set)."""
    value = os.environ.get(STOP_AT_ENV, "").strip()
    return int(value) if value else None


def digest(batch: torch.Tensor) -> bytes:
    """The bytes of one micro-batch's inputs, to tell whether two runs trained on the
    same data (not the RNG: dropout happens later)."""
    return batch.detach().cpu().contiguous().numpy().tobytes()


class StepLog:
    """Appends to ``DIR/steps.jsonl``: per optimizer step a digest of the micro-batches
    given to :meth:`saw` during it, and each logged loss."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / STEPS
        self._batches = hashlib.sha256()

    def saw(self, batch: torch.Tensor) -> None:
        self._batches.update(digest(batch))

    def step(self, step: int, loss: float | None = None) -> None:
        """Step ``step`` is done: its inputs' digest, and its loss if it logs one."""
        line = {"step": int(step), "batch": self._batches.hexdigest()[:16]}
        self._write(line if loss is None else {**line, "loss": float(loss)})
        self._batches = hashlib.sha256()

    def loss(self, step: int, loss: float) -> None:
        """A loss logged at ``step`` apart from the step's end (the HF Trainer's)."""
        self._write({"step": int(step), "loss": float(loss)})

    def _write(self, line: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")


def write_final(run_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The end state of a run that trained every step: model and optimizer tensors."""
    names = {id(p): name for name, p in model.named_parameters()}
    tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
    for param, state in inner.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer.{names[id(param)]}.{key}"] = value
    plain = {k: v.detach().cpu().clone().contiguous() for k, v in tensors.items()}
    save_file(plain, str(Path(run_dir) / FINAL))
