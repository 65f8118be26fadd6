"""The 2-rank FSDP2 half of ``save_restore.py``: one rank of it, run under torchrun.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        benchmarks/fsdp_worker.py --mb 300 --repeats 5 --dir /tmp/x --out /tmp/x.json

The same Linear layers + AdamW state as ``common.build_state``, sharded with
``fully_shard`` per layer and at the root over a CPU mesh (gloo). Times are taken on
rank 0 between barriers (the slowest rank decides); peak extra RSS is per rank. Rank 0
writes the results as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import paths
import unbroken as ub
from common import PeakRSS, drop_page_cache, layer_count, release_free_memory, rotated
from unbroken.format.shards import shard_file_name


def build(
    total_mb: float, width: int, mesh: DeviceMesh, *, seed: int, trained: bool
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Model built on the meta device, sharded, then materialized (how FSDP2 models are
    built); ``trained``: AdamW after one step, else a fresh AdamW without state."""
    with torch.device("meta"):
        model = nn.Sequential(
            *(nn.Linear(width, width, bias=False) for _ in range(layer_count(total_mb, width)))
        )
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


def local_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of this rank's shard of the state."""

    def nbytes(t: torch.Tensor) -> int:
        local = t.to_local() if isinstance(t, DTensor) else t
        return local.numel() * local.element_size()

    n = sum(nbytes(p) for p in model.parameters())
    n += sum(nbytes(t) for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    return n


class Case:
    """One path: timed between barriers on every rank; a failure is recorded, not raised."""

    def __init__(
        self,
        name: str,
        fn: Callable[[], object],
        setup: Callable[[], object] | None = None,
        teardown: Callable[[], object] | None = None,
    ) -> None:
        self.name, self.fn, self.setup, self.teardown = name, fn, setup, teardown
        self.times: list[float] = []
        self.peak = 0
        self.error: str | None = None

    def run_once(self) -> None:
        if self.error is not None:
            return
        try:
            if self.setup is not None:
                self.setup()
            release_free_memory()
            dist.barrier()
            with PeakRSS() as mem:
                start = time.perf_counter()
                self.fn()
                dist.barrier()
                self.times.append(time.perf_counter() - start)
            self.peak = max(self.peak, mem.extra)
            if self.teardown is not None:
                self.teardown()
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}".splitlines()[0]
            traceback.print_exc()

    def result(self) -> dict:
        peaks: list[int] = [0] * dist.get_world_size()
        dist.all_gather_object(peaks, self.peak)
        return {"times": self.times, "peak_extra": peaks, "error": self.error}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mb", type=float, required=True)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", required=True, help="scratch folder (removed by the caller)")
    parser.add_argument("--out", required=True, help="JSON results (written by rank 0)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    mesh = init_device_mesh("cpu", (world,))
    model, opt = build(args.mb, args.width, mesh, seed=0, trained=True)
    root = Path(args.dir)
    ours, raw = str(root / "ours"), str(root / "dcp")

    def on_rank0(fn: Callable[[], object]) -> Callable[[], None]:
        def call() -> None:
            if rank == 0:
                fn()
            dist.barrier()

        return call

    ckpt = ub.Checkpointer(ours, model=model, optimizer=opt, keep_last=None)
    steps = iter(range(1, 1_000_000))
    fresh: list = []

    def build_fresh() -> None:
        fresh.clear()
        release_free_memory()
        fresh.extend(build(args.mb, args.width, mesh, seed=1, trained=False))
        on_rank0(lambda: drop_page_cache([ours]))()

    def own_shard_files() -> list[str]:
        """The files of this rank's shard in the step ours saved this round."""
        first = shard_file_name(rank)  # rank_NNNNN.bin; a split shard adds rank_NNNNN.1.bin, ...
        prefix = first.removesuffix(".bin")
        return sorted(str(p) for p in Path(ours).glob(f"step_*/{prefix}.*bin"))

    # Round-robin, like the single-process cases: each round's restores read its saves.
    cases = [
        Case("ours save", lambda: ckpt.save(next(steps)),
             on_rank0(lambda: paths.clear_steps(ours))),
        Case("raw DCP save (thread_count=1)", lambda: paths.dcp_save(model, opt, raw, 1),
             on_rank0(lambda: paths.clear(raw))),
        Case("ours restore, fresh objects", lambda: paths.ours_restore(ours, *fresh),
             build_fresh, fresh.clear),
        Case("ours restore, existing objects", lambda: paths.ours_restore(ours, model, opt),
             on_rank0(lambda: drop_page_cache([ours]))),
        Case("raw DCP load, existing objects", lambda: paths.dcp_load(model, opt, raw),
             on_rank0(lambda: drop_page_cache([raw]))),
        # After building fresh objects, as "ours restore, fresh objects" (a resumed job
        # has built its model before it reads).
        Case("cold read into new tensors", lambda: paths.read_files_new(own_shard_files()),
             build_fresh, fresh.clear),
    ]  # fmt: skip
    saves, restores = cases[:2], cases[2:]
    for i in range(args.repeats):  # saves, then restores, each rotated by one per round
        for group in (saves, restores):
            for case in rotated(group, i):
                case.run_once()
    ckpt.close()
    results = {c.name: c.result() for c in cases}

    shard = [0] * world
    dist.all_gather_object(shard, local_bytes(model, opt))
    if rank == 0:
        result = {"world": world, "shard_bytes": shard, "cases": results}
        Path(args.out).write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # The results are written. Skip the interpreter's finalization: gloo's worker threads
    # outlive destroy_process_group and one releasing a tensor then aborts the process
    # (SIGABRT; seen here at 0.3 GB; docs/pitfalls.md).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
