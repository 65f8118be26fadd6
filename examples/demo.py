"""``make demo``: prove a resume on a real training run, and catch a broken one.

    python examples/demo.py [--steps 40] [--stop-at 20] [--out demo-output] [--parallel]

1. ``unbroken resume-test`` on ``examples/gpt/train.py`` (a tiny GPT, 2 ranks with FSDP2
   under torchrun): straight, stopped midway and resumed. Verdict: IDENTICAL, exit 0.
2. The same on ``examples/gpt/train_buggy.py``, which throws the optimizer state away
   after restoring (a bug real stacks shipped). Verdict: DIFFERENT, exit 1, and the
   post-resume health check names the signature.

Reports and plots go to ``--out``. The demo exits 0 when both verdicts are as expected.
``--parallel`` runs the two at once (each one's output printed when it ends).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resume_test(script: str, out: Path, steps: int, stop_at: int, quiet: bool = False) -> int:
    """Run ``unbroken resume-test`` on one training script; returns its exit code.
    ``quiet``: its output is printed in one piece when it ends (runs side by side)."""
    train = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_port", str(free_port()), str(HERE / "gpt" / script), "--fsdp",
        "--ckpt-dir", "{dir}", "--steps", str(steps), "--save-every", "10",
        "--out", "{dir}/log.jsonl", "--windows", "400",
    ]  # fmt: skip
    command = [sys.executable, "-m", "unbroken.cli", "resume-test", "--stop-at", str(stop_at),
               "--workdir", str(out), "--", *train]  # fmt: skip
    header = (f"\n$ unbroken resume-test --stop-at {stop_at} -- torchrun --nproc_per_node 2 "
              f"examples/gpt/{script} --fsdp ...")  # fmt: skip
    if not quiet:
        print(header, flush=True)
    started = time.perf_counter()
    done = subprocess.run(
        command, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False,
        capture_output=quiet, text=True,
    )  # fmt: skip
    if quiet:
        print(header + "\n" + done.stdout + done.stderr, end="", flush=True)
    print(f"(exit {done.returncode}, {time.perf_counter() - started:.0f} s)", flush=True)
    return done.returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--stop-at", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("demo-output"))
    parser.add_argument("--parallel", action="store_true", help="run both at once")
    args = parser.parse_args()
    if args.out.exists():
        shutil.rmtree(args.out)
    runs = [("train.py", args.out / "correct"), ("train_buggy.py", args.out / "buggy")]
    if args.parallel:
        with ThreadPoolExecutor(2) as pool:
            codes = list(pool.map(
                lambda r: resume_test(*r, args.steps, args.stop_at, quiet=True), runs
            ))  # fmt: skip
    else:
        codes = [resume_test(*r, args.steps, args.stop_at) for r in runs]
    correct, buggy = codes
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
