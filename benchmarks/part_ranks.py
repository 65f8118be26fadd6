"""The multi-rank half of the suite's part ``single``: FSDP2 on ``--ranks`` processes.

:func:`launch` runs this file under ``torch.distributed.run --standalone`` (gloo,
``OMP_NUM_THREADS=1``) and returns what rank 0 wrote:

    python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        benchmarks/part_ranks.py --mb 300 --repeats 5 --dir /tmp/x --out /tmp/x.json

The same Linear layers + AdamW state as ``common.build_state``, built on the meta device,
sharded with ``fully_shard`` per layer and at the root over a CPU mesh, then
materialized. Times are taken on rank 0 between barriers (the slowest rank decides);
peak extra RSS is per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import common
import contenders


def launch(
    mb: float, width: int, repeats: int, root: Path, ranks: int, timeout: float, log
) -> dict:
    """The multi-rank measurements, as a dict (``{"error": ...}`` where they failed)."""
    out = root / "fsdp.json"
    args = ["--mb", str(mb), "--width", str(width), "--repeats", str(repeats), "--out", str(out)]
    log(f"  {ranks}-rank FSDP2 under torchrun ...")
    try:
        proc = common.torchrun(__file__, ranks, [*args, "--dir", str(root / "fsdp")], timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"torchrun did not finish within {timeout:.0f} s"}
    finally:
        contenders.clear(root / "fsdp")
    if proc.returncode != 0 or not out.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        return {"error": f"torchrun exited {proc.returncode}: " + " | ".join(tail)}
    return json.loads(out.read_text())


def build(total_mb: float, width: int, mesh: DeviceMesh, *, seed: int, trained: bool):
    """The model sharded on the meta device, then materialized; ``trained``: AdamW after
    one step, else a fresh AdamW without state."""
    with torch.device("meta"):
        model = common.linears(total_mb, width)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(1000 * seed + dist.get_rank())
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(0, width**-0.5, generator=gen)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if trained:
        for p in model.parameters():
            local = torch.randn(p.to_local().shape, generator=gen)
            p.grad = DTensor.from_local(
                local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
            )
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def _result(case: common.Case) -> dict:
    peaks: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(peaks, case.peak)
    return {"times": case.times, "peak_extra": peaks, "error": case.error}


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    mesh = init_device_mesh("cpu", (world,))
    model, opt = build(args.mb, args.width, mesh, seed=0, trained=True)
    cpu = torch.device("cpu")
    ours, raw = (
        contenders.Ours(Path(args.dir), model, opt, cpu),
        contenders.DcpSave(Path(args.dir), model, opt, cpu),
    )

    def on_rank0(fn: Callable[[], object]) -> Callable[[], None]:
        def call() -> None:
            if rank == 0:
                fn()
            dist.barrier()

        return call

    fresh: list = []

    def build_fresh() -> None:
        fresh.clear()
        common.release_free_memory()
        fresh.extend(build(args.mb, args.width, mesh, seed=1, trained=False))
        on_rank0(lambda: common.drop_page_cache([str(ours.dir)]))()

    def own_shard_files() -> list[str]:
        """This rank's files in the step ours saved this round (docs/format.md:
        ``rank_NNNNN.bin``, and ``rank_NNNNN.1.bin``, ... where a shard is split)."""
        return sorted(str(p) for p in ours.dir.glob(f"step_*/rank_{rank:05d}.*bin"))

    def case(name: str, fn, setup=None, teardown=None) -> common.Case:
        return common.Case(name, name, fn, setup, teardown, dist.barrier)

    cold = lambda c: on_rank0(lambda: common.drop_page_cache([str(c.latest())]))  # noqa: E731
    # Round-robin, like the one-process cases: each round's restores read its saves.
    saves = [
        case("ours save", ours.save, on_rank0(ours.clear)),
        case("raw DCP save (thread_count=1)", raw.save, on_rank0(raw.clear)),
    ]
    restores = [
        case("ours restore, fresh objects", lambda: contenders.restore("ours", ours.dir, *fresh),
             build_fresh, fresh.clear),
        case("ours restore, existing objects",
             lambda: contenders.restore("ours", ours.dir, model, opt), cold(ours)),
        case("raw DCP load, existing objects",
             lambda: contenders.restore("dcp", raw.latest(), model, opt), cold(raw)),
        # After building fresh objects, as "ours restore, fresh objects" (a resumed job
        # has built its model before it reads).
        case("cold read into new tensors", lambda: contenders.read_files_new(own_shard_files()),
             build_fresh, fresh.clear),
    ]  # fmt: skip
    common.run_rounds([saves, restores], args.repeats, lambda line: None)
    ours.close()
    results = {c.key: _result(c) for c in saves + restores}
    shard = [0] * world
    dist.all_gather_object(shard, common.state_bytes(model, opt))
    if rank == 0:
        result = {"world": world, "shard_bytes": shard, "cases": results}
        Path(args.out).write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mb", type=float, required=True)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", required=True, help="scratch folder (removed by the caller)")
    parser.add_argument("--out", required=True, help="JSON results (written by rank 0)")
    worker(parser.parse_args())
    common.exit_at_once()  # the results are written
