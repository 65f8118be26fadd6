"""The fingerprint formats' cost per dtype: mix64-v3 (new checkpoints) against wsum64-v2.

    python benchmarks/fingerprint_formats.py [--mb 256] [--repeats 7] [--device cpu|cuda]

Each dtype's tensor is fingerprinted whole and as a ``Shard(1)`` half (rows of a 2-D
tensor: the many-short-runs path), in both formats, alternating so that load from other
processes falls on both alike; prints the median seconds, GB/s and v3 / v2. Never
asserts timings.
"""

from __future__ import annotations

import argparse
import sys

import torch

from common import machine_info, repeat
from report import bullets, median, median_span, table
from unbroken.format import fingerprint as fp
from unbroken.format import mix64

DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.int8]


def measure(t: torch.Tensor, algorithm: str, sharded: bool, runs: int) -> list[float]:
    device = t.device if t.device.type == "cuda" else None
    if sharded:
        half = t[:, : t.shape[1] // 2]
        return repeat(lambda: fp.partial(half, t.shape, [0, 0], algorithm), runs, device)
    return repeat(lambda: fp.fingerprint(t, algorithm), runs, device)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=256, help="size of each tensor")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    print(*bullets(machine_info("/tmp", device if device.type == "cuda" else None)), sep="\n")
    print(f"- host kernel built: {mix64.has_kernel()}\n")
    rows = []
    for dtype in DTYPES:
        size = torch.empty((), dtype=dtype).element_size()
        cols = 4096
        rows_n = max(1, int(args.mb * 2**20 / size / cols))
        t = torch.randn(rows_n, cols, device=device).to(dtype)
        nbytes = t.numel() * size
        for sharded in (False, True):
            times = {a: [] for a in (fp.V2, fp.V3)}
            for _ in range(args.repeats):  # alternate the formats run by run
                for a in times:
                    times[a] += measure(t, a, sharded, 1)
            v2, v3 = median(times[fp.V2]), median(times[fp.V3])
            share = 2 if sharded else 1
            rows.append([
                str(dtype).removeprefix("torch."), "Shard(1) half" if sharded else "whole",
                *median_span(times[fp.V2]), f"{nbytes / share / 1e9 / v2:.2f}",
                *median_span(times[fp.V3]), f"{nbytes / share / 1e9 / v3:.2f}", f"{v3 / v2:.2f}x",
            ])  # fmt: skip
        del t
    headers = ["dtype", "piece", "v2 median s", "v2 min-max s", "v2 GB/s", "v3 median s",
               "v3 min-max s", "v3 GB/s", "v3 / v2"]  # fmt: skip
    print(table(headers, rows))


if __name__ == "__main__":
    sys.exit(main())
