"""Ours side by side with its peers, in one run (issue 15, item 6).

    python benchmarks/peers.py                   # 300 MB and 1.2 GB, median of 5 rounds
    python benchmarks/peers.py --sizes 300 --repeats 2
    python benchmarks/peers.py --quick           # a tiny state, 1 round: a smoke test
    python benchmarks/peers.py --markdown        # also print the docs section
    python benchmarks/peers.py --write-docs      # and put it in docs/benchmarks.md

Contenders (``peers_contenders.py``): ours (sync ``save()``, verified; ``async_save=
"overlap"`` and ``True``), raw ``torch.distributed.checkpoint`` (``dcp.save`` with 1 and 2
writer threads, ``dcp.async_save``), ``torch.save`` + fsync, and torch-checkpointing 0.1.1
in its documented CPU configuration (sync, async, and async with its default O_DIRECT
storage). State: ``common.build_state`` (Linear layers + AdamW moments).

Per size, every contender is built and saves once untimed (a warm-up: staging buffers,
writer processes), then each round saves with every contender (order rotated by one place
per round) and restores each format twice in fresh processes (``--restore-worker``:
fresh objects, only the restore call timed): once after evicting the checkpoint's files
from the page cache, once with them cached. The cold restore also hashes every restored
tensor (blake2b of its bytes, with dtype, shape and stride) and the parent compares with
the hashes of the saved state: no tensor crosses processes. Never asserts timings.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import peers_report
import unbroken as ub
from common import (
    OtherLoad,
    PeakRSS,
    build_state,
    drop_page_cache,
    fresh_like,
    git_revision,
    layer_count,
    machine_info,
    release_free_memory,
    rotated,
    rss,
    state_bytes,
)
from docs_sections import PEERS
from peers_contenders import CONTENDERS, RESTORE_FROM, Contender, import_library, restore
from peers_report import Result
from report import Report, inline, shown_command

HERE = Path(__file__).resolve().parent
QUICK_MB, QUICK_WIDTH = 4.0, 256


# Memory: this process, plus the private memory of its child processes -----------------


def _children_anon() -> int:
    """Private anonymous memory (RssAnon) of this process's children, in bytes: a peer's
    writer process. Their shared memory is not added (this process maps it too)."""
    total = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids = f.read().split()
        except OSError:
            continue
        for pid in pids:
            try:
                with open(f"/proc/{pid}/status") as f:
                    for line in f:
                        if line.startswith("RssAnon:"):
                            total += int(line.split()[1]) * 1024
                            break
            except OSError:
                pass
    return total


class TreeRSS(PeakRSS):
    """:class:`common.PeakRSS` over this process and its children's private memory."""

    def _sample(self, fd: int, page: int) -> int:
        return super()._sample(fd, page) + _children_anon()

    def __enter__(self) -> TreeRSS:
        super().__enter__()
        self.base = self.peak = rss() + _children_anon()
        return self


# The state's digest: what a restore must give back, bit for bit -----------------------


def _digest(t: torch.Tensor) -> str:
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    h = hashlib.blake2b(memoryview(data), digest_size=16).hexdigest()
    return f"{t.dtype}|{tuple(t.shape)}|{t.stride()}|{t.device}|{h}"


def digests(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, str]:
    """Every tensor of the model and optimizer state dicts -> dtype|shape|stride|device|
    blake2b of its bytes; non-tensors and param_groups -> repr."""
    out = {f"model.{k}": _digest(v) for k, v in model.state_dict().items()}
    sd = opt.state_dict()
    for i, state in sd["state"].items():
        for k, v in state.items():
            out[f"optim.{i}.{k}"] = _digest(v) if isinstance(v, torch.Tensor) else repr(v)
    out["optim.param_groups"] = repr(sd["param_groups"])
    return out


def compare(expected: dict[str, str], got: dict[str, str]) -> str:
    """``exact``, or what differed (the first few entries)."""
    fields = ("dtype", "shape", "stride", "device", "bytes")
    problems = [f"{k} missing" for k in expected if k not in got]
    problems += [f"{k} unexpected" for k in got if k not in expected]
    for k in expected.keys() & got.keys():
        if expected[k] != got[k]:
            a, b = expected[k].split("|"), got[k].split("|")
            what = [f for f, x, y in zip(fields, a, b, strict=False) if x != y] or ["value"]
            problems.append(f"{k} {'/'.join(what)}")
    if not problems:
        return "exact"
    problems.sort()
    more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
    return "; ".join(problems[:3]) + more


# The restore worker: a fresh process, fresh objects, only the restore call timed ---------


def restore_worker(args: argparse.Namespace) -> None:
    with torch.device("meta"):
        like = nn.Sequential(
            *(nn.Linear(args.width, args.width, bias=False)
              for _ in range(layer_count(args.mb, args.width)))
        )  # fmt: skip
    model, opt = fresh_like(like)
    import_library(args.restore_worker)
    release_free_memory()
    with PeakRSS() as mem:
        start = time.perf_counter()
        restore(args.restore_worker, args.path, model, opt)
        seconds = time.perf_counter() - start
    out = {"seconds": seconds, "peak_extra": mem.extra}
    if args.digest:
        out["digests"] = digests(model, opt)
    print("RESULT " + json.dumps(out), flush=True)


def run_worker(
    family: str, path: Path, mb: float, width: int, digest: bool, timeout: float
) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--restore-worker", family,
           "--path", str(path), "--mb", str(mb), "--width", str(width)]  # fmt: skip
    if digest:
        cmd.append("--digest")
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"restore did not finish within {timeout:.0f} s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
    return {"error": f"exited {done.returncode}: {tail[0][:200]}"}


def warm_cache(path: Path) -> None:
    """Read every file of a checkpoint once, so the next restore finds it cached."""
    files = [Path(d) / n for d, _, ns in os.walk(path) for n in ns] if path.is_dir() else [path]
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass


# One size ----------------------------------------------------------------------------


def _error(exc: BaseException) -> str:
    """One line: the type, and the last line of a multi-line message (a peer's writer
    process sends its whole traceback)."""
    lines = [x for x in str(exc).splitlines() if x.strip()] or [""]
    return f"{type(exc).__name__}: {lines[-1].strip()}"[:200]


def bench_size(mb: float, width: int, repeats: int, tmp: str) -> Result:
    model, opt = build_state(mb, width)
    nbytes = state_bytes(model, opt)
    res = Result(mb, nbytes, repeats)
    print(f"\n== state {nbytes / 1e9:.3f} GB, {repeats} rounds", flush=True)
    expected = digests(model, opt)
    root = Path(tempfile.mkdtemp(prefix="ub-peers-", dir=tmp))
    live: list[Contender] = []
    timeout = 300 + 120 * nbytes / 1e9
    try:
        for cls in CONTENDERS:  # built and warmed up one by one: what each keeps is known
            res.add_save(cls.key, cls.label, cls.kind, cls.fsyncs)
            release_free_memory()
            before = rss() + _children_anon()
            try:
                c = cls(root, model, opt)
            except Exception as exc:
                res.saves[cls.key].error = _error(exc)
                print(f"  {cls.label}: {res.saves[cls.key].error}", flush=True)
                continue
            live.append(c)
            try:
                c.save()
                c.clear()
            except Exception as exc:
                res.saves[cls.key].error = _error(exc)
                print(f"  {cls.label}: {res.saves[cls.key].error}", flush=True)
            release_free_memory()
            res.saves[cls.key].kept = rss() + _children_anon() - before
        with OtherLoad() as other:
            for i in range(repeats):
                started = time.perf_counter()
                _round(res, live, i, mb, width, expected, timeout)
                print(f"  round {i + 1}/{repeats}: {time.perf_counter() - started:.1f} s",
                      flush=True)  # fmt: skip
        res.other_load = other.cores
    finally:
        for c in live:
            c.close()
        shutil.rmtree(root, ignore_errors=True)
    return res


def _round(res: Result, live: list[Contender], i: int, mb: float, width: int,
           expected: dict[str, str], timeout: float) -> None:  # fmt: skip
    by_key = {c.key: c for c in live}
    for c in rotated(live, i):
        row = res.saves[c.key]
        if row.error is not None:
            continue
        c.clear()
        release_free_memory()
        try:
            with TreeRSS(interval=0.005) as mem:
                t = c.save()
        except Exception as exc:
            row.error = _error(exc)
            print(f"  {c.label} failed: {row.error}", flush=True)
            continue
        row.add(t.blocked, t.durable, t.fsync, mem.extra)
        if c.key not in RESTORE_FROM.values():
            c.clear()  # only the checkpoints restored below stay on disk
    for family in rotated(list(RESTORE_FROM), i):
        row = res.restore_row(family)
        src = by_key.get(RESTORE_FROM[family])
        if src is None or res.saves[src.key].error is not None:
            row.error = f"its save ({RESTORE_FROM[family]}) failed"
            continue
        drop_page_cache([str(src.latest())])
        cold = run_worker(family, src.latest(), mb, width, True, timeout)
        warm_cache(src.latest())
        warm = run_worker(family, src.latest(), mb, width, False, timeout)
        for got in (cold, warm):
            if "error" in got:
                row.error = got["error"]
                print(f"  restore {family} failed: {row.error}", flush=True)
        if row.error is None:
            row.add(cold["seconds"], warm["seconds"], max(cold["peak_extra"], warm["peak_extra"]),
                    compare(expected, cold["digests"]))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=float, nargs="+", default=[300, 1200], metavar="MB",
                        help="state sizes in MB (default: 300 1200)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=5, help="rounds per size (>= 5)")
    parser.add_argument("--width", type=int, default=2048, help="Linear layer width")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke test: a {QUICK_MB:g} MB state, 1 round")  # fmt: skip
    Report.add_options(parser, PEERS)
    parser.add_argument("--tmpdir", default=tempfile.gettempdir(),
                        help="where the temporary checkpoints go (one disk for all)")  # fmt: skip
    # The fresh-process restore (internal): python peers.py --restore-worker FAMILY ...
    parser.add_argument("--restore-worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--mb", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--digest", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    out = Report.from_args(args, PEERS)
    if args.restore_worker:
        restore_worker(args)
        return
    if args.quick:
        args.sizes, args.repeats, args.width = [QUICK_MB], 1, QUICK_WIDTH

    started = time.perf_counter()
    info = machine_info(args.tmpdir)
    info["unbroken"] = f"{ub.__version__}, revision {git_revision(str(HERE.parent))}"
    info["torch-checkpointing"] = peers_report.tc_version()
    print("machine: " + inline(info), flush=True)
    results = [bench_size(mb, args.width, args.repeats, args.tmpdir) for mb in args.sizes]
    elapsed = time.perf_counter() - started
    command = shown_command("peers.py", sys.argv[1:])
    out.publish(
        peers_report.render(results, info, elapsed, markdown=False),
        lambda: peers_report.render(results, info, elapsed, markdown=True, command=command),
    )


if __name__ == "__main__":
    main()
