"""``make demo``: prove a resume on a real training run, and catch a broken one.

    python examples/demo.py [--steps 40] [--stop-at 20] [--out demo-output]

1. ``unbroken resume-test`` on ``examples/gpt/train.py`` (a tiny GPT, 2 ranks with FSDP2
   under torchrun): straight, stopped midway and resumed. Verdict: IDENTICAL, exit 0.
2. The same on ``examples/gpt/train_buggy.py``, which throws the optimizer state away
   after restoring (a bug real stacks shipped). Verdict: DIFFERENT, exit 1, and the
   post-resume health check names the signature.

Reports and plots go to ``--out``. The demo exits 0 when both verdicts are as expected.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resume_test(script: str, out: Path, steps: int, stop_at: int) -> int:
    """Run ``unbroken resume-test`` on one training script; returns its exit code."""
    train = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_port", str(free_port()), str(HERE / "gpt" / script), "--fsdp",
        "--ckpt-dir", "{dir}", "--steps", str(steps), "--save-every", "10",
        "--out", "{dir}/log.jsonl", "--windows", "400",
    ]  # fmt: skip
    command = [sys.executable, "-m", "unbroken.cli", "resume-test", "--stop-at", str(stop_at),
               "--workdir", str(out), "--", *train]  # fmt: skip
    print(f"\n$ unbroken resume-test --stop-at {stop_at} -- torchrun --nproc_per_node 2 "
          f"examples/gpt/{script} --fsdp ...", flush=True)  # fmt: skip
    started = time.perf_counter()
    code = subprocess.run(
        command, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False
    ).returncode
    print(f"(exit {code}, {time.perf_counter() - started:.0f} s)", flush=True)
    return code


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--stop-at", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("demo-output"))
    args = parser.parse_args()
    if args.out.exists():
        shutil.rmtree(args.out)
    correct = resume_test("train.py", args.out / "correct", args.steps, args.stop_at)
    buggy = resume_test("train_buggy.py", args.out / "buggy", args.steps, args.stop_at)
    ok = correct == 0 and buggy == 1
    print("\n== verdict")
    print(f"  correct resume:  {'IDENTICAL' if correct == 0 else 'NOT IDENTICAL'} "
          f"(plot: {args.out / 'correct' / 'resume-test.png'})")  # fmt: skip
    print(f"  optimizer reset: {'caught' if buggy == 1 else 'NOT CAUGHT'} "
          f"(plot: {args.out / 'buggy' / 'resume-test.png'})")  # fmt: skip
    print(f"  everything is in {args.out.resolve()}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
