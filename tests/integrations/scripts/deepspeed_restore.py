"""Restore an unbroken checkpoint onto a one-process DeepSpeed engine and save it again.

    python deepspeed_restore.py SRC RESAVED --stage 3 --dump DUMP --out OUT.json

The engine is ``deepspeed_train.py``'s (bf16, a torch AdamW), at ``--stage``, world size
1. After ``checkpointer_for(engine, SRC).restore()`` the compute weights and fp32 masters
are read through DeepSpeed's own API and compared with ``DUMP`` (DeepSpeed's gathered
view when the source run saved); OUT gets the mismatches and the engine's counters, and
RESAVED gets ``checkpointer_for(engine, RESAVED).save(step)``, for a diff.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch
from deepspeed_train import Net

import training_scripts


def main(args: argparse.Namespace) -> None:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    from unbroken.integrations.deepspeed import checkpointer_for

    deepspeed.init_distributed(dist_backend="gloo")
    model = Net()
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": args.stage},
        "bf16": {"enabled": True},
        "steps_per_print": 10**9,
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    step = checkpointer_for(engine, args.src).restore().step
    dump = torch.load(args.dump, weights_only=True)
    params = list(engine.module.named_parameters())
    bad = []
    with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=args.stage == 3):
        for name, p in params:
            if not torch.equal(p.detach(), dump[f"model/{name}"]):
                bad.append(f"model/{name}")
    for name, p in params:
        if not torch.equal(safe_get_full_fp32_param(p), dump[f"fp32_master/{name}"]):
            bad.append(f"fp32_master/{name}")
    counters = {
        n: int(getattr(engine, n)) for n in ("global_steps", "global_samples", "micro_steps")
    }
    checkpointer_for(engine, args.resaved).save(step)
    with open(args.out, "w") as f:
        json.dump({"step": step, "mismatches": bad, "counters": counters}, f)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("src")
    parser.add_argument("resaved")
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--dump", required=True)
    parser.add_argument("--out", required=True)
    training_scripts.single_process_env()
    main(parser.parse_args())
    training_scripts.end_deepspeed_process()
