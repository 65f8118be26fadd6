"""Shared fixtures: small learnable training problems built the same way every time."""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
# Every process a test starts prints all threads' Python stacks if it aborts or crashes
# (a C++ abort in a torchrun rank otherwise leaves one line and no trace).
os.environ.setdefault("PYTHONFAULTHANDLER", "1")
# DeepSpeed's C++ ops, built once per venv by the Makefile (its `ops` target): every
# process a test starts finds them there instead of compiling them again.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))


# The files that take longest (worker seconds in a full run on torch 2.13.0, 2 cores,
# 2026-11-28), run first: with two xdist workers each taking whole files, longest first makes
# them finish together. xdist's own order (files with the most tests first) left these
# one-test heavyweights for the end, one worker idle while the other ran them. The
# Makefile passes --no-loadscope-reorder so that xdist keeps this order.
HEAVY_FIRST = [
    "tests/integrations/test_megatron.py",  # 236 s
    "tests/e2e/test_harness.py",  # 206 s
    "tests/integrations/test_deepspeed.py",  # 201 s
    "tests/integrations/test_docs_recipes.py",  # 198 s
    "tests/e2e/test_bench_smoke.py",  # 166 s
    "tests/integrations/test_lightning_fsdp.py",  # 154 s
    "tests/cli/test_resume_test.py",  # 149 s
    "tests/integrations/test_accelerate_fsdp.py",  # 145 s
    "tests/distributed/test_local_tier.py",  # 130 s
    "tests/e2e/test_crash.py",  # 114 s
    "tests/integrations/test_lightning.py",  # 109 s
    "tests/integrations/test_megatron_fsdp.py",  # 108 s
    "tests/e2e/test_resume_exact.py",  # 84 s
    "tests/integrations/test_accelerate_exit.py",  # 73 s
    "tests/integrations/test_accelerate_loaders.py",  # 71 s
    "tests/integrations/test_accelerate.py",  # 71 s
    "tests/integrations/test_fine_tuning.py",  # 68 s
    "tests/integrations/test_hf_datasets.py",  # 66 s
    "tests/e2e/test_demo.py",  # 66 s
    "tests/integrations/test_megatron_own.py",  # 64 s
    "tests/distributed/test_nd_resume_test.py",  # 61 s
    "tests/distributed/test_many_nodes.py",  # 51 s
    "tests/integrations/test_deepspeed_universal.py",  # 48 s
    "tests/e2e/test_compared_smoke.py",  # 45 s
    "tests/cli/test_object_store_cli.py",  # 44 s
    "tests/unit/test_object_store_s3.py",  # 42 s
    "tests/integrations/test_transformers.py",  # 36 s
    "tests/distributed/test_clean_exit.py",  # 35 s
    "tests/cli/test_resume_test_timeout.py",  # 29 s
    "tests/integrations/test_trackers.py",  # 28 s
    "tests/integrations/test_deepspeed_import.py",  # 27 s
    "tests/unit/test_resave_crash.py",  # 21 s
]


# Marked `primary_torch`: run on the primary torch (2.13.0) only, which `make test-torch2.14`
# leaves out (-m "not primary_torch"), so that CI's two runs fit its time. The second torch
# runs the library's own suite (unit, cli, distributed, e2e: every torch-facing path, DCP,
# FSDP, DTensor, gloo). Left to the primary torch: the framework integrations (pinned
# framework releases; our code there reads the frameworks' objects, not torch's), the
# resume-test harness's own verdict and report logic (every other resume test still runs
# the harness on both), and the smoke tests of tools that only the primary venv runs
# (`make demo`, `make bench`, the compared.md generator).
PRIMARY_TORCH_ONLY = (
    "tests/integrations/",
    "tests/e2e/test_harness.py",
    "tests/cli/test_resume_test.py",
    "tests/e2e/test_demo.py",
    "tests/e2e/test_bench_smoke.py",
    "tests/e2e/test_compared_smoke.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The heavy files first, heaviest first; every other file after them in the order
    collected, and each file's tests in their own order (a stable sort). Marks the tests
    that run on the primary torch only."""
    rank = {path: i for i, path in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        if path.startswith(PRIMARY_TORCH_ONLY):
            item.add_marker(pytest.mark.primary_torch)


class TinyNet(nn.Module):
    def __init__(self, width: int = 8, dropout: float = 0.1) -> None:
        super().__init__()
        self.inp = nn.Linear(4, width)
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(width, 1)
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += x.shape[0]
        return self.out(self.drop(torch.tanh(self.inp(x))))


class Problem:
    """A learnable regression (y = sum of sin(x)), a model, AdamW and a warm-up schedule."""

    def __init__(self, seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
        torch.manual_seed(seed)
        self.model = TinyNet().to(dtype)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-2, weight_decay=0.01)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / 4))
        self.dtype = dtype

    def step(self) -> float:
        x = torch.randn(16, 4).to(self.dtype)  # draws from the global RNG: resume must restore it
        y = torch.sin(x).sum(dim=1, keepdim=True)
        loss = (self.model(x) - y).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.sched.step()
        return loss.item()

    def checkpointer(self, path, **kwargs):
        import unbroken as ub

        kwargs.setdefault("optimizer", self.opt)
        kwargs.setdefault("scheduler", self.sched)
        return ub.Checkpointer(path, model=self.model, **kwargs)


@pytest.fixture
def problem() -> Problem:
    return Problem()


@pytest.fixture
def ckpt_dir(tmp_path):
    return tmp_path / "ckpts"


@pytest.fixture(scope="module")
def s3_server():
    """moto's S3 server on 127.0.0.1, with a bucket ``ckpts``, for one test module."""
    from s3_server import S3Server

    s = S3Server()
    s.bucket("ckpts")
    try:
        yield s
    finally:
        s.stop()


def save_steps(root, steps=(1, 2), **options) -> dict[int, Problem]:
    """Train a Problem, saving each of ``steps`` into ``root`` (every one kept; more
    Checkpointer ``options`` if given); the training state at each step, as a Problem
    holding it."""
    import copy

    p = Problem()
    ckpt = p.checkpointer(root, keep_last=None, **options)
    states = {}
    for step in steps:
        p.step()
        ckpt.save(step)
        states[step] = Problem(seed=5)
        states[step].model.load_state_dict(p.model.state_dict())
        states[step].opt.load_state_dict(copy.deepcopy(p.opt.state_dict()))
    ckpt.close()
    return states


def restore_skipping(root, skipped, to: int):
    """A fresh Problem restored from ``root`` (latest): step ``to``, its report's first
    warnings naming the damaged checkpoints of the ``skipped`` steps, newest first;
    (the Problem, the report)."""
    fresh = Problem(seed=1)
    report = fresh.checkpointer(root).restore()
    assert report.step == to
    assert [w.split(":")[0] for w in report.warnings[: len(skipped)]] == [
        f"skipped the damaged checkpoint of step {step}" for step in skipped
    ]
    return fresh, report


def assert_same_training_state(a: Problem, b: Problem) -> None:
    """Model and optimizer state equal bit for bit, dtypes included."""
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    oa, ob = a.opt.state_dict(), b.opt.state_dict()
    assert oa["param_groups"] == ob["param_groups"]
    assert oa["state"].keys() == ob["state"].keys()
    for i in oa["state"]:
        for k, v in oa["state"][i].items():
            w = ob["state"][i][k]
            assert v.dtype == w.dtype and torch.equal(v, w), (i, k)


def assert_identical(a, b, where: str = "value") -> None:
    """``a`` and ``b`` are the same value with the same type at every level: mapping key
    order, ``defaultdict`` factories, tuple vs list, int vs float vs bool, float bits
    (-0.0, NaN) and tensor/array dtypes included."""
    assert type(a) is type(b), f"{where}: {type(a).__qualname__} vs {type(b).__qualname__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, np.ndarray | np.generic):
        assert a.dtype == b.dtype and np.shape(a) == np.shape(b), where
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), f"{where}: {a!r} vs {b!r}"
    elif isinstance(a, float):
        same_nan = math.isnan(a) and math.isnan(b)
        assert same_nan or a.hex() == b.hex(), f"{where}: {a!r} vs {b!r}"
    elif isinstance(a, dict):
        assert getattr(a, "default_factory", None) is getattr(b, "default_factory", None), where
        assert len(a) == len(b), f"{where}: keys {list(a)} vs {list(b)}"
        for i, ((ka, va), (kb, vb)) in enumerate(zip(a.items(), b.items(), strict=True)):
            assert_identical(ka, kb, f"{where}: key #{i}")
            assert_identical(va, vb, f"{where}[{ka!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), f"{where}: {a!r} vs {b!r}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"
