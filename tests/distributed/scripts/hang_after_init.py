"""A torchrun worker that never ends: for ``unbroken resume-test --timeout`` (issue 29).

    torchrun --nproc-per-node 2 hang_after_init.py DIR

Writes its pid and its torchrun agent's (its parent's) into ``DIR/pids-<local rank>``
first thing, then joins the gloo process group and sleeps forever.
"""

from __future__ import annotations

import os
import sys
import time

folder = sys.argv[1]
os.makedirs(folder, exist_ok=True)
with open(os.path.join(folder, f"pids-{os.environ.get('LOCAL_RANK', '0')}"), "w") as f:
    f.write(f"{os.getpid()} {os.getppid()}\n")

import torch.distributed as dist  # noqa: E402  (the pids are written before the slow import)

dist.init_process_group("gloo")
while True:
    time.sleep(60)
