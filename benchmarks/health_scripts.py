"""Three small, learnable training scripts for the health-check measurement.

Each trains in-process and can be snapshotted at any step and continued from the
snapshot, exactly (an exact resume: the continued series is the straight run's, bit for
bit) or with one of the classic resume bugs applied:

- ``reset optimizer``: a fresh AdamW with the same hyperparameters; the LR schedule
  continues from the right step (its position is kept), the moments are lost;
- ``lost RNG``: the global generators (torch, NumPy, Python) start again from the
  script's seed, as when a script seeds at start and the resume does not restore them;
- ``lost data position``: the data stream starts again from its beginning (epoch 0,
  first batch), as when the loader's state is not saved.

The scripts (``gpt``, ``mlp``, ``char-gru``) differ in model, data, schedule and noise
(docs/health-check.md tabulates them).
"""

from __future__ import annotations

import argparse as _argparse_module
import copy
import math
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "gpt"
BUGS = ("reset optimizer", "lost RNG", "lost data position")


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> tuple[Any, ...]:
    return torch.get_rng_state(), np.random.get_state(), random.getstate()


def set_rng_state(state: tuple[Any, ...]) -> None:
    torch.set_rng_state(state[0])
    np.random.set_state(state[1])
    random.setstate(state[2])


class Stream:
    """Minibatches of indices, reshuffled every epoch by a private generator; its
    position (epoch, next batch) is what a stateful data loader saves."""

    def __init__(self, size: int, batch: int, seed: int) -> None:
        self.size, self.batch, self.seed = size, batch, seed
        self.epoch, self.pos = 0, 0
        self._perm: tuple[int, torch.Tensor] | None = None

    def next(self) -> torch.Tensor:
        if self._perm is None or self._perm[0] != self.epoch:
            gen = torch.Generator().manual_seed(self.seed * 10_007 + self.epoch)
            self._perm = (self.epoch, torch.randperm(self.size, generator=gen))
        idx = self._perm[1][self.pos * self.batch : (self.pos + 1) * self.batch]
        self.pos += 1
        if (self.pos + 1) * self.batch > self.size:
            self.epoch, self.pos = self.epoch + 1, 0
        return idx

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])


class Script:
    """One training script: model, AdamW, an LR schedule by step, a data stream."""

    name = ""
    steps = 0  # length of the straight run
    batch = 32
    lr = 1e-3
    betas = (0.9, 0.999)
    weight_decay = 0.01
    clip: float | None = None

    def __init__(self, seed: int) -> None:
        self.seed = seed
        seed_all(seed)
        self.model = self.build_model()
        self.opt = self.build_optimizer()
        self.stream = Stream(self.dataset_size(), self.batch, seed)
        self.step_no = 0
        # What the generators hold when a freshly started script reaches its training
        # loop: a resume that does not restore them continues from here.
        self._rng_at_start = rng_state()

    # What each script defines ----------------------------------------------------------
    def build_model(self) -> nn.Module:
        raise NotImplementedError

    def dataset_size(self) -> int:
        raise NotImplementedError

    def loss(self, idx: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def lr_factor(self, step: int) -> float:
        return 1.0

    def param_groups(self) -> list[dict[str, Any]]:
        return [{"params": list(self.model.parameters())}]

    # The shared training loop ----------------------------------------------------------
    def build_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            self.param_groups(), lr=self.lr, betas=self.betas, weight_decay=self.weight_decay
        )

    def train_step(self) -> tuple[float, float]:
        """One optimizer step: (loss, gradient norm before clipping)."""
        for group in self.opt.param_groups:
            group["lr"] = self.lr * self.lr_factor(self.step_no)
        loss = self.loss(self.stream.next())
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.clip or math.inf)
        self.opt.step()
        self.step_no += 1
        return loss.item(), norm.item()

    def snapshot(self) -> dict[str, Any]:
        """Everything a checkpoint holds, copied."""
        return {
            "step": self.step_no,
            "model": copy.deepcopy(self.model.state_dict()),
            "optimizer": copy.deepcopy(self.opt.state_dict()),
            "data": (self.stream.epoch, self.stream.pos),
            "rng": rng_state(),
        }

    def resume(self, snap: dict[str, Any], bug: str | None = None) -> None:
        """Continue from ``snap``: exactly, or with one of :data:`BUGS`."""
        if bug is not None and bug not in BUGS:
            raise ValueError(f"unknown bug {bug!r}; known: {BUGS}")
        self.step_no = snap["step"]
        self.model.load_state_dict(snap["model"])
        self.opt = self.build_optimizer()
        if bug != "reset optimizer":
            self.opt.load_state_dict(copy.deepcopy(snap["optimizer"]))
        self.stream = Stream(self.dataset_size(), self.batch, self.seed)
        if bug != "lost data position":
            self.stream.epoch, self.stream.pos = snap["data"]
        set_rng_state(self._rng_at_start if bug == "lost RNG" else snap["rng"])


class Progress:
    """The step counter that positions a script's LR schedule, as a Stateful."""

    def __init__(self, script: Script) -> None:
        self.script = script

    def state_dict(self) -> dict[str, int]:
        return {"step": self.script.step_no}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.script.step_no = int(state["step"])


class GPTScript(Script):
    name = "gpt"
    steps = 300
    batch = 16
    lr = 1e-2
    betas = (0.9, 0.95)
    clip = 1.0
    warmup = 10

    def build_model(self) -> nn.Module:
        sys.path.insert(0, str(EXAMPLE))
        import data
        from model import GPT, GPTConfig, loss_fn

        self._loss_fn = loss_fn
        self._data = data.TokenWindows(data.prepare(EXAMPLE / "data"))
        return GPT(GPTConfig(vocab_size=data.VOCAB_SIZE, block_size=data.BLOCK_SIZE))

    def dataset_size(self) -> int:
        return len(self._data)

    def loss(self, idx: torch.Tensor) -> torch.Tensor:
        x, y = (torch.stack(t) for t in zip(*(self._data[int(i)] for i in idx), strict=True))
        return self._loss_fn(self.model(x), y)

    def lr_factor(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = (step - self.warmup) / (self.steps - self.warmup)
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    def param_groups(self) -> list[dict[str, Any]]:
        params = list(self.model.parameters())
        return [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]


class MLPScript(Script):
    name = "mlp"
    steps = 400
    batch = 32
    lr = 2e-3
    size, dim, classes = 8192, 32, 10

    def build_model(self) -> nn.Module:
        # The data set is fixed (its own seed), whatever the training seed.
        gen = torch.Generator().manual_seed(1234)
        x = torch.randn(self.size, self.dim, generator=gen)
        w1 = torch.randn(self.dim, 64, generator=gen) / math.sqrt(self.dim)
        w2 = torch.randn(64, self.classes, generator=gen) / 8.0
        y = (torch.tanh(x @ w1) @ w2).argmax(dim=1)
        flip = torch.rand(self.size, generator=gen) < 0.1
        y[flip] = torch.randint(0, self.classes, (int(flip.sum()),), generator=gen)
        self._x, self._y = x, y
        return nn.Sequential(
            nn.Linear(self.dim, 128), nn.GELU(), nn.Dropout(0.1),
            nn.Linear(128, 128), nn.GELU(), nn.Dropout(0.1),
            nn.Linear(128, self.classes),
        )  # fmt: skip

    def dataset_size(self) -> int:
        return self.size

    def loss(self, idx: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.model(self._x[idx]), self._y[idx])


class CharGRUScript(Script):
    name = "char-gru"
    steps = 400
    batch = 32
    lr = 5e-3
    betas = (0.9, 0.99)
    clip = 1.0
    seq = 48

    def build_model(self) -> nn.Module:
        text = Path(_argparse_module.__file__).read_text(encoding="utf-8")
        codes = torch.tensor([min(max(ord(c) - 31, 0), 96) for c in text], dtype=torch.int64)
        self._codes = codes  # 0: newline/tab/other, 1..95: printable ASCII, 96: non-ASCII
        return _CharGRU(vocab=97)

    def dataset_size(self) -> int:
        return (len(self._codes) - 1) // self.seq

    def loss(self, idx: torch.Tensor) -> torch.Tensor:
        starts = idx * self.seq
        windows = torch.stack([self._codes[s : s + self.seq + 1] for s in starts.tolist()])
        logits = self.model(windows[:, :-1])
        return nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())

    def lr_factor(self, step: int) -> float:
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, step / self.steps)))


class _CharGRU(nn.Module):
    def __init__(self, vocab: int, dim: int = 32, hidden: int = 96) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.drop = nn.Dropout(0.1)
        self.gru = nn.GRU(dim, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(self.drop(self.emb(x)))
        return self.head(self.drop(out))


SCRIPTS: dict[str, type[Script]] = {s.name: s for s in (GPTScript, MLPScript, CharGRUScript)}
