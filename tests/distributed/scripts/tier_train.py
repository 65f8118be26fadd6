"""A small, learnable FSDP2 run with a local tier, one process per torchrun agent
(tests/distributed/test_local_tier.py). Each agent's local folder is ``SHM/node_G`` (G:
its ``GROUP_RANK``), standing for that node's memory.

    python tier_train.py CKPT SHM --out OUT --steps 6
        trains 6 steps without a checkpoint: the uninterrupted reference
    python tier_train.py CKPT SHM --out OUT --steps 5 --saves --die-node 1
        trains; saves step 2 to CKPT, steps 3 and 4 to the local tier (replicated), writes
        OUT/full_4.pt; at step 5's local save node 1's process is killed (SIGKILL) just
        before it commits, after node 0 committed: a local save killed mid-write
    python tier_train.py CKPT SHM --out OUT --steps 6 --resume [--reset-rng]
        restores (OUT/full_restored.pt), then trains to step 6

Rank 0 writes OUT/full_N.pt (the gathered model and optimizer state after step N) and
every rank OUT/rank_R.json (its losses and restore report).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

import unbroken as ub
from unbroken.tiers import node_folder

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the scripts' helpers
from training_scripts import end_process, sharded_regression, sharded_step


def write_full(model, opt, path: Path, rank: int) -> None:
    msd, osd = get_state_dict(
        model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank == 0:
        torch.save({"model": msd, "optimizer": osd}, path)


def die_before_commit(node: int) -> None:
    """This node's process is killed as its leader commits a local step (the others
    committed theirs already, or are about to)."""
    if int(os.environ["GROUP_RANK"]) != node:
        return

    def commit(self, partial, step, data):
        if step == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, partial, step, data)

    real = node_folder.NodeFolder.commit
    node_folder.NodeFolder.commit = commit


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ckpt")
    parser.add_argument("shm", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--saves", action="store_true")
    parser.add_argument("--die-node", type=int)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--reset-rng", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    node = int(os.environ["GROUP_RANK"])
    tier = ub.LocalTier(args.shm / f"node_{node}", replicas=1, keep_last=2)
    model, opt = sharded_regression(world, seed=123 if args.resume else 0)
    ckpt = ub.Checkpointer(args.ckpt, model=model, optimizer=opt, local=tier)
    record: dict = {"rank": rank, "world": world, "node": node, "losses": {}}
    start = 0
    if args.resume:
        report = ckpt.restore(reset={"rng"} if args.reset_rng else None, require=True)
        record["report"] = dataclasses.asdict(report)
        start = report.step
        write_full(model, opt, args.out / "full_restored.pt", rank)
    if args.die_node is not None:
        die_before_commit(args.die_node)
    for step in range(start + 1, args.steps + 1):
        record["losses"][step] = sharded_step(model, opt, step, rank)
        if args.saves and step == 2:
            ckpt.save(step)
        if args.saves and step >= 3:
            ckpt.save(step, tier="local")
            ckpt.wait_replicated()
            if step == 4:
                write_full(model, opt, args.out / "full_4.pt", rank)
                (args.out / f"rank_{rank}.json").write_text(json.dumps(record))
    write_full(model, opt, args.out / f"full_{args.steps}.pt", rank)
    record["local_steps"] = ckpt.steps(tier="local")
    ckpt.close()
    (args.out / f"rank_{rank}.json").write_text(json.dumps(record))
    dist.barrier()


if __name__ == "__main__":
    main()
    end_process()
