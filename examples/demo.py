"""``make demo``: train a tiny GPT on 2 ranks with FSDP2, stop it, resume it, and prove
the resumed run is bit for bit the one that never stopped.

    python examples/demo.py [--steps 40] [--stop-at 20] [--out demo-output] [--broken]

Three runs of ``examples/gpt/train.py`` under torchrun: straight through; stopped at
``--stop-at`` (``UNBROKEN_STOP_AT``: it saves and exits); run again in the same folder,
so it restores and trains to the end. Then the metrics of every step after the stop and
the final model and optimizer state are compared, bit for bit. ``--broken`` resumes with
the optimizer thrown away (``EXAMPLE_RESET_OPTIMIZER=1``) to show a failing verdict.
Exits 0 when IDENTICAL, 1 when DIFFERENT.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "gpt" / "train.py"
RANKS = 2
WINDOWS = 400  # short epochs (12 steps on 2 ranks), so the runs cross epoch boundaries


def compare(straight: Path, resumed: Path, after: int) -> list[str]:
    """Differences between two run folders: metrics of steps after ``after`` (``==`` on
    floats) and final model+optimizer state (dtype, shape and bits). Empty if identical."""
    found = []
    want, got = _metrics(straight / "metrics.jsonl"), _metrics(resumed / "metrics.jsonl")
    for step in sorted(s for s in set(want) | set(got) if s > after):
        a, b = want.get(step, {}), got.get(step, {})
        changed = [
            f"{k} {a.get(k)!r} vs {b.get(k)!r}" for k in sorted(a | b) if a.get(k) != b.get(k)
        ]
        if changed:
            found.append(f"step {step}: " + ", ".join(changed))
    want_state = torch.load(straight / "final.pt", weights_only=True)
    got_state = torch.load(resumed / "final.pt", weights_only=True)
    found += [f"final state {d}" for d in _tree_differences(want_state, got_state, "")]
    return found


def _metrics(path: Path) -> dict[int, dict]:
    records = (json.loads(line) for line in path.read_text().splitlines())
    return {r["step"]: r for r in records}  # a replayed step counts last


def _tree_differences(a, b, where: str) -> list[str]:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [f"{where}: tensors differ"]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys differ"]
        return [d for k in a for d in _tree_differences(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, list | tuple) and isinstance(b, list | tuple) and len(a) == len(b):
        return [d for i, x in enumerate(a) for d in _tree_differences(x, b[i], f"{where}/{i}")]
    return [] if type(a) is type(b) and a == b else [f"{where}: {a!r} != {b!r}"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(run_dir: Path, args: argparse.Namespace, log_name: str, env: dict | None = None):
    """One torchrun invocation of train.py on ``run_dir``; its output goes to a log file."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(RANKS)]
    cmd += ["--master_port", str(_free_port()), str(TRAIN), "--fsdp"]
    cmd += ["--ckpt-dir", str(run_dir / "ckpt"), "--out", str(run_dir / "metrics.jsonl")]
    cmd += ["--final-state", str(run_dir / "final.pt"), "--data-dir", str(args.out / "data")]
    cmd += ["--steps", str(args.steps), "--save-every", "10", "--windows", str(WINDOWS)]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("UNBROKEN_", "EXAMPLE_"))}
    full_env.update(OMP_NUM_THREADS="1", **(env or {}))
    log = run_dir / log_name
    with open(log, "w") as f:
        proc = subprocess.run(cmd, env=full_env, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        sys.exit(f"training failed (exit {proc.returncode}); see {log}")
    return log.read_text()


def restore_report(output: str) -> str:
    """The restore report a run printed (rank 0): its first line and the indented ones."""
    lines = output.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("restored step")), None)
    if start is None:
        return "(no restore report found: the run did not restore a checkpoint)"
    end = start + 1
    while end < len(lines) and lines[end].startswith("  "):
        end += 1
    return "\n".join(lines[start:end])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--stop-at", type=int, default=20)
    p.add_argument("--out", type=Path, default=Path("demo-output"))
    p.add_argument("--broken", action="store_true", help="resume with the optimizer lost")
    args = p.parse_args()
    if not 0 < args.stop_at < args.steps:
        p.error(f"--stop-at must be between 1 and --steps - 1, got {args.stop_at}")

    shutil.rmtree(args.out, ignore_errors=True)  # a stale checkpoint would be resumed
    straight, resumed = args.out / "straight", args.out / "resumed"
    straight.mkdir(parents=True)
    resumed.mkdir(parents=True)
    print(f"unbroken demo: tiny GPT, {RANKS} ranks with FSDP2, {args.steps} steps")
    print(f"outputs in {args.out}/\n")

    stages = [
        (f"straight run, {args.steps} steps", straight, "train.log", {}),
        (f"same run, stopped at step {args.stop_at}", resumed, "stopped.log",
         {"UNBROKEN_STOP_AT": str(args.stop_at)}),
        ("run again: restores and trains to the end", resumed, "resumed.log",
         {"EXAMPLE_RESET_OPTIMIZER": "1"} if args.broken else {}),
    ]  # fmt: skip
    output = ""
    for n, (what, run_dir, log_name, env) in enumerate(stages, 1):
        print(f"[{n}/{len(stages)}] {what} ...", end=" ", flush=True)
        started = time.perf_counter()
        output = train(run_dir, args, log_name, env)
        print(f"{time.perf_counter() - started:.1f}s")

    print(f"\nrestore report of the resumed run:\n{restore_report(output)}\n")
    differences = compare(straight, resumed, after=args.stop_at)
    print(
        f"compared: loss, grad_norm and lr of steps {args.stop_at + 1}..{args.steps} "
        "(==), and the final model and optimizer state (bit for bit)"
    )
    if differences:
        for d in differences[:10]:
            print(f"  {d}")
        if len(differences) > 10:
            print(f"  ... and {len(differences) - 10} more")
        print("verdict: DIFFERENT")
        return 1
    print("verdict: IDENTICAL")
    return 0


if __name__ == "__main__":
    sys.exit(main())
