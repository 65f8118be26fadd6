"""One side of the reader/writer race (tests/e2e/test_races.py): run ROLE on DIR.

    python race_roles.py writer DIR SECONDS READERS   save steps 1, 2, ... (keep_last=2),
                                              re-saving every fourth step once more
    python race_roles.py restorer DIR         restore() in a loop while the writer runs
    python race_roles.py verifier DIR         `unbroken verify` / `verify --all` / `inspect`

The state of step N is all ``N``s, so a reader checks what it restored exactly. Each
reader leaves DIR/../ready-* as it enters its loop; the writer saves for SECONDS from the
moment all READERS are there (however slowly they started), then leaves
DIR/../writer_done, and the readers stop after their current run (each does at least
one). Each role prints one JSON line last:
``{"role", "runs", "failed", "failures": [first few messages]}``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
from torch import nn

import unbroken as ub


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(32, 32) for _ in range(4)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    return model, opt


def _fill(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(step)
            opt.state[p]["exp_avg"].fill_(step)


def writer(folder: Path, seconds: float, readers: int) -> tuple[int, list[str]]:
    model, opt = _model()
    ckpt = ub.Checkpointer(folder, model=model, optimizer=opt, keep_last=2)
    failures: list[str] = []
    runs = step = 0
    deadline = None
    give_up = time.monotonic() + 600  # readers that never start: the parent reports it
    try:
        while deadline is None or time.monotonic() < deadline:
            if deadline is None and len(list(folder.parent.glob("ready-*"))) >= readers:
                deadline = time.monotonic() + seconds
            if time.monotonic() > give_up:
                failures.append("the readers never started")
                break
            step += 1
            _fill(model, opt, step)
            ckpt.track(step, loss=float(step))
            for _ in range(2 if step % 4 == 0 else 1):  # a plain re-save of the same step
                runs += 1
                try:
                    ckpt.save(step)
                except ub.CheckpointError as exc:
                    failures.append(f"save({step}): {type(exc).__name__}: {exc}")
            if step == 1:
                print("saved 1", flush=True)
    finally:
        ckpt.close()
        (folder.parent / "writer_done").touch()
    return runs, failures


def restorer(folder: Path) -> tuple[int, list[str]]:
    failures: list[str] = []
    runs = 0
    (folder.parent / f"ready-restorer-{os.getpid()}").touch()
    while not runs or not (folder.parent / "writer_done").exists():
        runs += 1
        model, opt = _model()
        try:
            with ub.Checkpointer(folder, model=model, optimizer=opt, keep_last=None) as ckpt:
                report = ckpt.restore()
            problems = [w for w in report.warnings if "damaged" in w]
            if not report.restored or problems:
                failures.append(f"restored={report.restored} warnings={problems}")
                continue
            for p in model.parameters():
                if not torch.equal(p, torch.full_like(p, report.step)) or not torch.equal(
                    opt.state[p]["exp_avg"], torch.full_like(p, report.step)
                ):
                    failures.append(f"step {report.step} restored other values")
                    break
        except Exception as exc:
            failures.append(_describe(exc))
    return runs, failures


def verifier(folder: Path) -> tuple[int, list[str]]:
    from typer.testing import CliRunner

    from unbroken.cli import app

    commands = (["verify", str(folder)], ["verify", str(folder), "--all"], ["inspect", str(folder)])
    failures: list[str] = []
    runs = 0
    (folder.parent / f"ready-verifier-{os.getpid()}").touch()
    while not runs or not (folder.parent / "writer_done").exists():
        args = commands[runs % len(commands)]
        runs += 1
        try:
            result = CliRunner().invoke(app, args, catch_exceptions=False)
        except Exception as exc:
            failures.append(f"{' '.join(args[:1] + args[2:])}: {_describe(exc)}")
            continue
        if result.exit_code != 0 or "DAMAGED" in result.stdout:
            text = (result.stdout + result.stderr).strip().replace("\n", " | ")[:400]
            failures.append(f"{' '.join(args[:1] + args[2:])}: exit {result.exit_code}: {text}")
    return runs, failures


def _describe(exc: BaseException) -> str:
    where = traceback.extract_tb(exc.__traceback__)[-1]
    return f"{type(exc).__name__}: {exc} (at {Path(where.filename).name}:{where.lineno})"


def main() -> None:
    role, folder = sys.argv[1], Path(sys.argv[2])
    if role == "writer":
        runs, failures = writer(folder, float(sys.argv[3]), int(sys.argv[4]))
    else:
        runs, failures = {"restorer": restorer, "verifier": verifier}[role](folder)
    summary = {"role": role, "runs": runs, "failed": len(failures), "failures": failures[:5]}
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
