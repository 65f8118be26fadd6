"""Run ``examples/gpt/train.py`` in fresh processes and compare what runs leave behind."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from processes import torchrun

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "gpt" / "train.py"
TIMEOUT_S = 240


@dataclasses.dataclass(frozen=True)
class Setup:
    """One way to run the example, and the step at which its interrupted run stops."""

    name: str
    ranks: int
    fsdp: bool
    steps: int
    stop_at: int
    save_every: int = 10
    # 400 windows of 16 per batch: an epoch is 25 steps on one rank (the single run stops
    # exactly at an epoch's end) and 12 on two (the FSDP run stops mid-epoch); both
    # resumed runs go on into a later, reshuffled epoch.
    windows: int = 400


SETUPS = [
    Setup("single", ranks=1, fsdp=False, steps=40, stop_at=25),
    Setup("fsdp2", ranks=2, fsdp=True, steps=30, stop_at=15),
]


@dataclasses.dataclass
class Run:
    """Where one invocation of the example wrote its checkpoints, metrics and state."""

    ckpt_dir: Path
    out: Path
    final_state: Path | None = None
    stderr: str = ""

    def metrics(self) -> dict[int, dict[str, Any]]:
        return read_metrics(self.out)


def train(
    setup: Setup,
    run: Run,
    *,
    data_dir: Path,
    env: dict[str, str] | None = None,
) -> Run:
    """Run the example once (under torchrun for several ranks); raise if it fails."""
    args = [str(TRAIN), "--ckpt-dir", str(run.ckpt_dir), "--out", str(run.out)]
    args += ["--steps", str(setup.steps), "--save-every", str(setup.save_every)]
    args += ["--windows", str(setup.windows), "--data-dir", str(data_dir)]
    if setup.fsdp:
        args.append("--fsdp")
    if run.final_state is not None:
        args += ["--final-state", str(run.final_state)]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("UNBROKEN_", "EXAMPLE_"))}
    full_env.update(OMP_NUM_THREADS="1", **(env or {}))
    command = torchrun(setup.ranks, *args) if setup.ranks > 1 else [sys.executable, *args]
    proc = subprocess.run(
        command,
        env=full_env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(command)} exited with {proc.returncode}\n"
            f"--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
        )
    run.stderr = proc.stderr
    return run


def copy_run(src: Run, dest: Path) -> Run:
    """A copy of a run's checkpoints and metrics, to resume from without touching them."""
    dest.mkdir(parents=True, exist_ok=True)
    copy = Run(ckpt_dir=dest / "ckpt", out=dest / "metrics.jsonl", final_state=dest / "final.pt")
    shutil.copytree(src.ckpt_dir, copy.ckpt_dir)
    shutil.copyfile(src.out, copy.out)
    return copy


def read_metrics(path: Path) -> dict[int, dict[str, Any]]:
    """Step -> record from a JSON-lines file; a step logged again (a replay) counts last."""
    records = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        records[record["step"]] = record
    return records


def load_state(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=True)


def tree_differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Every place where two nested states differ: tensors by dtype, shape and bits."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [f"{where}: {type(a).__name__} vs {type(b).__name__}"]
        if a.dtype != b.dtype or a.shape != b.shape:
            return [f"{where}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"]
        if not torch.equal(a, b):
            diff = (a.double() - b.double()).abs().max().item()
            return [f"{where}: values differ (max abs difference {diff:.3g})"]
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys differ: {sorted(map(str, a.keys() ^ b.keys()))}"]
        return [d for k in a for d in tree_differences(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if type(a) is not type(b) or len(a) != len(b):
            return [f"{where}: {type(a).__name__}[{len(a)}] vs {type(b).__name__}[{len(b)}]"]
        found = []
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            found += tree_differences(x, y, f"{where}/{i}")
        return found
    return [] if a == b and type(a) is type(b) else [f"{where}: {a!r} vs {b!r}"]
