"""The suite's part ``device``: save and restore on one device (a GPU; the CPU for a smoke
test), ours beside its floors and peers in one table (issue 27, item 5), the page
docs/benchmarks-gpu.md.

One process, one state: ``N x nn.Linear(4096, 4096)`` on the device and AdamW (fused on
CUDA) after one step. Measured, each as the median of the runs: the floors (one copy of
the state to the host into pinned and into pageable memory, the write + fsync of its
bytes, their read back with the page cache warm and cold, the copy back to the device
from pinned memory); then every contender of :data:`CONTENDERS` in rounds
(``rounds.py``), restoring into the live objects on the device. Every row shows its ratio
to the floor that applies and to DCP's row of the same kind; the targets of issue 27
follow.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

import common
import contenders
import rounds
from report import Page, Target, bullets, factor, kept, median, median_span, over, size_text, table

PAGE = Page(common.ROOT / "docs" / "benchmarks-gpu.md")
WIDTH, MB, RUNS, QUICK_RUNS = 4096, 3200, 3, 2
# DCP's writer fsyncs each file but not the folders: ours adds that pass, timed in.
CONTENDERS = [
    contenders.Ours, contenders.OursAsync, contenders.OursOverlap,
    contenders.variant(contenders.DcpSave, key="dcp_save", label="DCP: dcp.save (+ fsync pass)",
                       fsyncs=False),
    contenders.variant(contenders.DcpAsync, label="DCP: dcp.async_save (defaults, + fsync pass)",
                       fsyncs=False),
    contenders.TorchSave, contenders.TcSync, contenders.TcAsync,
]  # fmt: skip
SOURCES = {"ours": "ours", "dcp": "dcp_save", "torch": "torch_save", "tc": "tc_async"}

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


# Measuring ------------------------------------------------------------------------------


def floors(tensors: list[torch.Tensor], device: torch.device, folder: Path, runs: int) -> dict:
    """One copy of the state to the host into pinned and into pageable memory (both
    allocated and touched beforehand), the write + fsync of its bytes from host memory,
    their read back into it with the page cache warm and cold, and the copy back to the
    device from pinned memory. Pinned memory needs CUDA: without it those are "n/a"."""
    cuda, na = device.type == "cuda", "n/a (pinned memory needs CUDA)"
    pageable = [torch.zeros(t.shape, dtype=t.dtype) for t in tensors]  # zeros: touched
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors] if cuda else []
    out: dict[str, list[float] | str] = {"pinned_d2h": na, "pinned_h2d": na}
    if cuda:
        out["pinned_d2h"] = common.repeat(
            lambda: contenders.copy_into(pinned, tensors, True), runs, device
        )
    out["pageable_d2h"] = common.repeat(
        lambda: contenders.copy_into(pageable, tensors), runs, device
    )
    host, path = pinned or pageable, folder / "floor.bin"
    out["write_fsync"] = common.repeat(
        lambda: contenders.write_raw(host, path), runs, device, lambda: contenders.clear(path)
    )
    read = lambda: contenders.read_raw(host, path)  # noqa: E731
    out["read_warm"] = common.repeat(read, runs, device, lambda: common.warm_cache([str(path)]))
    out["read_cold"] = common.repeat(
        read, runs, device, lambda: common.drop_page_cache([str(path)])
    )
    if cuda:
        back = [torch.empty_like(t) for t in tensors]
        out["pinned_h2d"] = common.repeat(
            lambda: contenders.copy_into(back, pinned, True), runs, device
        )
    contenders.clear(path)
    return out


def measure(args: argparse.Namespace, log) -> dict:
    """The part's figures, as ``--results`` keeps them (and ``--render`` reads)."""
    device = args.device
    quick_runs = args.repeats or QUICK_RUNS
    (mb, *_), width, runs = common.scale(args, args.sizes or [MB], WIDTH, RUNS, quick_runs)
    model, opt = common.build_state(mb, width, device, bias=True)
    nbytes = common.state_bytes(model, opt)
    fused = "fused " if device.type == "cuda" else ""
    info = {
        **common.machine_info(args.tmpdir, device),
        "torch-checkpointing": contenders.tc_version(),
        "state": f"{common.layer_count(mb, width, True)} x nn.Linear({width}, {width}) + "
        f"{fused}AdamW after one step, {size_text(nbytes)} on {device}",
    }
    log(f"state: {info['state']}; {runs} runs; gpu: {info['gpu']}")

    def restore_once(family: str, path: Path, temp: str) -> dict:
        common.synchronize(device)
        start = time.perf_counter()
        ok = contenders.restore(family, path, model, opt, device)
        common.synchronize(device)
        return {"seconds": time.perf_counter() - start, "verified": ok}

    for family in SOURCES:
        contenders.import_library(family)
    root = Path(tempfile.mkdtemp(prefix="ub-gpu-", dir=args.tmpdir))
    try:
        fig = floors(common.state_tensors(model, opt), device, root, runs)
        log("  floors done")
        found, verified = rounds.run(CONTENDERS, SOURCES, (model, opt), root, runs, device,
                                     restore_once, log, memory=False)  # fmt: skip
        fig.update(found)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"info": info, "figures": fig, "cuda": device.type == "cuda", "nbytes": nbytes,
            "verified": verified, "runs": runs}  # fmt: skip


# Rendering ------------------------------------------------------------------------------


class Run:
    """One run's figures and the floors derived from them (sums of medians)."""

    def __init__(self, data: dict) -> None:
        self.fig, self.cuda, self.nbytes = data["figures"], data["cuda"], data["nbytes"]
        self.verified = data["verified"]
        copy = self.med("pinned_d2h") if self.cuda else self.med("pageable_d2h")
        h2d = self.med("pinned_h2d") if self.cuda else 0.0
        write, warm = self.med("write_fsync"), self.med("read_warm")
        self.floors = {
            "copy": copy,
            "save": copy + write if copy is not None and write is not None else None,
            "warm": warm + h2d if warm is not None and h2d is not None else None,
            "cold": self.med("read_cold"),
        }
        pinned = "pinned" if self.cuda else "host"
        self.floor_names = {
            "copy": f"one {pinned} copy",
            "save": f"{pinned} copy + write + fsync",
            "warm": "warm read + pinned H2D" if self.cuda else "warm read",
            "cold": "cold read",
        }

    def med(self, key: str) -> float | None:
        v = self.fig.get(key)
        return median(v) if isinstance(v, list) else None

    def _cells(self, key: str) -> list[str]:
        v = self.fig.get(key, "not measured")
        if isinstance(v, str):
            return [v, "-"]
        return list(median_span(v, 4)) if v else ["no run", "-"]

    def table(self) -> str:
        rows = [[label, *self._cells(key), "-", "-", "-"] for label, key in FLOOR_ROWS]
        for name, label in (("save", "floor: save"), ("warm", "floor: warm restore")):
            v = self.floors[name]
            rows.append([f"{label}, sum of medians", "-" if v is None else f"{v:.4f}", "-",
                         self.floor_names[name], "-", "-"])  # fmt: skip
        restores = sum(len(v) for k in ("ours_warm", "ours_cold")
                       if isinstance(v := self.fig.get(k), list))  # fmt: skip
        for label, key, floor, dcp in ROWS:
            if key.startswith("ours_") and key.endswith(("_warm", "_cold")):
                label += f" (verified: {self.verified} of {restores} restores)"
            ref = self.floors.get(floor) if floor else None
            vs_dcp = factor(over(self.med(key), self.med(dcp))) if dcp else "-"
            rows.append([label, *self._cells(key), self.floor_names.get(floor or "", "-"),
                         factor(over(self.med(key), ref)), vs_dcp])  # fmt: skip
        return table(["", "median (s)", "min-max (s)", "floor", "x floor", "x DCP"], rows)

    def targets(self) -> list[Target]:
        """Issue 27's targets; ratios of medians."""
        f, gb, names = self.floors, self.nbytes / 1e9, self.floor_names
        out: list[Target] = []

        def add(name: str, v: float | None, limit: float, wanted: str, shown: str = "") -> None:
            out.append(Target(name, v, limit, shown or factor(v), wanted,
                              why_none="a figure is missing"))  # fmt: skip

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
            add(name, over(self.med(key), ref), limit, wanted)
        for key, what in (("first_blocked", "first save"), ("blocked", "later saves")):
            ms = self.med(f"ours_overlap.{key}")
            per_gb = ms * 1000 / gb if ms is not None else None
            shown = "-" if per_gb is None else f"{per_gb:.3f} ms/GB"
            add(f'ours: "overlap" blocked, {what}, per GB', per_gb, 1.0, "<= 1 ms/GB", shown)
        for mode, name in (("ours_async", "async_save=True"), ("ours_overlap", '"overlap"')):
            for peer, who in (("dcp_async", "DCP's async_save"),
                              ("tc_async", "torch-checkpointing's async save")):  # fmt: skip
                add(f"ours: {name} until durable vs {who}",
                    over(self.med(f"{mode}.durable"), self.med(f"{peer}.durable")), 1.0,
                    "ahead (< 1x)")  # fmt: skip
        return out


def render(data: dict, *, markdown: bool = True) -> str:
    """The whole page (in plain text without the hand-written notes on the method)."""
    run = Run(data)
    targets = [[t.name, t.shown, t.wanted, t.status()] for t in run.targets()]
    return "\n".join([
        "# Save and restore on one GPU", "",
        f"Generated by `{data['command']}` in {data['elapsed'] / 60:.1f} minutes (issue 27, "
        "item 5); edit by hand only its hand-written blocks: rerun it on a machine with one "
        "GPU (with a torch older than the package's declared range, `PYTHONPATH=src python "
        "benchmarks/gpu.py`).", "",
        "## Machine", "", *bullets(data["info"]), "",
        f"## Results: one process, one state, median of {data['runs']} runs", "",
        run.table(), "", *([kept("how", PAGE.path), ""] if markdown else []),
        "## Targets (issue 27)", "",
        "Ratios of medians. *missed by X%*: the ratio is X% above its limit.", "",
        table(["target", "measured", "wanted", "status"], targets), "",
    ])  # fmt: skip
