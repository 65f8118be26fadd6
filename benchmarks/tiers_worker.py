"""One torchrun worker of the suite's part ``tiers`` (``part_tiers.py``): several agents on
127.0.0.1, each agent a node whose local folder is ``SHM/node_G`` (G: its ``GROUP_RANK``).
The state: Linear layers + AdamW after one step, FSDP2 over every rank.

    python tiers_worker.py save ROOT SHM OUT --mb MB --width W --repeats N
        local saves (sync, then ``async_save="overlap"``) and persistent overlap saves,
        each timed on every rank; then the same state saved for the restores: the local
        tier of ROOT/tier (its newest step, newer than its persistent ones), a persistent
        checkpoint ROOT/full (no local tier) and a DCP checkpoint ROOT/dcp
    python tiers_worker.py resume ROOT SHM OUT --mb MB --width W --source S
        a fresh process: restores (S: local, peer, persistent, dcp), checks where the
        state came from and that it is the saved one, bit for bit, then one training step

Every rank writes OUT/rank_R.json; a wrong source, an unverified restore or another
state than the saved one ends the worker with an error.
"""

import time

STARTED = time.time()  # before importing torch: the process's start, as near as it gets

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import common  # noqa: E402
import unbroken as ub  # noqa: E402

IMPORTED = time.time()
BATCH = 8


def build(mb: float, width: int, world: int, seed: int):
    """The layers, each FSDP2-sharded over every rank, and AdamW (no state yet)."""
    torch.manual_seed(seed)
    model = common.linears(mb, width)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(model, opt, width: int) -> None:
    x = torch.randn(BATCH, width, generator=torch.Generator().manual_seed(dist.get_rank()))
    opt.zero_grad(set_to_none=True)
    model(x).pow(2).mean().backward()
    opt.step()


def digest(model, opt) -> str:
    """blake2b of this rank's shards of every tensor of the model and optimizer state."""
    h = hashlib.blake2b(digest_size=16)
    msd, osd = model.state_dict(), opt.state_dict()
    items = [(f"model.{k}", v) for k, v in msd.items()]
    items += [(f"optim.{i}.{k}", v) for i, s in sorted(osd["state"].items()) for k, v in s.items()]
    for name, t in items:
        local = t.to_local() if isinstance(t, DTensor) else t
        local = local.detach().contiguous().reshape(-1)
        h.update(f"{name}|{local.dtype}|{local.numel()}".encode())
        h.update(memoryview(local.view(torch.uint8).numpy()))
    return h.hexdigest()


def timed(fn) -> float:
    """Seconds of ``fn`` on this rank, every rank starting together."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def save(args, rank: int, world: int, node: int) -> dict:
    model, opt = build(args.mb, args.width, world, seed=0)
    train_step(model, opt, args.width)
    out: dict[str, list[float]] = {}

    def local_rounds(ckpt, name: str, first: int) -> None:
        """A warm-up local save (staging buffers, files), then ``repeats`` timed ones."""
        for i in range(args.repeats + 1):
            dist.barrier()
            start = time.perf_counter()
            ckpt.save(first + i, tier="local")
            blocked = time.perf_counter() - start
            ckpt.wait_replicated()
            replicated = time.perf_counter() - start
            if i:
                out.setdefault(f"{name}.blocked", []).append(blocked)
                out.setdefault(f"{name}.replicated", []).append(replicated)
            else:
                out[f"{name}.first_blocked"] = [blocked]

    # sync: a local tier of its own (one Checkpointer per local folder), removed after
    sync_shm = args.shm / "sync" / f"node_{node}"
    tier = ub.LocalTier(sync_shm, replicas=1, keep_last=1)
    ckpt = ub.Checkpointer(args.root / "sync", model=model, optimizer=opt, local=tier)
    local_rounds(ckpt, "local_sync", 1)
    ckpt.close()
    dist.barrier()
    if int(os.environ["LOCAL_RANK"]) == 0:
        shutil.rmtree(sync_shm, ignore_errors=True)
    # overlap: persistent saves and local saves by one Checkpointer, alternately
    tier = ub.LocalTier(args.shm / f"node_{node}", replicas=1, keep_last=1)
    ckpt = ub.Checkpointer(
        args.root / "tier", model=model, optimizer=opt, local=tier, async_save="overlap",
        keep_last=1,
    )  # fmt: skip
    step = 1
    ckpt.save(step)  # warm-up of the persistent path (the local one: below)
    ckpt.wait()
    for i in range(args.repeats + 1):
        if i:
            step += 1
            dist.barrier()
            start = time.perf_counter()
            ckpt.save(step)
            out.setdefault("persistent_overlap.blocked", []).append(time.perf_counter() - start)
            ckpt.wait()
            out.setdefault("persistent_overlap.committed", []).append(time.perf_counter() - start)
        step += 1
        dist.barrier()
        start = time.perf_counter()
        ckpt.save(step, tier="local")
        blocked = time.perf_counter() - start
        ckpt.wait_replicated()
        replicated = time.perf_counter() - start
        if i:
            out.setdefault("local_overlap.blocked", []).append(blocked)
            out.setdefault("local_overlap.replicated", []).append(replicated)
        else:
            out["local_overlap.first_blocked"] = [blocked]
    local_steps = ckpt.steps(tier="local")
    assert local_steps and local_steps[-1] == step > (ckpt.latest_step() or 0), local_steps
    failures = [w for w in ckpt.warnings if w.startswith("replicas of local step")]
    assert not failures, failures
    ckpt.close()
    # the same state, for the persistent and DCP restores
    full = ub.Checkpointer(args.root / "full", model=model, optimizer=opt, keep_last=1)
    full.save(step)
    full.close()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(args.root / "dcp"))
    dist.barrier()
    return {"times": out, "digest": digest(model, opt), "step": step,
            "bytes": common.state_bytes(model, opt)}  # fmt: skip


def _timed_calls(spent: dict[str, float]) -> None:
    """Time the restore's passes over the bytes: the local tier's check of every copy it
    holds (``_check_copies``, which runs only after a read found damage) and the read,
    load and verification of the checkpoint (``restoring.restore``, for either tier);
    their seconds summed into ``spent``."""
    from unbroken.core import restoring
    from unbroken.tiers import local_restore

    for module, name, key in ((local_restore, "_check_copies", "check_copies"),
                              (restoring, "restore", "read_verify")):  # fmt: skip
        real = getattr(module, name)

        def wrapper(*a, _real=real, _key=key, **k):
            start = time.perf_counter()
            try:
                return _real(*a, **k)
            finally:
                spent[_key] = spent.get(_key, 0.0) + time.perf_counter() - start

        setattr(module, name, wrapper)


def resume(args, rank: int, world: int, node: int) -> dict:
    spent: dict[str, float] = {}
    _timed_calls(spent)
    model, opt = build(args.mb, args.width, world, seed=1)
    built = time.time()
    ckpt = None
    if args.source == "dcp":
        start = time.perf_counter()
        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(args.root / "dcp"))
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        restore_s = time.perf_counter() - start
        report, made = None, built
    else:
        if args.source == "persistent":
            ckpt = ub.Checkpointer(args.root / "full", model=model, optimizer=opt)
        else:
            tier = ub.LocalTier(args.shm / f"node_{node}", replicas=1, keep_last=1)
            ckpt = ub.Checkpointer(args.root / "tier", model=model, optimizer=opt, local=tier)
        made = time.time()  # the Checkpointer made (a local tier's: a group, its checks)
        start = time.perf_counter()
        report = ckpt.restore(require=True)
        restore_s = time.perf_counter() - start
        if report.source != args.source or not report.verified:
            raise SystemExit(
                f"rank {rank}: restored from {report.source!r} (verified: {report.verified}), "
                f"expected {args.source!r} verified: {report}"
            )
    check = time.perf_counter()
    got = digest(model, opt)  # untimed: subtracted below
    check_s = time.perf_counter() - check
    expected = json.loads((args.out.parent / "saved" / f"rank_{rank}.json").read_text())
    if got != expected["digest"]:
        raise SystemExit(f"rank {rank}: the state restored from {args.source} is not the saved one")
    start = time.perf_counter()
    train_step(model, opt, args.width)
    step_s = time.perf_counter() - start
    first_step = time.time() - check_s
    if ckpt is not None:
        ckpt.close()
    dist.barrier()
    return {"started": STARTED, "imported": IMPORTED, "built": built, "made": made,
            "restore": restore_s, "step_s": step_s, "spent": spent,
            "first_step": first_step, "launched": float(os.environ["TIERS_LAUNCHED"]),
            "source": None if report is None else report.source,
            "step": None if report is None else report.step}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description="a worker of the part tiers")
    parser.add_argument("mode", choices=["save", "resume"])
    parser.add_argument("root", type=Path)
    parser.add_argument("shm", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--mb", type=float, required=True)
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--source", choices=["local", "peer", "persistent", "dcp"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    node = int(os.environ["GROUP_RANK"])
    run = save if args.mode == "save" else resume
    record = {"rank": rank, "node": node, "world": world, **run(args, rank, world, node)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank_{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    common.exit_at_once(0)


if __name__ == "__main__":
    main()
