"""Save and restore on one GPU (issue 27, item 5): the suite's part ``device``
(``part_device.py``), under the name its page and CI use.

    python benchmarks/gpu.py                   # ~3.2 GB state, median of 3; writes the page
    python benchmarks/gpu.py --gb 1 --runs 5   # another size, more runs
    python benchmarks/gpu.py --quick           # CPU, a tiny state: CI's smoke test
    python benchmarks/gpu.py --write PATH      # put the page at PATH instead
    python benchmarks/gpu.py --render docs/benchmarks-gpu.json --write docs/benchmarks-gpu.md

The same as ``save_restore.py --parts device --device cuda`` (``--device cpu`` with
``--quick``). A full run on a GPU replaces docs/benchmarks-gpu.md whole.
"""

from __future__ import annotations

import argparse
import sys

import torch

import save_restore
from report import shown_command


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gb", type=float, default=None, help="state size in GB (default 3.2)")
    parser.add_argument("--runs", type=int, default=None, help="runs per row (default 3)")
    parser.add_argument("--quick", action="store_true", help="smoke test: 4 MB on the CPU, 2 runs")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="default: cuda if available (cpu with --quick)")  # fmt: skip
    parser.add_argument("--tmpdir", default=None, help="where the checkpoints and floors go")
    parser.add_argument("--write", metavar="PATH", default=None,
                        help="write the page to PATH (default: docs/benchmarks-gpu.md after a "
                        "full run on a GPU; nothing otherwise)")  # fmt: skip
    parser.add_argument("--results", metavar="PATH", help="also write the raw figures as JSON")
    parser.add_argument("--render", metavar="PATH", help="measure nothing: render --results")
    args = parser.parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    suite = ["--parts", "device", "--device", device]
    for flag, value in (("--sizes", args.gb and args.gb * 1000), ("--repeats", args.runs),
                        ("--tmpdir", args.tmpdir), ("--results", args.results),
                        ("--render", args.render), ("--write-docs", args.write)):  # fmt: skip
        suite += [flag, str(value)] if value else []
    if args.quick:
        suite.append("--quick")
    if args.write is None and device == "cuda" and not args.quick and not args.render:
        suite.append("--write-docs")
    save_restore.main(suite, shown_command("gpu.py", sys.argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
