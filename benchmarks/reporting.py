"""Tables, targets and the markdown report of ``save_restore.py``."""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any

from common import Measurement, table
from docs_sections import ANALYSIS, analysis_headings, why_missed


@dataclasses.dataclass
class Row:
    """One measured path: its label and measurement, or why there is none."""

    label: str
    m: Measurement | None
    error: str | None = None
    na: bool = False  # not applicable (a feature not available), not a failure


@dataclasses.dataclass
class SizeResult:
    mb: float
    nbytes: int
    ntensors: int
    repeats: int
    rows: dict[str, Row]
    notes: list[str]
    fsdp: dict[str, Any] | None  # fsdp_worker.py's JSON, or {"error": ...}, or None
    load: dict[str, float]  # phase -> cores other processes kept busy meanwhile


def save_results(
    path: Path, results: list[SizeResult], info: dict[str, str], elapsed: float, command: str
) -> None:
    """Write a run's figures, so that ``load_results`` can render them again."""
    body = {
        "info": info,
        "elapsed": elapsed,
        "command": command,
        "results": [dataclasses.asdict(r) for r in results],
    }
    path.write_text(json.dumps(body, indent=1))


def load_results(path: Path) -> tuple[list[SizeResult], dict[str, str], float, str]:
    """What ``save_results`` wrote: (results, machine, seconds, command)."""
    body = json.loads(path.read_text())
    results = []
    for r in body["results"]:
        rows = {
            key: Row(
                row["label"],
                Measurement(**row["m"]) if row["m"] is not None else None,
                row["error"],
                row["na"],
            )
            for key, row in r.pop("rows").items()
        }
        results.append(SizeResult(rows=rows, **r))
    return results, body["info"], body["elapsed"], body["command"]


SAVE_ROWS = [
    "floor_write", "torch_save", "dcp_save_1", "dcp_save_2", "ours_save",
    "async_first", "async_block", "async_commit",
]  # fmt: skip
RESTORE_ROWS = [
    "floor_read", "floor_read_new", "torch_load", "dcp_load", "dcp_load_fresh",
    "ours_restore_fresh", "ours_restore",
]  # fmt: skip
OTHER_ROWS = ["copy", "clone", "fingerprints", "checksums"]
# The reference rows of the ratio columns: (a) disk floor, (b) torch, (c) raw DCP.
SAVE_REFS = ("floor_write", "torch_save", "dcp_save")
RESTORE_REFS = ("floor_read", "torch_load", "dcp_load")
FRESH_ROWS = {"dcp_load_fresh", "ours_restore_fresh"}  # compared with DCP into fresh objects

# The single-process row each 2-rank FSDP2 case is compared with.
FSDP_PEERS = {
    "ours save": "ours_save",
    "ours restore, fresh objects": "ours_restore_fresh",
    "ours restore, existing objects": "ours_restore",
    "raw DCP save (thread_count=1)": "dcp_save_1",
    "raw DCP load, existing objects": "dcp_load",
    "cold read into new tensors": "floor_read_new",
}
FSDP_FLOOR = "cold read into new tensors"  # each rank's shard files, read into new memory
OURS_FSDP = ["ours save", "ours restore, fresh objects", "ours restore, existing objects"]


def _secs(m: Measurement) -> tuple[str, str]:
    return f"{m.median:.3f}", f"{m.low:.3f}-{m.high:.3f}"


def _mb(n: int) -> str:
    return f"{n / 1e6:,.0f} MB"


def size_text(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _mem(n: int, of: int) -> str:
    return f"{_mb(n)} ({n / of:.0%})"


def _median(r: SizeResult, key: str) -> float | None:
    row = r.rows.get(key)
    return row.m.median if row is not None and row.m is not None else None


def _ratio(value: float | None, ref: float | None) -> str:
    return f"{value / ref:.2f}x" if value is not None and ref else "-"


def _row_cells(r: SizeResult, key: str, refs: tuple[str, ...]) -> list[str]:
    row = r.rows.get(key)
    if row is None:
        return []
    if row.m is None:
        return [row.label, row.error or "failed", "", "", "", "", "", ""]
    med, span = _secs(row.m)
    ratios = [_ratio(row.m.median, _median(r, ref)) for ref in refs]
    return [
        row.label, med, span, f"{r.nbytes / 1e9 / row.m.median:.2f}", *ratios,
        _mem(row.m.peak_extra, r.nbytes),
    ]  # fmt: skip


HEADERS = ["what", "median s", "min-max s", "GB/s", "x (a)", "x (b)", "x (c)", "peak extra RSS"]


def size_tables(r: SizeResult) -> str:
    save = [_row_cells(r, k, SAVE_REFS) for k in SAVE_ROWS]
    restore = []
    for k in RESTORE_ROWS:
        refs = (*RESTORE_REFS[:2], "dcp_load_fresh" if k in FRESH_ROWS else "dcp_load")
        restore.append(_row_cells(r, k, refs))
    other = [_row_cells(r, k, ("copy", "ours_save", "ours_restore_fresh")) for k in OTHER_ROWS]
    parts = [
        "Save (x (a): the write + fsync floor; x (b): torch.save; x (c): raw DCP, best "
        "thread_count):",
        "",
        table(HEADERS, [c for c in save if c]),
        "",
        "Restore, cold page cache (x (a): cold read into existing tensors; x (b): torch.load; "
        "x (c): raw DCP load into the same kind of objects):",
        "",
        table(HEADERS, [c for c in restore if c]),
        "",
        "Copies and verification (here x (a): one copy into preallocated memory; x (b): "
        "ours' save; x (c): ours' restore into fresh objects):",
        "",
        table(HEADERS, [c for c in other if c]),
    ]
    fp, xx = _median(r, "fingerprints"), _median(r, "checksums")
    save_s, restore_s = _median(r, "ours_save"), _median(r, "ours_restore_fresh")
    if fp is not None and xx is not None and save_s and restore_s:
        parts += [
            "",
            f"Verification share: fingerprints + xxh3-128 checksums of every tensor take "
            f"{fp + xx:.3f} s, {(fp + xx) / save_s:.0%} of ours' save and "
            f"{(fp + xx) / restore_s:.0%} of ours' restore into fresh objects (a save computes "
            "both once per tensor, a restore checks every checksum and compares values; the "
            "profile, `--profile`, shows what the current code spends).",
        ]
    if r.fsdp is not None:
        parts += ["", fsdp_table(r)]
    for note in r.notes:
        parts += ["", f"Note: {note}"]
    return "\n".join(parts)


def fsdp_table(r: SizeResult) -> str:
    f = r.fsdp or {}
    if "error" in f:
        return f"2-rank FSDP2: failed: {f['error']}"
    shard = f["shard_bytes"]
    rows = []
    for name, case in f["cases"].items():
        if case["error"] is not None or not case["times"]:
            rows.append([name, case["error"] or "failed", "", "", "", "", ""])
            continue
        m = Measurement(case["times"], 0)
        med, span = _secs(m)
        peer = _median(r, FSDP_PEERS.get(name, ""))
        floor = _fsdp_median(f, FSDP_FLOOR) if "restore" in name or name == FSDP_FLOOR else None
        peaks = case["peak_extra"]
        rows.append([
            name, med, span, f"{r.nbytes / 1e9 / m.median:.2f}", _ratio(m.median, peer),
            _ratio(m.median, floor) if floor else "",
            _mem(peaks[0], shard[0]), _mem(peaks[1], shard[1]) if len(peaks) > 1 else "-",
        ])  # fmt: skip
    headers = ["what", "median s", "min-max s", "GB/s", "x 1 process", "x 2-rank read",
               "rank 0 peak extra RSS (% of its shard)", "rank 1"]  # fmt: skip
    return "\n".join(
        [
            f"2-rank FSDP2 (torchrun, gloo, fully_shard per layer and root; the same "
            f"{size_text(r.nbytes)} in total, shards of {' + '.join(_mb(s) for s in shard)}; "
            "x 1 process: over the same path in one process; x 2-rank read: over each rank "
            "reading its own shard files, cold, into new tensors, in the same run):",
            "",
            table(headers, rows),
        ]
    )


@dataclasses.dataclass
class Target:
    name: str
    value: float | None  # None: not measured
    limit: float
    shown: str  # the measured value as read by a person
    wanted: str
    higher_is_better: bool = False
    why_none: str = "not measured"
    topic: str = ""  # the heading of analysis.md that says why it is missed (TOPICS)
    evidence: str = ""  # the two measurements behind the ratio, with their spreads

    def status(self) -> str:
        if self.value is None:
            return f"n/a ({self.why_none})"
        if self.higher_is_better:
            if self.value >= self.limit:
                return "met"
            return f"missed by {self.limit / self.value - 1:.0%}"
        if self.value <= self.limit:
            return "met"
        return f"missed by {self.value / self.limit - 1:.0%}"


# Why a target is missed is written by hand in analysis.md, one heading per topic; the
# report names the heading beside every miss, or says that no analysis exists yet.
TOPICS = {
    "save": "Saves against raw DCP and the disk floor",
    "save-memory": "Peak memory of a synchronous save",
    "restore-small": "Restore into fresh objects against the floor",
    "restore-existing": "Restore into existing objects against raw DCP",
    "fsdp-save": "2-rank FSDP2 save against one process",
    "fsdp-restore": "2-rank FSDP2 restores against one process and the ranks' floor",
    "fsdp-memory": "Rank 0's peak memory in 2-rank FSDP2",
}


def _spread(label: str, times: list[float] | None) -> str:
    if not times:
        return f"{label} -"
    return f"{label} {statistics.median(times):.3f} s ({min(times):.3f}-{max(times):.3f})"


def evidence(ours: list[float] | None, ref: list[float] | None, ref_label: str) -> str:
    """Both sides of a ratio, median (min-max), and whether their ranges overlap: where
    they do, this run alone cannot tell the two apart."""
    text = f"{_spread('ours', ours)} against {_spread(ref_label, ref)}"
    if ours and ref:
        overlap = min(ours) <= max(ref) and min(ref) <= max(ours)
        text += "; the ranges overlap" if overlap else "; the ranges do not overlap"
    return text


def _times(r: SizeResult, key: str) -> list[float] | None:
    row = r.rows.get(key)
    return row.m.times if row is not None and row.m is not None else None


def _over(r: SizeResult, key: str, ref: str) -> float | None:
    a, b = _median(r, key), _median(r, ref)
    return a / b if a is not None and b else None


def _x(v: float | None, suffix: str = "x") -> str:
    return "-" if v is None else f"{v:.2f}{suffix}"


def _over_min(r: SizeResult, key: str, ref: str) -> float | None:
    a, b = r.rows.get(key), r.rows.get(ref)
    if a is None or b is None or a.m is None or b.m is None or not b.m.low:
        return None
    return a.m.low / b.m.low


def targets(r: SizeResult) -> list[Target]:
    """The targets of issue 15 for one state size (ratios of medians, and of minimums
    where the issue asks for both)."""
    out: list[Target] = []

    def ratio_target(
        name: str, key: str, ref: str, limit: float, topic: str, both: bool = False
    ) -> None:
        v = _over(r, key, ref)
        label = r.rows[ref].label if ref in r.rows else ref
        seen = evidence(_times(r, key), _times(r, ref), label)
        out.append(Target(name, v, limit, _x(v), f"<= {limit:.2f}x", topic=topic,
                          evidence=seen))  # fmt: skip
        if both:
            low = _over_min(r, key, ref)
            out.append(Target(f"{name} (minimums)", low, limit, _x(low), f"<= {limit:.2f}x",
                              topic=topic, evidence=seen))  # fmt: skip

    ratio_target("save (verified) vs raw DCP save (best thread_count)", "ours_save", "dcp_save",
                 1.05, "save", both=True)  # fmt: skip
    ratio_target("save (verified) vs the write + fsync floor", "ours_save", "floor_write", 1.15,
                 "save", both=True)  # fmt: skip
    ratio_target("restore (verified), fresh objects, vs cold read into new tensors",
                 "ours_restore_fresh", "floor_read_new", 1.05, "restore-small")  # fmt: skip
    ratio_target("restore (verified), existing objects, vs raw DCP load into them",
                 "ours_restore", "dcp_load", 1.10, "restore-existing")  # fmt: skip
    save = r.rows.get("ours_save")
    peak = save.m.peak_extra / r.nbytes if save is not None and save.m is not None else None
    out.append(Target("peak extra memory during a synchronous save", peak, 0.10,
                      "-" if peak is None else f"{peak:.1%} of the state", "<= 10%",
                      topic="save-memory"))  # fmt: skip
    out += fsdp_targets(r)
    return out


LINEAR_ROWS = [
    ("floor_write", "(a) write + fsync floor"),
    ("dcp_save", "(c) raw DCP save, best thread_count"),
    ("ours_save", "(d) ours: save (sync, verified)"),
    ("floor_read_new", "(a) cold read into new tensors"),
    ("dcp_load", "(c) raw DCP load, existing objects"),
    ("ours_restore_fresh", "(d) ours: restore, fresh objects"),
    ("ours_restore", "(d) ours: restore, existing objects"),
]


def linearity_table(results: list[SizeResult]) -> str:
    """Seconds per GB of each path at every size measured (median; min in brackets), and
    the largest size's figure over the smallest's: 1.00x is perfectly linear."""
    if len(results) < 2:
        return ""
    ordered = sorted(results, key=lambda r: r.nbytes)
    headers = ["s per GB", *[size_text(r.nbytes) for r in ordered], "largest / smallest"]
    rows = []
    for key, label in LINEAR_ROWS:
        cells, per = [label], []
        for r in ordered:
            row = r.rows.get(key)
            if row is None or row.m is None:
                cells.append("-")
                per.append(None)
                continue
            gb = r.nbytes / 1e9
            per.append(row.m.median / gb)
            cells.append(f"{row.m.median / gb:.3f} ({row.m.low / gb:.3f})")
        cells.append(_x(per[-1] / per[0]) if per[0] and per[-1] else "-")
        rows.append(cells)
    return "\n".join(
        [
            "Cost per GB across state sizes (issue 15, item 5; median s/GB, min in brackets):",
            "",
            table(headers, rows),
        ]
    )


def _fsdp_times(f: dict[str, Any], name: str) -> list[float] | None:
    case = f.get("cases", {}).get(name)
    return case["times"] if case is not None and case["error"] is None else None


def _fsdp_median(f: dict[str, Any], name: str) -> float | None:
    times = _fsdp_times(f, name)
    return statistics.median(times) if times else None


def fsdp_targets(r: SizeResult) -> list[Target]:
    if r.fsdp is None:
        return []
    f = r.fsdp
    out: list[Target] = []
    why = f.get("error", "")
    for name in OURS_FSDP:
        case = f.get("cases", {}).get(name)
        ours, single = _fsdp_median(f, name), _median(r, FSDP_PEERS[name])
        v = ours / single if ours and single else None
        if ours is None and case is not None:
            why = case["error"] or "failed"
        seen = evidence(_fsdp_times(f, name), _times(r, FSDP_PEERS[name]), "1 process")
        topic = "fsdp-save" if name == "ours save" else "fsdp-restore"
        out.append(Target(f"2-rank FSDP2 {name.removeprefix('ours ')} vs 1 process", v, 1.2,
                          _x(v), "<= 1.2x", why_none=why, topic=topic,
                          evidence=seen))  # fmt: skip
    fresh, floor = _fsdp_median(f, OURS_FSDP[1]), _fsdp_median(f, FSDP_FLOOR)
    v = fresh / floor if fresh and floor else None
    seen = evidence(_fsdp_times(f, OURS_FSDP[1]), _fsdp_times(f, FSDP_FLOOR), "the ranks' read")
    out.append(Target("2-rank FSDP2 restore, fresh objects, vs the ranks' cold read into new "
                      "tensors", v, 1.05, _x(v), "<= 1.05x", why_none=why,
                      topic="fsdp-restore", evidence=seen))  # fmt: skip
    # Issue 5: "rank 0 holds no more than its own shard". A save holds none of it; a
    # restore holds the loaded shard itself (a fresh optimizer has no state to read into,
    # and a model's loaded shard is its undo), so 1x is its floor; the allocator and the
    # Python objects add a few MB: 5% of slack. A gather would be >= 2x.
    cases = f.get("cases", {})
    for what, names, limit in [("save", OURS_FSDP[:1], 1.0), ("restores", OURS_FSDP[1:], 1.05)]:
        peaks = [cases[n]["peak_extra"][0] for n in names if n in cases and cases[n]["times"]]
        v = max(peaks) / f["shard_bytes"][0] if peaks else None
        out.append(Target(f"2-rank FSDP2: rank 0's peak extra RSS in ours' {what} vs its shard",
                          v, limit, _x(v, "x its shard"),
                          f"<= {limit:g}x (a gather: >= 2x)", why_none=why,
                          topic="fsdp-memory"))  # fmt: skip
    return out


def targets_table(results: list[SizeResult]) -> str:
    rows = [
        [size_text(r.nbytes), t.name, t.shown, t.wanted, t.status()]
        for r in results
        for t in targets(r)
    ]
    return table(["state", "target", "measured", "wanted", "status"], rows)


def misses(results: list[SizeResult], headings: set[str]) -> str:
    """Every target missed in this run: by how much, both measurements with their spread,
    and the heading of the analysis that says why (or that none does yet)."""
    lines = []
    for r in results:
        for t in targets(r):
            status = t.status()
            if not status.startswith("missed"):
                continue
            seen = f" {t.evidence[:1].upper()}{t.evidence[1:]}." if t.evidence else ""
            lines.append(
                f"- {size_text(r.nbytes)}, {t.name}: {t.shown}, wanted {t.wanted} ({status})."
                f"{seen} {why_missed(TOPICS[t.topic], headings)}"
            )
    if not lines:
        return "Every target was met in this run."
    return "\n".join(["Missed in this run, each with the analysis that explains it:", "", *lines])


METHOD = """\
## How it is measured

- One process builds the state (`common.build_state`: `nn.Linear(2048, 2048, bias=False)`
  layers and AdamW after one step: weights, `exp_avg`, `exp_avg_sq`), then measures every
  path in the same run, on the same disk (one temp folder under `--tmpdir`, removed at the
  end). Each number is the median of the runs, with min-max. Timings are wall-clock
  seconds of the call alone; untimed set-up before each run removes the previous output
  and `sync`s.
- The cases run round-robin: each round runs every case once, saves first, then cold
  restores of what that round saved, then the copies, each group rotated by one place per
  round; so load from other processes, and what one case leaves behind for the next (a
  disk still absorbing the previous write), fall on all paths alike. The CPU time other
  processes used meanwhile is under Machine.
- *Cold* reads: before each run the files are fsynced and evicted from the page cache
  (`posix_fadvise(DONTNEED)`).
- (a) floor: the state's raw bytes written to one file with plain writes + `fsync`, and
  read back with `readinto` into existing tensors (and into new ones, which pays the
  first touch of every page: the floor of a restore into fresh objects, measured like
  those right after fresh objects are built).
- (b) `torch.save({"model": ..., "optimizer": ...})` + `fsync`, and `torch.load` +
  `load_state_dict` into the existing objects.
- (c) raw DCP: `get_state_dict` -> `dcp.save(FileSystemWriter(thread_count=1 or 2))`;
  load: `get_state_dict` templates -> `dcp.load` -> `set_state_dict`, into the existing
  objects, or into fresh ones (where `get_state_dict` first creates the optimizer state
  with a zero-gradient step).
- (d) ours: `Checkpointer(...).save(step)`; `restore()` by a new `Checkpointer`, into
  fresh objects (a new model and an AdamW without state, as a resumed process has) or into
  the existing ones, both verifying as the library does. Async: the first `save()`,
  then the median of the later ones (staging memory reused), each timed until it returns
  (training blocked) and until its step is committed.
- Peak extra RSS: `/proc/self/statm` sampled every 2 ms by a thread, peak minus the level
  at the start of the run (the allocator's free memory is trimmed first); the largest
  over the runs. Restores into fresh objects include allocating the optimizer state.
- 2-rank FSDP2: `fsdp_worker.py` under `torch.distributed.run --nproc_per_node 2`, gloo,
  `init_device_mesh("cpu", (2,))`, `fully_shard` per layer and at the root, one thread per
  rank; times between barriers on rank 0, peak extra RSS per rank. The 2-rank floor:
  each rank reads the files of its own shard that ours saved that round, cold, with plain
  `readinto` into new tensors of 16 MiB (`paths.read_files_new`), right after building
  fresh objects as the restore into fresh objects does.
- Verification share: `unbroken.format.fingerprint.fingerprint` and xxh3-128 over every tensor
  once (the logic of `verification_cost.py`).
- Caveats: on a shared machine, other processes' CPU use slows the CPU-heavy paths
  (checksums, fingerprints, torch.save's CRC32) and torch ops run with 2 intra-op threads
  most of all; on a virtual disk, a write can be several times slower when it lands on
  blocks never written before (thin provisioning). Min-max shows the spread.
- The scripts print tables and never assert timings; `--quick` is a smoke test;
  `--profile` prints where ours spends its time (cProfile, calling thread and the threads
  the call starts).
"""


def _load_line(results: list[SizeResult]) -> str:
    parts = [
        f"{size_text(r.nbytes)} {phase} {cores:.2f}"
        for r in results
        for phase, cores in r.load.items()
    ]
    return "; ".join(parts) or "not measured"


def render(
    results: list[SizeResult],
    info: dict[str, str],
    elapsed: float,
    *,
    markdown: bool,
    command: str = "",
) -> str:
    """The whole report; ``markdown`` adds the title, the machine and the method."""
    parts: list[str] = []
    load = _load_line(results)
    if markdown:
        how = f"`{command}`" + (" (`make bench`)" if command.endswith(" --write-docs") else "")
        parts += [
            "# Benchmarks: save and restore",
            "",
            f"Generated by {how} in {elapsed / 60:.1f} minutes; do not edit by hand. The "
            "library is being optimized, so these are the numbers of the code at the revision "
            "below; rerun `make bench` to refresh them.",
            "",
            "## Machine",
            "",
            *[f"- {k}: {v}" for k, v in info.items()],
            f"- other processes' CPU use meanwhile (average busy cores, of "
            f"{info.get('cpu', '?').split(' ', 1)[0]}): {load}",
            "",
            "## Where we stand (issue 15 targets)",
            "",
            "Ratios are of medians. *missed by X%*: the ratio is X% above its limit (for "
            "*>=* targets: X% short of it).",
            "",
        ]
    else:
        parts += ["Targets (issue 15):", ""]
    parts += [targets_table(results), ""]
    parts += [misses(results, analysis_headings()), ""]
    linear = linearity_table(results)
    if linear:
        parts += [linear, ""]
    if markdown and ANALYSIS.is_file():
        parts += [ANALYSIS.read_text(encoding="utf-8").rstrip(), ""]
    for r in results:
        title = (
            f"State of {size_text(r.nbytes)} ({r.ntensors} tensors), median of "
            f"{r.repeats} run{'s' if r.repeats > 1 else ''}"
        )
        parts += [f"## {title}" if markdown else f"== {title}", "", size_tables(r), ""]
    if markdown:
        parts += [METHOD]
    else:
        parts += [f"other processes' CPU use meanwhile (busy cores): {load}"]
        parts += [f"total {elapsed:.0f} s"]
    return "\n".join(parts).rstrip() + "\n"
