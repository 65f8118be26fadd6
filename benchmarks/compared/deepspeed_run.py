"""DeepSpeed: one training script, resumed by DeepSpeed's own checkpoints or by unbroken's.

    python benchmarks/compared/deepspeed_run.py DIR --resume own|unbroken [--steps 40]

The same training both ways (``shared.py``): a ZeRO-2 bf16 engine over the shared MLP, the
torch AdamW and warm-up schedule given to ``deepspeed.initialize``, two micro-batches per
optimizer step (``gradient_accumulation_steps``), the data shuffled per epoch by a
``DistributedSampler``. One process (gloo).

- ``own``: ``engine.save_checkpoint(DIR/ckpt, client_state={"step": N})`` every ``--every``
  steps; at start ``engine.load_checkpoint(DIR/ckpt)`` (the newest tag), the step read from
  its client state, the epoch and the batches already done in it derived from the step,
  and those batches skipped (the sampler's order is seeded by the epoch, so the same
  batches follow).
- ``unbroken``: ``checkpointer_for(engine, DIR/ckpt, dataloader=loader)`` over a
  ``StatefulDataLoader`` (docs/integrations/deepspeed.md).
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import shared
import torch
from torch import nn


def main() -> None:
    parser = shared.options(__doc__)
    args = parser.parse_args()
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}.items():  # fmt: skip
        os.environ.setdefault(name, value)
    import deepspeed

    torch.set_num_threads(1)  # one reduction order, whatever the machine's load
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    own = args.resume == "own"
    model = shared.mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = shared.warmup(opt)
    config = {
        "train_micro_batch_size_per_gpu": shared.BATCH_SIZE,
        "gradient_accumulation_steps": args.accumulate,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2},
        "bf16": {"enabled": True},
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                           config=config)  # fmt: skip
    data = torch.utils.data.TensorDataset(*shared.rows(args.rows))
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, seed=0)
    folder = args.dir / "ckpt"
    if own:
        loader = torch.utils.data.DataLoader(data, batch_size=shared.BATCH_SIZE, sampler=sampler)
        step, ckpt = _own_restore(engine, folder), None
        skip = (step * args.accumulate) % len(loader)
    else:
        from torchdata.stateful_dataloader import StatefulDataLoader

        from unbroken.integrations.deepspeed import checkpointer_for

        loader = StatefulDataLoader(data, batch_size=shared.BATCH_SIZE, sampler=sampler)
        ckpt = checkpointer_for(engine, folder, dataloader=loader)
        step, skip = ckpt.restore().step, 0  # the loader resumes mid-epoch by itself
    stop = shared.stop_step()
    log = shared.StepLog(args.dir)
    engine.train()
    losses: list[torch.Tensor] = []
    done = step * args.accumulate  # micro-batches trained
    # A restored loader stopped after its epoch's last batch first ends that epoch (it
    # yields nothing): the loop starts in it. The own skip starts in the next one.
    epoch = done // len(loader) if own else max(0, done - 1) // len(loader)
    while step < args.steps and step != stop:
        sampler.set_epoch(epoch)
        for x, y in itertools.islice(loader, skip, None):
            log.saw(x)
            loss = nn.functional.mse_loss(engine(x.bfloat16()).float(), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
            if len(losses) < args.accumulate:  # the engine steps its optimizer every 2
                continue
            step += 1
            log.step(step, torch.stack(losses).mean().item())
            losses.clear()
            if step % args.every == 0 or step == stop or (ckpt and ckpt.should_stop(step)):
                if ckpt is None:
                    engine.save_checkpoint(str(folder), client_state={"step": step})
                else:
                    ckpt.save(step)
            if step == args.steps or step == stop:
                break
        skip, epoch = 0, epoch + 1
    if step == args.steps:
        _write_final(args.dir, engine)
    if ckpt is not None:
        ckpt.close()
    torch.distributed.barrier()
    os._exit(0)  # DeepSpeed keeps its process groups in module globals (see tests)


def _own_restore(engine, folder: Path) -> int:
    if not (folder / "latest").exists():
        return 0
    _, client = engine.load_checkpoint(str(folder))
    return int(client["step"])


def _write_final(run_dir: Path, engine) -> None:
    """The end state through DeepSpeed's own API, whichever way the run resumed."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from safetensors.torch import save_file

    tensors = {f"model.{k}": v for k, v in engine.module.state_dict().items()}
    for name, p in engine.module.named_parameters():
        tensors[f"optimizer.{name}.fp32_master"] = safe_get_full_fp32_param(p)
        for key in ("exp_avg", "exp_avg_sq"):
            tensors[f"optimizer.{name}.{key}"] = safe_get_full_optimizer_state(p, key)
    plain = {k: v.detach().cpu().clone().contiguous() for k, v in tensors.items()}
    save_file(plain, str(Path(run_dir) / shared.FINAL))


if __name__ == "__main__":
    main()
