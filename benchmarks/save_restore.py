"""Save and restore of a training state: ours against the disk, torch.save and raw DCP.

    python benchmarks/save_restore.py                  # 0.3, 1.2 and 3 GB, median of 5
    python benchmarks/save_restore.py --sizes 4800     # larger states
    python benchmarks/save_restore.py --quick          # a tiny state, 1 run: a smoke test
    python benchmarks/save_restore.py --write-docs     # also regenerate docs/benchmarks.md
    python benchmarks/save_restore.py --sizes 1200 --profile   # where ours spends time
    python benchmarks/save_restore.py --write-docs --results run.json  # keep the figures
    python benchmarks/save_restore.py --render run.json --write-docs   # re-render them
                                                                       # (analysis.md edited)

For each size, in one run: (a) the disk floor (plain writes + fsync, cold reads),
(b) torch.save + fsync and torch.load + load_state_dict, (c) raw DCP through
get_state_dict/set_state_dict, (d) ours (sync save, cold restore into fresh and into
existing objects, async save when the Checkpointer accepts it), one copy of the state
into preallocated memory, the verification share, and the same on 2 FSDP2 ranks under
torchrun. Prints tables of seconds, GB/s, ratios and peak extra RSS, and the targets of
issue 15 with where we stand, and the cost per GB across the sizes. Never asserts
timings.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import paths
import profiling
import save_restore_report
import unbroken as ub
from common import (
    Measurement,
    OtherLoad,
    build_state,
    combined_digest,
    drop_page_cache,
    fresh_like,
    git_revision,
    machine_info,
    measure,
    release_free_memory,
    rotated,
    source_digests,
    state_bytes,
    state_tensors,
)
from docs_sections import SAVE_RESTORE
from report import Report, inline, shown_command
from save_restore_figures import Row, SizeResult, load_results, save_results
from verification_cost import checksum_all, fingerprint_all

HERE = Path(__file__).resolve().parent

QUICK_MB, QUICK_WIDTH = 4.0, 256


@dataclasses.dataclass
class Case:
    """One path to measure: ``fn`` timed, ``setup``/``teardown`` untimed around it."""

    key: str
    label: str
    fn: Callable[[], object]
    setup: Callable[[], object] | None = None
    teardown: Callable[[], object] | None = None
    times: list[float] = dataclasses.field(default_factory=list)
    peak: int = 0
    error: str | None = None

    def run_once(self) -> None:
        if self.error is not None:
            return
        try:
            m = measure(self.fn, 1, setup=self.setup, teardown=self.teardown)
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}".splitlines()[0]
            print(f"\n  {self.label} failed: {self.error}", flush=True)
            return
        self.times += m.times
        self.peak = max(self.peak, m.peak_extra)

    def row(self) -> Row:
        if self.error is not None or not self.times:
            return Row(self.label, None, error=self.error or "not run")
        return Row(self.label, Measurement(self.times, self.peak))


class Bench:
    """All single-process measurements of one state size, in one temp folder.

    The cases run round-robin (every case once per round, ``repeats`` rounds, saves
    first, then restores, then copies, each group rotated by one place per round) so that
    load from other processes and the disk's state spread over all of them alike; each
    round's restores read the files its saves just wrote.
    """

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, root: Path, repeats: int):
        self.model, self.opt = model, opt
        self.tensors = state_tensors(model, opt)
        self.nbytes = state_bytes(model, opt)
        self.root = root
        self.repeats = repeats
        self.rows: dict[str, Row] = {}
        self.notes: list[str] = []
        self._targets: list[torch.Tensor] = []  # preallocated, touched: read/copy targets
        self._fresh: list = []  # the fresh model and optimizer of a restore

    def path(self, name: str) -> str:
        return str(self.root / name)

    def run(self) -> None:
        ckpt = ub.Checkpointer(
            self.path("ours"), model=self.model, optimizer=self.opt, keep_last=None
        )
        asynchronous = self._async_case()
        self._targets = [torch.zeros_like(t) for t in self.tensors]
        groups = [[*self._save_cases(ckpt), *asynchronous], self._restore_cases(), self._other()]
        cases = [case for group in groups for case in group]
        try:
            for i in range(self.repeats):
                started = time.perf_counter()
                for group in groups:
                    for case in rotated(group, i):
                        case.run_once()
                print(f"  round {i + 1}/{self.repeats}: {time.perf_counter() - started:.1f} s",
                      flush=True)  # fmt: skip
        finally:
            ckpt.close()
            if self._async is not None:
                self._async.close()
            self._targets.clear()
        for case in cases:
            self.rows[case.key] = case.row()
        if self._async is not None:
            self.rows["async_block"] = Row(
                "(d) ours: async save, blocked in save()",
                Measurement(self._blocked, self.rows["async_commit"].m.peak_extra)
                if self.rows["async_commit"].m is not None
                else None,
                error=self.rows["async_commit"].error,
            )
        ok = [self.rows[k] for k in ("dcp_save_1", "dcp_save_2") if self.rows[k].m is not None]
        self.rows["dcp_save"] = (
            min(ok, key=lambda r: r.m.median) if ok else self.rows["dcp_save_1"]  # type: ignore[union-attr]
        )

    def _cold(self, name: str) -> Callable[[], None]:
        return lambda: drop_page_cache([self.path(name)])

    def _clear(self, name: str) -> Callable[[], None]:
        return lambda: paths.clear(self.path(name))

    def _fresh_objects(self, name: str) -> Callable[[], None]:
        def setup() -> None:
            self._fresh.clear()
            release_free_memory()
            self._fresh.extend(fresh_like(self.model))
            drop_page_cache([self.path(name)])

        return setup

    def _save_cases(self, ckpt: ub.Checkpointer) -> list[Case]:
        m, o, t = self.model, self.opt, self.tensors
        steps = iter(range(1, 1_000_000))
        ours = self.path("ours")
        return [
            Case("floor_write", "(a) write + fsync",
                 lambda: paths.write_raw(t, self.path("raw.bin")), self._clear("raw.bin")),
            Case("torch_save", "(b) torch.save + fsync",
                 lambda: paths.torch_save(m, o, self.path("full.pt")), self._clear("full.pt")),
            Case("dcp_save_1", "(c) DCP save, thread_count=1",
                 lambda: paths.dcp_save(m, o, self.path("dcp1"), 1), self._clear("dcp1")),
            Case("dcp_save_2", "(c) DCP save, thread_count=2",
                 lambda: paths.dcp_save(m, o, self.path("dcp2"), 2), self._clear("dcp2")),
            Case("ours_save", "(d) ours: save (sync, verified)",
                 lambda: ckpt.save(next(steps)), lambda: paths.clear_steps(ours)),
        ]  # fmt: skip

    def _restore_cases(self) -> list[Case]:
        m, o = self.model, self.opt
        fresh = self._fresh
        raw, ours = self.path("raw.bin"), self.path("ours")
        return [
            Case("floor_read", "(a) cold read into existing tensors",
                 lambda: paths.read_raw(self._targets, raw), self._cold("raw.bin")),
            # Built fresh objects first, as the restores into fresh objects do: a resumed
            # process has built its model before it reads, and this VM's first touch of
            # memory depends on what was freed and built just before (docs/benchmarks.md).
            Case("floor_read_new", "(a) cold read into new tensors",
                 lambda: paths.read_raw_new(self.tensors, raw), self._fresh_objects("raw.bin"),
                 fresh.clear),
            Case("torch_load", "(b) torch.load + load_state_dict, existing objects",
                 lambda: paths.torch_load(m, o, self.path("full.pt")), self._cold("full.pt")),
            Case("dcp_load", "(c) DCP load + set_state_dict, existing objects",
                 lambda: paths.dcp_load(m, o, self.path("dcp1")), self._cold("dcp1")),
            Case("dcp_load_fresh", "(c) DCP load + set_state_dict, fresh objects",
                 lambda: paths.dcp_load(*fresh, self.path("dcp1")), self._fresh_objects("dcp1"),
                 fresh.clear),
            Case("ours_restore_fresh", "(d) ours: restore, fresh objects",
                 lambda: paths.ours_restore(ours, *fresh), self._fresh_objects("ours"),
                 fresh.clear),
            Case("ours_restore", "(d) ours: restore, existing objects",
                 lambda: paths.ours_restore(ours, m, o), self._cold("ours")),
        ]  # fmt: skip

    def _other(self) -> list[Case]:
        t = self.tensors
        return [
            Case("copy", "one copy of the state into preallocated memory",
                 lambda: paths.copy_into(self._targets, t)),
            Case("clone", "one copy of the state into new memory (clone)",
                 lambda: [x.clone() for x in t]),
            Case("fingerprints", "fingerprints, every tensor once", lambda: fingerprint_all(t)),
            Case("checksums", "xxh3-128 checksums, every tensor once", lambda: checksum_all(t)),
        ]  # fmt: skip

    def _async_case(self) -> list[Case]:
        """The async save: its first call now (it may allocate staging memory that later
        calls reuse), then one case per round timed until commit, recording the time
        ``save()`` blocked on the side."""
        d = self.path("ours_async")
        self._blocked: list[float] = []
        self._async, refused = paths.async_checkpointer(d, self.model, self.opt)
        if self._async is None:
            self.notes.append(f"async save: n/a, `async_save=True` is refused ({refused})")
            for key, label in [
                ("async_first", "(d) ours: async save, first call, blocked"),
                ("async_block", "(d) ours: async save, blocked in save()"),
                ("async_commit", "(d) ours: async save, until committed"),
            ]:
                self.rows[key] = Row(label, None, error="n/a", na=True)
            print(f"  async save: n/a ({refused})")
            return []
        ckpt = self._async
        timeout = 60 + 30 * self.nbytes / 1e9
        steps = iter(range(1, 1_000_000))

        def save_until_committed() -> None:
            step = next(steps)
            start = time.perf_counter()
            ckpt.save(step)
            self._blocked.append(time.perf_counter() - start)
            if not paths.wait_committed(ckpt, step, timeout):
                raise RuntimeError(f"step {step} was not committed within {timeout:.0f} s")

        first = Case("async_first", "(d) ours: async save, first call, blocked",
                     save_until_committed, lambda: paths.clear_steps(d))  # fmt: skip
        first.run_once()
        self.rows["async_first"] = (
            Row(first.label, Measurement(self._blocked[:1], first.peak))
            if first.error is None
            else first.row()
        )
        self._blocked.clear()
        return [
            Case("async_commit", "(d) ours: async save, until committed",
                 save_until_committed, lambda: paths.clear_steps(d))
        ]  # fmt: skip


def run_fsdp(mb: float, width: int, repeats: int, root: Path, timeout: float) -> dict:
    """The 2-rank FSDP2 measurements (``fsdp_worker.py`` under torchrun), as a dict."""
    out = root / "fsdp.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(HERE / "fsdp_worker.py"), "--mb", str(mb), "--width", str(width),
        "--repeats", str(repeats), "--dir", str(root / "fsdp"), "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    print("  2-rank FSDP2 under torchrun ...", flush=True)
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"torchrun did not finish within {timeout:.0f} s"}
    finally:
        shutil.rmtree(root / "fsdp", ignore_errors=True)
    if proc.returncode != 0 or not out.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        return {"error": f"torchrun exited {proc.returncode}: " + " | ".join(tail)}
    return json.loads(out.read_text())


def bench_size(mb: float, width: int, repeats: int, tmp: str, fsdp: bool) -> SizeResult:
    model, opt = build_state(mb, width)
    load: dict[str, float] = {}
    fsdp_result = None
    root = Path(tempfile.mkdtemp(prefix="ub-bench-", dir=tmp))
    try:
        b = Bench(model, opt, root, repeats)
        print(f"\n== state {b.nbytes / 1e9:.3f} GB ({len(b.tensors)} tensors), {repeats} rounds")
        with OtherLoad() as other:
            b.run()
        load["1 process"] = other.cores
        if fsdp:
            with OtherLoad() as other:
                fsdp_result = run_fsdp(
                    mb, width, repeats, root, timeout=300 + 60 * repeats * b.nbytes / 1e9
                )
            load["FSDP2"] = other.cores
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return SizeResult(mb, b.nbytes, len(b.tensors), repeats, b.rows, b.notes, fsdp_result, load)


def measure_sizes(args: argparse.Namespace) -> tuple[list[SizeResult], dict[str, str]]:
    """Every size's figures, and the machine and the code they were measured on."""
    info = machine_info(args.tmpdir)
    package = os.path.dirname(ub.__file__)
    sources = source_digests(package)
    info["unbroken"] = (
        f"{ub.__version__}, revision {git_revision(str(HERE.parent))}, sources "
        f"{combined_digest(sources)}"
    )
    print("machine: " + inline(info))
    results = [
        bench_size(mb, args.width, args.repeats, args.tmpdir, not args.no_fsdp) for mb in args.sizes
    ]
    now = source_digests(package)
    changed = sorted(f for f in sources.keys() | now.keys() if sources.get(f) != now.get(f))
    if changed:
        info["unbroken"] += (
            f" (WARNING: {', '.join(changed)} changed during the run; the FSDP2 workers, "
            "started later, may have run the newer code)"
        )
    return results, info


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=float, nargs="+", default=[300, 1200, 3000],
                        metavar="MB", help="state sizes in MB (default: 300 1200 3000)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=5, help="runs per measurement (>= 5)")
    parser.add_argument("--width", type=int, default=2048, help="Linear layer width")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke test: a {QUICK_MB:g} MB state, 1 run of each")  # fmt: skip
    parser.add_argument("--no-fsdp", action="store_true", help="skip the 2-rank FSDP2 part")
    Report.add_options(parser, SAVE_RESTORE)
    parser.add_argument("--tmpdir", default=tempfile.gettempdir(),
                        help="where the temporary checkpoints go (one disk for all)")  # fmt: skip
    parser.add_argument("--profile", action="store_true",
                        help="instead of the tables, cProfile ours' save and restore")  # fmt: skip
    parser.add_argument("--top", type=int, default=25, help="functions listed by --profile")
    parser.add_argument("--results", metavar="JSON", default=None,
                        help="also write the measured figures and the machine to JSON")  # fmt: skip
    parser.add_argument("--render", metavar="JSON", default=None,
                        help="measure nothing: render the figures --results wrote (with the "
                        "analysis.md of now)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads of the single process (default: torch's; "
                        "FSDP2 ranks always use 1)")  # fmt: skip
    args = parser.parse_args()
    out = Report.from_args(args, SAVE_RESTORE)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.sizes, args.repeats, args.width = [QUICK_MB], 1, QUICK_WIDTH

    started = time.perf_counter()
    if args.profile:
        out.publish(
            "\n\n".join(
                profiling.profile(mb, args.width, args.tmpdir, args.top) for mb in args.sizes
            )
        )
        return
    if args.render:
        results, info, elapsed, command = load_results(Path(args.render))
    else:
        results, info = measure_sizes(args)
        elapsed = time.perf_counter() - started
        command = shown_command("save_restore.py", sys.argv[1:])
        if args.results:
            save_results(Path(args.results), results, info, elapsed, command)
    out.publish(
        save_restore_report.render(results, info, elapsed, markdown=False),
        lambda: save_restore_report.render(results, info, elapsed, markdown=True, command=command),
    )


if __name__ == "__main__":
    main()
