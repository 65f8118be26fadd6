"""Save and restore on one GPU, ours beside its floors and peers, in one table (issue 27,
item 5).

    python benchmarks/gpu.py                   # ~3.2 GB state, median of 3; writes the page
    python benchmarks/gpu.py --gb 1 --runs 5   # another size, more runs
    python benchmarks/gpu.py --quick           # CPU, a tiny state: CI's smoke test
    python benchmarks/gpu.py --write PATH      # put the page at PATH instead

One process, one state: ``N x nn.Linear(4096, 4096)`` on the device and AdamW (fused on
CUDA) after one step. Measured, each as the median of ``--runs``: the floors (one copy of
the state to the host into pinned and into pageable memory, the write + fsync of its
bytes, their read back with the page cache warm and cold, the copy back to the device from
pinned memory); ours (``unbroken.Checkpointer``: sync save, ``async_save=True`` and
``"overlap"``, restore warm and cold); torch DCP (``dcp.save``, ``dcp.async_save``,
``dcp.load`` + ``set_state_dict``); torch-checkpointing (sync and async save, load; its
rows say "not installed" without it); ``torch.save`` / ``torch.load``. Every row shows its
ratio to the floor that applies and to DCP's row of the same kind; the targets of issue 27
follow. A full run on a GPU replaces docs/benchmarks-gpu.md whole (``--write PATH``
writes any run's page to PATH). Never asserts timings.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

import gpu_contenders as gc
import unbroken as ub
from common import combined_digest, machine_info, source_digests, state_bytes, state_tensors
from docs_sections import ROOT, Page
from peers_report import tc_version
from report import Report, bullets, factor, median_span, shown_command, size_text, table
from save_restore_targets import Target

PAGE = Page(ROOT / "docs" / "benchmarks-gpu.md")
WIDTH, QUICK_WIDTH, QUICK_GB = 4096, 256, 0.004

Figures = dict[str, list[float] | str]

# (label, figure, floor, DCP's figure of the same kind). Floors: "copy" one copy of the
# state to the host (pinned on CUDA), "save" copy + write + fsync, "warm" warm read + H2D,
# "cold" the cold read. A figure is "<save>.<blocked|durable|first_blocked|copied>" or
# "<restore family>_<warm|cold>".
ROWS: list[tuple[str, str, str | None, str | None]] = [
    ("ours: save, sync, until durable", "ours.durable", "save", "dcp_save.durable"),
    ("ours: async_save=True, first save, blocked", "ours_async.first_blocked", "copy",
     "dcp_async.first_blocked"),
    ("ours: async_save=True, blocked", "ours_async.blocked", "copy", "dcp_async.blocked"),
    ("ours: async_save=True, until durable", "ours_async.durable", "save", "dcp_async.durable"),
    ('ours: "overlap", first save, blocked', "ours_overlap.first_blocked", "copy",
     "dcp_async.first_blocked"),
    ('ours: "overlap", blocked', "ours_overlap.blocked", "copy", "dcp_async.blocked"),
    ('ours: "overlap", save() until its copy is done', "ours_overlap.copied", "copy", None),
    ('ours: "overlap", until durable', "ours_overlap.durable", "save", "dcp_async.durable"),
    ("ours: restore into the live objects, warm", "ours_warm", "warm", "dcp_warm"),
    ("ours: restore into the live objects, cold", "ours_cold", "cold", "dcp_cold"),
    ("DCP: dcp.save + fsync pass, until durable", "dcp_save.durable", "save", None),
    ("DCP: dcp.async_save (defaults), first save, blocked", "dcp_async.first_blocked", "copy",
     None),
    ("DCP: dcp.async_save (defaults), blocked", "dcp_async.blocked", "copy", None),
    ("DCP: dcp.async_save + fsync pass, until durable", "dcp_async.durable", "save", None),
    ("DCP: dcp.load + set_state_dict, warm", "dcp_warm", "warm", None),
    ("DCP: dcp.load + set_state_dict, cold", "dcp_cold", "cold", None),
    ("torch-checkpointing: sync save + fsync pass, until durable", "tc_sync.durable", "save",
     "dcp_save.durable"),
    ("torch-checkpointing: async save, first save, blocked", "tc_async.first_blocked", "copy",
     "dcp_async.first_blocked"),
    ("torch-checkpointing: async save, blocked", "tc_async.blocked", "copy",
     "dcp_async.blocked"),
    ("torch-checkpointing: async save, save() until its staging copy is done",
     "tc_async.copied", "copy", None),
    ("torch-checkpointing: async save + fsync pass, until durable", "tc_async.durable", "save",
     "dcp_async.durable"),
    ("torch-checkpointing: load + load_state_dict, warm", "tc_warm", "warm", "dcp_warm"),
    ("torch-checkpointing: load + load_state_dict, cold", "tc_cold", "cold", "dcp_cold"),
    ("torch.save + fsync, until durable", "torch_save.durable", "save", "dcp_save.durable"),
    ("torch.load (map_location the device) + load_state_dict, warm", "torch_warm", "warm",
     "dcp_warm"),
    ("torch.load (map_location the device) + load_state_dict, cold", "torch_cold", "cold",
     "dcp_cold"),
]  # fmt: skip
FLOOR_ROWS = [
    ("floor: pinned D2H copy of the state", "pinned_d2h"),
    ("floor: pageable D2H copy (into allocated host memory)", "pageable_d2h"),
    ("floor: write + fsync of the state's bytes", "write_fsync"),
    ("floor: warm read (page cache) into host memory", "read_warm"),
    ("floor: cold read (evicted) into host memory", "read_cold"),
    ("floor: pinned H2D copy of the state", "pinned_h2d"),
]


class Run:
    """One run's figures and the floors derived from them (sums of medians)."""

    def __init__(self, fig: Figures, cuda: bool, nbytes: int, verified: int) -> None:
        self.fig, self.cuda, self.nbytes, self.verified = fig, cuda, nbytes, verified
        copy = self.med("pinned_d2h") if cuda else self.med("pageable_d2h")
        h2d = self.med("pinned_h2d") if cuda else 0.0
        write, warm, cold = self.med("write_fsync"), self.med("read_warm"), self.med("read_cold")
        self.floors = {
            "copy": copy,
            "save": copy + write if copy is not None and write is not None else None,
            "warm": warm + h2d if warm is not None and h2d is not None else None,
            "cold": cold,
        }
        pinned = "pinned" if cuda else "host"
        self.floor_names = {
            "copy": f"one {pinned} copy",
            "save": f"{pinned} copy + write + fsync",
            "warm": "warm read + pinned H2D" if cuda else "warm read",
            "cold": "cold read",
        }

    def med(self, key: str) -> float | None:
        v = self.fig.get(key)
        return statistics.median(v) if isinstance(v, list) and v else None

    def over(self, key: str, ref: float | None) -> float | None:
        v = self.med(key)
        return v / ref if v is not None and ref else None

    def table(self) -> str:
        rows = []
        for label, key in FLOOR_ROWS:
            rows.append([label, *self._cells(key), "-", "-", "-"])
        for name, label in (("save", "floor: save"), ("warm", "floor: warm restore")):
            v = self.floors[name]
            rows.append([f"{label}, sum of medians", "-" if v is None else f"{v:.4f}", "-",
                         self.floor_names[name], "-", "-"])  # fmt: skip
        for label, key, floor, dcp in ROWS:
            if key.startswith("ours_") and key.endswith(("_warm", "_cold")):
                label += f" (verified: {self.verified} of {self._restores()} restores)"
            ref = self.floors.get(floor) if floor else None
            vs_dcp = factor(self.over(key, self.med(dcp))) if dcp else "-"
            rows.append([label, *self._cells(key), self.floor_names.get(floor or "", "-"),
                         factor(self.over(key, ref)), vs_dcp])  # fmt: skip
        return table(["", "median (s)", "min-max (s)", "floor", "x floor", "x DCP"], rows)

    def _restores(self) -> int:
        return sum(len(v) for k in ("ours_warm", "ours_cold") if isinstance(v := self.fig.get(k),
                                                                            list))  # fmt: skip

    def _cells(self, key: str) -> list[str]:
        v = self.fig.get(key, "not measured")
        if isinstance(v, str):
            return [v, "-"]
        if not v:
            return ["no run", "-"]
        return list(median_span(v, 4))

    def targets(self) -> list[Target]:
        """Issue 27's targets; ratios of medians."""
        f, gb = self.floors, self.nbytes / 1e9
        out: list[Target] = []

        def add(name: str, v: float | None, limit: float, wanted: str, shown: str = "") -> None:
            out.append(Target(name, v, limit, shown or factor(v), wanted,
                              why_none="a figure is missing"))  # fmt: skip

        names = self.floor_names
        for name, key, ref, limit, wanted in [
            (f"ours: sync save until durable vs its floor ({names['save']})", "ours.durable",
             f["save"], 1.10, "<= 1.10x"),
            ("ours: sync save until durable vs DCP save (+ fsync)", "ours.durable",
             self.med("dcp_save.durable"), 1.0, "ahead (< 1x)"),
            (f"ours: restore warm vs its floor ({names['warm']})", "ours_warm", f["warm"], 1.3,
             "<= 1.30x"),
            ("ours: restore cold vs the disk read floor (cold read)", "ours_cold", f["cold"],
             1.15, "<= 1.15x"),
            ("ours: restore warm vs torch-checkpointing's", "ours_warm", self.med("tc_warm"),
             1.0, "ahead (< 1x)"),
            ("ours: restore cold vs torch-checkpointing's", "ours_cold", self.med("tc_cold"),
             1.0, "ahead (< 1x)"),
            (f"ours: async_save=True blocked vs {names['copy']}", "ours_async.blocked",
             f["copy"], 0.05, "<= 0.05x"),
        ]:  # fmt: skip
            add(name, self.over(key, ref), limit, wanted)
        for key, what in (("first_blocked", "first save"), ("blocked", "later saves")):
            ms = self.med(f"ours_overlap.{key}")
            per_gb = ms * 1000 / gb if ms is not None else None
            shown = "-" if per_gb is None else f"{per_gb:.3f} ms/GB"
            add(f'ours: "overlap" blocked, {what}, per GB', per_gb, 1.0, "<= 1 ms/GB", shown)
        for mode, name in (("ours_async", "async_save=True"), ("ours_overlap", '"overlap"')):
            for peer, who in (("dcp_async", "DCP's async_save"),
                              ("tc_async", "torch-checkpointing's async save")):  # fmt: skip
                add(f"ours: {name} until durable vs {who}",
                    self.over(f"{mode}.durable", self.med(f"{peer}.durable")), 1.0,
                    "ahead (< 1x)")  # fmt: skip
        return out

    def targets_table(self) -> str:
        rows = [[t.name, t.shown, t.wanted, t.status()] for t in self.targets()]
        return table(["target", "measured", "wanted", "status"], rows)


def revision() -> str:
    """``git rev-parse --short HEAD``, ``+dirty`` if the working tree has changes (or
    ``UNBROKEN_REVISION`` where the tree was copied without its git folder)."""
    if os.environ.get("UNBROKEN_REVISION"):
        return os.environ["UNBROKEN_REVISION"]

    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip

    try:
        rev = git("rev-parse", "--short", "HEAD")
        return rev + ("+dirty" if git("status", "--porcelain") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def gpu_info(device: torch.device) -> dict[str, str]:
    if device.type != "cuda":
        return {"gpu": "none: this run used the CPU"}
    name, driver = torch.cuda.get_device_name(device), "unknown"
    try:
        lines = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=True, timeout=30,
        ).stdout.strip().splitlines()  # fmt: skip
        name, driver = (x.strip() for x in lines[device.index or 0].split(",", 1))
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        pass
    return {"gpu": name, "driver": driver, "cuda": str(torch.version.cuda)}


def describe(args: argparse.Namespace, device: torch.device, layers: int, width: int,
             nbytes: int) -> dict[str, str]:  # fmt: skip
    base = machine_info(args.tmpdir)
    info = {"date": base.pop("date"), **gpu_info(device), **base}
    digest = combined_digest(source_digests(str(ROOT / "src" / "unbroken")))
    info["unbroken"] = f"{ub.__version__}, revision {revision()}, sources {digest}"
    info["torch-checkpointing"] = tc_version()
    fused = "fused " if device.type == "cuda" else ""
    info["state"] = (f"{layers} x nn.Linear({width}, {width}) + {fused}AdamW after one step, "
                     f"{size_text(nbytes)} on {device}")  # fmt: skip
    return info


HOW = """\
How each row is measured. Every row is the median of the runs, the device synchronized
before every timed region and after it (except after *blocked*: a synchronize there
would wait for a copy that runs behind training). *blocked*: the call the training loop
waits for (`save()`, `dcp.async_save`, torch-checkpointing's `save`). *until durable*: from
that call until the checkpoint is on disk: ours, `save()` returns (sync) or `save()` +
`wait()` (committed: files and folders fsync'd); DCP, its writer fsyncs each file, plus an
fsync pass of ours over its files and folders, timed in; torch-checkpointing, its future's
result plus that fsync pass (it never fsyncs); `torch.save`, plus an fsync of the file.
*first save*: each contender's first save (staging buffers allocated, writers started);
the other save rows are later saves, each into a folder emptied beforehand (untimed).
*save() until its copy is done* (ours, "overlap") and *until its staging copy is done*
(torch-checkpointing, whose async `save()` returns while its copy runs): that copy runs
behind the next forward and backward, and the state must not change before it ends (our
"overlap" makes the next optimizer step wait for it); a step waits only for what they do
not hide (no training step runs here). Restores go into the existing model and
optimizer on the device; ours verifies every restored tensor against its fingerprint
(the count is in the row). *warm*: every file of the checkpoint read once just before;
*cold*: every file fsync'd, then evicted from the page cache with
`posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED)` (no root needed). Floors: copies into host
memory allocated and touched beforehand; the write + fsync and the reads are of one file of
the state's bytes, in the same temporary folder as the checkpoints. *x floor*: the row's
median over the floor named (sums of medians); *x DCP*: over DCP's row of the same kind.
Pinned memory needs CUDA: without it, the pinned rows are n/a and the copy floor is the
copy into allocated host memory."""


def render(run: Run, info: dict[str, str], command: str, elapsed: float, runs: int) -> str:
    return "\n".join([
        "# Save and restore on one GPU", "",
        f"Generated by `{command}` in {elapsed / 60:.1f} minutes (issue 27, item 5); do not "
        "edit by hand: rerun it on a machine with one GPU (with a torch older than the "
        "package's declared range, `PYTHONPATH=src python benchmarks/gpu.py`).", "",
        "## Machine", "", *bullets(info), "",
        f"## Results: one process, one state, median of {runs} runs", "",
        run.table(), "", HOW, "",
        "## Targets (issue 27)", "",
        "Ratios of medians. *missed by X%*: the ratio is X% above its limit.", "",
        run.targets_table(), "",
    ])  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gb", type=float, default=3.2, help="state size in GB (default 3.2)")
    parser.add_argument("--runs", type=int, default=None, help="runs per row (default 3)")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke test: {QUICK_GB * 1000:g} MB on the CPU, 2 runs")  # fmt: skip
    parser.add_argument("--device", default=None,
                        help="default: cuda if available (cpu with --quick)")  # fmt: skip
    parser.add_argument("--tmpdir", default=tempfile.gettempdir(),
                        help="where the checkpoints and the floors' file go (one disk)")  # fmt: skip
    parser.add_argument("--write", default=None, metavar="PATH",
                        help=f"write the page to PATH (default: {PAGE.path} after a full run "
                        "on a GPU; nothing otherwise)")  # fmt: skip
    parser.add_argument("--results", default=None, metavar="PATH",
                        help="also write the raw figures as JSON to PATH")  # fmt: skip
    args = parser.parse_args()
    # DCP without a process group says so, also from its async writer's thread.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    runs = args.runs or (2 if args.quick else 3)
    width, gb = (QUICK_WIDTH, QUICK_GB) if args.quick else (WIDTH, args.gb)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.quick
                                          else "cpu"))  # fmt: skip
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    page = Path(args.write) if args.write else None
    if page is None and device.type == "cuda" and not args.quick:
        page = PAGE.path

    started = time.perf_counter()
    layers = max(1, round(gb * 1e9 / ((width * width + width) * 4 * 3)))
    model, opt = gc.build(layers, width, device)
    nbytes = state_bytes(model, opt)
    info = describe(args, device, layers, width, nbytes)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    log(f"state: {info['state']}; {runs} runs; gpu: {info['gpu']}")
    root = Path(tempfile.mkdtemp(prefix="ub-gpu-", dir=args.tmpdir))
    try:
        fig: Figures = dict(gc.floors(state_tensors(model, opt), device, root, runs))
        log("  floors done")
        saves, kept = gc.save_runs(gc.SAVES, model, opt, root, device, runs, log)
        for key, row in saves.items():
            for field in ("first_blocked", "blocked", "durable", "copied"):
                fig[f"{key}.{field}"] = row if isinstance(row, str) else row[field]
        restores, verified = gc.restore_runs(kept, model, opt, device, runs, log)
        fig.update(restores)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    log(f"  measured in {time.perf_counter() - started:.0f} s")
    run = Run(fig, device.type == "cuda", nbytes, verified)
    command = shown_command("gpu.py", sys.argv[1:])
    elapsed = time.perf_counter() - started
    md = render(run, info, command, elapsed, runs)
    if args.results:
        Path(args.results).write_text(json.dumps({
            "info": info, "figures": fig, "cuda": run.cuda, "nbytes": nbytes,
            "verified": verified, "command": command, "elapsed": elapsed, "runs": runs,
        }, indent=1))  # fmt: skip
    out = Report(PAGE if page else None, write_docs=page)
    out.publish(md, lambda: md)


if __name__ == "__main__":
    main()
