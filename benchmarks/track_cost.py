"""What ``Checkpointer.track()`` costs per call, in microseconds.

    python benchmarks/track_cost.py [--calls 20000] [--repeats 5]

Each call tracks two metrics of one step (floats, or 0-d CPU tensors whose ``.item()``
is part of the call). Rank 0 appends the step to ``metrics.jsonl`` (a formatted line, a
write and a flush; no fsync). Cases: a fresh run, and a resumed run while its replay
check compares every call against a recorded step. Run it under an older revision's
``PYTHONPATH`` for the cost before per-step appends.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from torch import nn

import unbroken as ub
from common import machine_info
from report import inline, median_span, table


def _per_call(calls: int, tensors: bool, replaying: bool) -> float:
    """Microseconds per track() call over ``calls`` calls."""
    loss, gn = (torch.tensor(0.5), torch.tensor(1.5)) if tensors else (0.5, 1.5)
    with tempfile.TemporaryDirectory() as d:
        model = nn.Linear(2, 2)
        ckpt = ub.Checkpointer(d, model=model)
        if replaying:
            ckpt.save(0)
            for step in range(1, calls + 1):
                ckpt.track(step, loss=loss, grad_norm=gn)
            del ckpt  # a crash after the save: the resumed run replays every step
            ckpt = ub.Checkpointer(d, model=model)
            ckpt.restore()
        started = time.perf_counter()
        for step in range(1, calls + 1):
            ckpt.track(step, loss=loss, grad_norm=gn)
        elapsed = time.perf_counter() - started
        if replaying:
            assert getattr(ckpt, "replay", None) is None or ckpt.replay.identical
        ckpt.close()
    return elapsed / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for tensors in (False, True):
        for replaying in (False, True):
            runs = [_per_call(args.calls, tensors, replaying) for _ in range(args.repeats)]
            kind = "0-d tensors" if tensors else "floats"
            run = "resumed, replay check comparing" if replaying else "fresh run"
            rows.append([kind, run, *median_span(runs, digits=1)])
    print(inline(machine_info(tempfile.gettempdir())))
    print(table(["metrics", "run", "us per call (median)", "min-max"], rows))


if __name__ == "__main__":
    main()
