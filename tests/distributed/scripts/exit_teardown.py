"""A job that ends on a collective not ours and leaves its process group to the exit
(issue 36 item 19), reporting what its last exit hook finds.

    torchrun --nproc-per-node 2 exit_teardown.py DIR

An exit hook registered before the Checkpointer is made runs after the Checkpointer's
(``atexit`` runs hooks last-in, first-out), just before the interpreter finalizes. It
prints ``at exit: group <initialized> workers <states>``: whether the default group is
still there, and the state letter of each gloo worker thread (``S``: asleep).
"""

from __future__ import annotations

import atexit
import os
import sys

import torch
import torch.distributed as dist

import unbroken as ub

WORKER = "pt_gloo_runloop"


def _report() -> None:
    states = []
    for task in sorted(os.listdir("/proc/self/task")):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                if f.read().strip() != WORKER:
                    continue
            with open(f"/proc/self/task/{task}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        except OSError:
            continue
    line = f"at exit: group {dist.is_initialized()} workers {''.join(states)}\n"
    sys.stdout.write(line)  # one write: the ranks share the launcher's stdout
    sys.stdout.flush()


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    atexit.register(_report)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
    ckpt = ub.Checkpointer(sys.argv[1], model=model)
    ckpt.save(1)
    ckpt.close()
    gathered = [torch.zeros(64) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, torch.ones(64))  # a framework's collective, its tensors dropped


if __name__ == "__main__":
    main()
