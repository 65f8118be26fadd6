"""What a save and a restore cost as the number of ranks grows (docs/scaling.md).

    python benchmarks/scaling.py                          # 2, 4, 8 and 16 ranks, median of 3
    python benchmarks/scaling.py --ranks 2 4 --repeats 1  # quicker
    python benchmarks/scaling.py --rounds                 # also list every collective call

One ``torchrun --standalone`` job per rank count (gloo on CPU): a tiny FSDP2 model saved
and restored ``--repeats`` times, timed on rank 0 between barriers; every
``torch.distributed`` collective wrapped (before unbroken or DCP is imported) and counted,
with the pickled bytes of object collectives; the manifest measured by part. What is
measured is coordination, not bandwidth (docs/scaling.md says how). Never asserts timings.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import pickle
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

WRAPPED = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
    "all_to_all_single", "barrier", "broadcast", "broadcast_object_list", "gather",
    "gather_object", "monitored_barrier", "recv", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "scatter", "scatter_object_list", "send",
)  # fmt: skip
signatures: dict[str, inspect.Signature] = {}
OBJECT_COLLECTIVES = {
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list"
}  # fmt: skip


class CollectiveCounter:
    """Counts the ``torch.distributed`` collectives called while :meth:`counting` is on.

    Installed before unbroken or DCP is imported (they call ``dist.<name>``); the nested
    calls an object collective makes inside ``distributed_c10d`` are counted apart, as
    the gloo operations it is made of."""

    def __init__(self) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        self._local = threading.local()
        signatures.update({name: inspect.signature(getattr(c10d, name)) for name in WRAPPED})
        self._on = False
        self.reset()
        for name in WRAPPED:
            original = getattr(c10d, name)
            wrapped = self._wrap(name, original)
            setattr(c10d, name, wrapped)
            if getattr(dist, name, None) is original:
                setattr(dist, name, wrapped)

    def reset(self) -> None:
        self.calls: list[dict[str, Any]] = []  # the outermost calls, in order
        self.ops = 0  # gloo operations: calls that made no wrapped call inside them

    @contextlib.contextmanager
    def counting(self):
        self.reset()
        self._on = True
        try:
            yield self
        finally:
            self._on = False

    def _wrap(self, name: str, original):
        counter = self

        def wrapper(*args, **kwargs):
            if not counter._on:
                return original(*args, **kwargs)
            bound = signatures[name].bind(*args, **kwargs).arguments
            local = counter._local
            depth = getattr(local, "depth", 0)
            local.depth, local.nested = depth + 1, False
            try:
                out = original(*args, **kwargs)
            finally:
                local.depth = depth
            if not local.nested:
                counter.ops += 1
            local.nested = True  # for the call around this one
            if depth == 0:
                counter.calls.append({"name": name, "site": _site(), **_payload(name, bound)})
            return out

        wrapper.__wrapped__ = original
        return wrapper


def _payload(name: str, bound: dict[str, Any]) -> dict[str, int]:
    """Pickled bytes this rank sends and receives through an object collective (taken
    after the call: the results are in its arguments)."""
    if name not in OBJECT_COLLECTIVES:
        return {}

    def size(x: Any) -> int:
        return len(pickle.dumps(x)) if x is not None else 0

    def total(xs: Any) -> int:
        return sum(size(x) for x in xs or [])

    if name == "all_gather_object":
        return {"sent": size(bound["obj"]), "received": total(bound["object_list"])}
    if name == "gather_object":  # the list only on the destination
        return {"sent": size(bound["obj"]), "received": total(bound.get("object_gather_list"))}
    if name == "broadcast_object_list":
        src = bound.get("src")
        src = bound.get("group_src") or 0 if src is None else src
        n = total(bound["object_list"])  # the source sends it, every other rank receives it
        return {"sent": n, "received": 0} if _rank() == src else {"sent": 0, "received": n}
    # scatter_object_list: the source sends every rank's part, each rank receives its own
    return {"sent": total(bound.get("scatter_object_input_list")),
            "received": total(bound["scatter_object_output_list"])}  # fmt: skip


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _site() -> str:
    """Who asked for the collective: the unbroken function (and the helper of
    core/collective.py it went through), or DCP's save or load."""
    frame, helper, dcp = sys._getframe(2), None, None
    while frame is not None:
        path = frame.f_code.co_filename.replace(os.sep, "/")
        if "/torch/distributed/checkpoint/" in path and dcp is None:
            dcp = frame.f_code.co_name
        elif "/unbroken/" in path:
            if path.endswith("core/collective.py"):
                helper = frame.f_code.co_name  # the outermost: what unbroken called
            else:
                where = f"{path.rsplit('/unbroken/', 1)[1]}:{frame.f_code.co_name}"
                if dcp is not None:
                    return f"{where} via DCP"
                return f"{where} ({helper})" if helper else where
        frame = frame.f_back
    return "elsewhere"


# Work whose cost grows with the ranks: what rank 0 alone does, and what every rank does
# over the whole manifest (module, attribute, label), timed on rank 0.
PLANNER = "torch.distributed.checkpoint.default_planner"
TIMED_WORK = [
    (PLANNER, "DefaultSavePlanner.create_global_plan", "save, rank 0: DCP's global plan"),
    ("unbroken.core.saving", "_manifest_body", "save, rank 0: manifest built"),
    ("unbroken.format.manifest", "encode", "save, rank 0: manifest encoded"),
    ("unbroken.storage.run_folder", "RunFolder.commit", "save, rank 0: manifest written"),
    ("unbroken.core.resuming", "check_folder", "restore, rank 0: manifest read and checked"),
    ("unbroken.format.shard_reader", "metadata_from_entries",
     "restore, each rank: DCP metadata from the manifest"),
    (PLANNER, "DefaultLoadPlanner.create_local_plan", "restore, each rank: DCP's local plan"),
]  # fmt: skip


class TimedWork:
    """CPU seconds of the calling thread in the functions of ``TIMED_WORK`` while
    :meth:`timing` is on (on an oversubscribed machine the wall time of a function
    includes the time other ranks held the cores)."""

    def __init__(self) -> None:
        import importlib

        self.seconds: dict[str, float] = {}
        self._on = False
        for module, attribute, label in TIMED_WORK:
            owner = importlib.import_module(module)
            *path, name = attribute.split(".")
            for part in path:
                owner = getattr(owner, part)
            setattr(owner, name, self._wrap(getattr(owner, name), label))

    @contextlib.contextmanager
    def timing(self):
        self.seconds, self._on = {}, True
        try:
            yield self
        finally:
            self._on = False

    def _wrap(self, original, label: str):
        timer = self

        def wrapper(*args, **kwargs):
            if not timer._on:
                return original(*args, **kwargs)
            start = time.thread_time()  # CPU time: what other processes take is not counted
            try:
                return original(*args, **kwargs)
            finally:
                took = time.thread_time() - start
                timer.seconds[label] = timer.seconds.get(label, 0.0) + took

        return wrapper


# -- one rank ---------------------------------------------------------------------------


def build(width: int, depth: int, mesh, *, seed: int, trained: bool):
    """Blocks of LayerNorm, a 3x-wide projection, an output projection, LayerNorm and a
    4x-wide MLP (12 tensors each), ``fully_shard`` per block and at the root; AdamW after
    one step (``trained``) or without state (a resumed process before ``restore()``)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
            x = x + self.proj(torch.tanh(q * k) * v)
            return x + self.down(torch.relu(self.up(self.norm2(x))))

    torch.manual_seed(seed)
    model = nn.Sequential(*(Block() for _ in range(depth)), nn.Linear(width, 8))
    for block in model[:-1]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if trained:
        g = torch.Generator().manual_seed(dist.get_rank())
        model(torch.randn(4, width, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def _manifest_parts(path: Path) -> dict[str, Any]:
    """The manifest's size, whole and by part (each part as the manifest lays it out)."""
    data = path.read_bytes()
    doc = json.loads(data)

    def size(x: Any, depth: int = 1) -> int:
        """As laid out ``depth`` levels down (indent=1: one more space a line a level)."""
        for _ in range(depth):
            x = {"": x}
        return len(json.dumps(x, indent=1).encode())

    per_rank = {
        name: size(entry.get("ranks", {}), 3)
        for name, entry in doc["components"].items()
        if entry.get("per_rank")
    }
    tensors = doc["tensors"]
    return {
        "bytes": len(data),
        "tensors": len(tensors),
        "sharded": sum(len(e["chunks"]) > 1 for e in tensors.values()),
        "chunks": sum(len(e["chunks"]) for e in tensors.values()),
        "tensor_bytes": size(tensors),
        "file_records": len(doc["files"]),
        "file_bytes": size(doc["files"]),
        "component_bytes": size(doc["components"]),
        "per_rank_component_bytes": per_rank,
    }


def worker(args: argparse.Namespace) -> None:
    counter = CollectiveCounter()  # before unbroken and DCP are imported
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import unbroken as ub

    work = TimedWork()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model, opt = build(args.width, args.depth, mesh, seed=0, trained=True)
    folder = str(Path(args.dir) / "ckpt")
    ckpt = ub.Checkpointer(folder, model=model, optimizer=opt, keep_last=2)
    ckpt.save(1)  # warm-up: first-use imports, the folder's files
    timings: dict[str, list[float]] = {"save": [], "restore": []}
    cpu: dict[str, list[float]] = {"save": [], "restore": []}  # this process, all threads
    counts: dict[str, dict] = {}
    spent: dict[str, list[float]] = {}

    def timed(kind: str, fn) -> Any:
        dist.barrier()
        with counter.counting(), work.timing():
            start, start_cpu = time.perf_counter(), time.process_time()
            out = fn()
            elapsed, used = time.perf_counter() - start, time.process_time() - start_cpu
        dist.barrier()
        timings[kind].append(elapsed)
        cpu[kind].append(used)
        for label, seconds in work.seconds.items():
            spent.setdefault(label, []).append(seconds)
        counts[kind] = {"calls": list(counter.calls), "ops": counter.ops}
        return out

    for i in range(args.repeats):
        timed("save", lambda i=i: ckpt.save(2 + i))
        fresh, fresh_opt = build(args.width, args.depth, mesh, seed=1, trained=False)
        with counter.counting():  # what a resumed process does around restore(), untimed
            resumed = ub.Checkpointer(folder, model=fresh, optimizer=fresh_opt)
            counts["construct"] = {"calls": list(counter.calls), "ops": counter.ops}
        report = timed("restore", resumed.restore)
        with counter.counting():
            resumed.close()
            counts["close"] = {"calls": list(counter.calls), "ops": counter.ops}
        if not (report.restored and report.verified and report.step == 2 + i):
            raise RuntimeError(f"rank {rank}: the restore did not restore and verify: {report}")
    ckpt.close()
    # Every rank's timings (the slowest decides) and rank 0's and the others' traffic.
    gathered: list[Any] = [None] * world
    with contextlib.suppress(Exception):
        counter.reset()
    dist.all_gather_object(gathered, {"timings": timings, "cpu": cpu, "counts": counts})
    if rank == 0:
        step = max(Path(folder).glob("step_*"))
        result = {
            "world": world,
            "width": args.width,
            "depth": args.depth,
            "parameters": sum(p.numel() for p in model.parameters()),
            "manifest": _manifest_parts(step / "manifest.json"),
            "files": sorted(p.name for p in step.iterdir()),
            "work": spent,
            "ranks": gathered,
        }
        Path(args.out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


# -- the parent: one job per rank count, the tables -------------------------------------


def run_job(world: int, args: argparse.Namespace, scratch: Path) -> dict:
    from common import torchrun  # not at the top: a worker wraps the collectives first

    out, folder = scratch / f"w{world}.json", scratch / f"w{world}"
    options = ["--worker", "--dir", str(folder), "--out", str(out), "--repeats", str(args.repeats)]
    options += ["--width", str(args.width), "--depth", str(args.depth)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNBROKEN_")}
    started = time.perf_counter()
    proc = torchrun(__file__, world, options, args.timeout, env)
    if proc.returncode != 0:
        raise SystemExit(f"{world} ranks failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    result = json.loads(out.read_text())
    result["job_s"] = time.perf_counter() - started
    shutil.rmtree(folder, ignore_errors=True)
    return result


def _traffic(calls: list[dict]) -> tuple[int, int]:
    return sum(c.get("sent", 0) for c in calls), sum(c.get("received", 0) for c in calls)


def _sites(ranks: list[dict], kind: str) -> dict[str, list[int]]:
    """Site -> [calls, bytes rank 0 sends, bytes rank 0 receives, most another receives]
    (the calls in the same order on every rank)."""
    sites: dict[str, list[int]] = {}
    others = [r["counts"][kind]["calls"] for r in ranks[1:]]
    for i, call in enumerate(ranks[0]["counts"][kind]["calls"]):
        entry = sites.setdefault(f"{call['site']}: {call['name']}", [0, 0, 0, 0])
        entry[0] += 1
        entry[1] += call.get("sent", 0)
        entry[2] += call.get("received", 0)
        entry[3] += max((o[i].get("received", 0) for o in others if i < len(o)), default=0)
    return sites


def summarize(result: dict) -> dict[str, Any]:
    ranks = result["ranks"]
    row: dict[str, Any] = {"world": result["world"], "manifest": result["manifest"]}
    row["files"] = len([f for f in result["files"] if f != "manifest.json"])
    row["work"] = {k: statistics.median(v) for k, v in result["work"].items()}
    for kind in ("construct", "close"):
        calls = ranks[0]["counts"][kind]["calls"]
        row[kind] = {"rounds": len(calls), "sites": _sites(ranks, kind)}
    for kind in ("save", "restore"):
        slowest = [
            max(r["timings"][kind][i] for r in ranks) for i in range(len(ranks[0]["timings"][kind]))
        ]
        counts0 = ranks[0]["counts"][kind]
        others = [r["counts"][kind] for r in ranks[1:]]
        sent0, received0 = _traffic(counts0["calls"])
        runs = range(len(slowest))
        row[kind] = {
            "median_s": statistics.median(slowest),
            "rank0_cpu_s": statistics.median(ranks[0]["cpu"][kind]),
            "all_cpu_s": statistics.median(sum(r["cpu"][kind][i] for r in ranks) for i in runs),
            "runs_s": slowest,
            "rounds": len(counts0["calls"]),
            "ops": counts0["ops"],
            "rank0_sent": sent0,
            "rank0_received": received0,
            "other_received_max": max((_traffic(c["calls"])[1] for c in others), default=0),
            "same_rounds_everywhere": all(len(c["calls"]) == len(counts0["calls"]) for c in others),
            "sites": _sites(ranks, kind),
        }
    return row


def _kb(n: float) -> str:
    return f"{n / 1024:.1f}"


def print_tables(rows: list[dict], args: argparse.Namespace) -> None:
    first = rows[0]["manifest"]
    print(f"\nmodel: {args.depth} blocks of width {args.width}, {first['tensors']} saved tensors "
          f"({first['sharded']} sharded)")  # fmt: skip
    print("\n| ranks | save (s) | restore (s) | rounds save / restore | gloo ops save / restore"
          " | files | manifest (KiB) | chunk entries | rank 0 receives, save / restore (KiB)"
          " | another rank receives, restore (KiB) |")  # fmt: skip
    print("|" + "---|" * 10)
    for r in rows:
        s, t, m = r["save"], r["restore"], r["manifest"]
        print(f"| {r['world']} | {s['median_s']:.3f} | {t['median_s']:.3f} "
              f"| {s['rounds']} / {t['rounds']} | {s['ops']} / {t['ops']} | {r['files']} "
              f"| {_kb(m['bytes'])} | {m['chunks']} | {_kb(s['rank0_received'])} / "
              f"{_kb(t['rank0_received'])} | {_kb(t['other_received_max'])} |")  # fmt: skip
    print("\nCPU seconds, median: save rank 0 / all ranks together | restore rank 0 / all ranks")
    for r in rows:
        s, t = r["save"], r["restore"]
        print(f"  {r['world']:>3} ranks: {s['rank0_cpu_s']:.3f} / {s['all_cpu_s']:.3f} | "
              f"{t['rank0_cpu_s']:.3f} / {t['all_cpu_s']:.3f}")  # fmt: skip
    print("\nmanifest by part (KiB): tensor entries | file records | components (per-rank part)"
          " | the rest")  # fmt: skip
    for r in rows:
        m = r["manifest"]
        per_rank = sum(m["per_rank_component_bytes"].values())
        rest = m["bytes"] - m["tensor_bytes"] - m["file_bytes"] - m["component_bytes"]
        print(f"  {r['world']:>3} ranks: {_kb(m['tensor_bytes'])} | {_kb(m['file_bytes'])} "
              f"| {_kb(m['component_bytes'])} ({_kb(per_rank)}) | {_kb(rest)}")  # fmt: skip
    if len(rows) > 1:
        a, b = rows[0]["manifest"], rows[-1]["manifest"]
        ranks = rows[-1]["world"] - rows[0]["world"]
        per_rank = (b["bytes"] - a["bytes"]) / ranks
        per_chunk = (b["tensor_bytes"] - a["tensor_bytes"]) / max(1, b["chunks"] - a["chunks"])
        per_file = (b["file_bytes"] - a["file_bytes"]) / max(
            1, b["file_records"] - a["file_records"]
        )
        per_rank_state = (
            sum(b["per_rank_component_bytes"].values())
            - sum(a["per_rank_component_bytes"].values())
        ) / ranks
        print(f"\nmanifest growth, {rows[0]['world']} -> {rows[-1]['world']} ranks: "
              f"{per_rank:.0f} bytes per rank; {per_chunk:.0f} per chunk entry, {per_file:.0f} "
              f"per file record, {per_rank_state:.0f} of per-rank state per rank")  # fmt: skip
    for r in rows:
        same = r["save"]["same_rounds_everywhere"] and r["restore"]["same_rounds_everywhere"]
        runs = ", ".join(f"{x:.3f}" for x in r["save"]["runs_s"])
        runs_r = ", ".join(f"{x:.3f}" for x in r["restore"]["runs_s"])
        print(f"{r['world']:>3} ranks: save runs {runs}; restore runs {runs_r}; "
              f"every rank the same rounds: {same}")  # fmt: skip
    labels = [label for _, _, label in TIMED_WORK]
    print("\nwork that grows with the ranks, median CPU ms (on rank 0):")
    print("| step | " + " | ".join(f"{r['world']} ranks" for r in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for label in labels:
        cells = " | ".join(f"{1000 * r['work'].get(label, 0.0):.1f}" for r in rows)
        print(f"| {label} | {cells} |")
    last = rows[-1]
    print(f"\naround a restore at {last['world']} ranks: Checkpointer() "
          f"{last['construct']['rounds']} round(s), close() {last['close']['rounds']}")  # fmt: skip
    if args.rounds:
        for kind in ("save", "restore", "construct", "close"):
            print(f"\nrounds of one {kind} at {last['world']} ranks, by site (KiB: rank 0 "
                  "sends / receives; the most another rank receives):")  # fmt: skip
            for site, (n, sent, received, other) in sorted(last[kind]["sites"].items()):
                print(f"  {n} x {site}  ({_kb(sent)} / {_kb(received)}; {_kb(other)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--rounds", action="store_true", help="list every collective's site")
    parser.add_argument("--json", type=Path, help="write the summaries here")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        code = 0
        try:
            worker(args)
        except BaseException:
            traceback.print_exc()
            code = 1
        from common import exit_at_once  # only now: the worker wraps the collectives first

        exit_at_once(code)
    rows = []
    with tempfile.TemporaryDirectory(prefix="unbroken-scaling-") as scratch:
        for world in args.ranks:
            result = run_job(world, args, Path(scratch))
            rows.append(summarize(result))
            print(f"{world} ranks: done in {result['job_s']:.1f}s", file=sys.stderr)
    print_tables(rows, args)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
