"""Save and restore on one GPU (issue 27, item 5): the suite's part ``device``
(``part_device.py``), under the name its page and CI use.

    python benchmarks/gpu.py                     # ~3.2 GB state, median of 3; writes the page
    python benchmarks/gpu.py --sizes 1000 --runs 5   # another size (MB), more runs
    python benchmarks/gpu.py --quick             # CPU, a tiny state: CI's smoke test
    python benchmarks/gpu.py --write PATH        # put the page at PATH instead
    python benchmarks/gpu.py --render docs/benchmarks-gpu.json --write docs/benchmarks-gpu.md

``save_restore.py --parts device`` with its options, on CUDA where there is one (the CPU
with ``--quick``). A full run on a GPU replaces docs/benchmarks-gpu.md whole.
"""

from __future__ import annotations

import sys

import torch

import save_restore
from report import shown_command


def main() -> None:
    argv = sys.argv[1:]
    if "--device" not in argv:
        cuda = torch.cuda.is_available() and "--quick" not in argv
        argv += ["--device", "cuda" if cuda else "cpu"]
    if not {"--write", "--write-docs", "--render", "--quick"} & set(argv):
        argv.append("--write-docs")  # the page itself, after a full run on a GPU only
    save_restore.main(["--parts", "device", *argv], shown_command("gpu.py", sys.argv[1:]))


if __name__ == "__main__":
    main()
