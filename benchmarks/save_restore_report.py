"""The report of ``save_restore.py``: in plain text for stdout, or as the markdown page
above the other benchmarks' sections of docs/benchmarks.md: the targets and their misses,
the hand-written analysis, per state size the tables of save, restore, copies and 2-rank
FSDP2 (seconds, GB/s, ratios against three references, peak extra memory), the cost per
GB across sizes, and how it is measured."""

from __future__ import annotations

from common import Measurement
from docs_sections import ANALYSIS, analysis_headings
from report import bullets, factor, median_span, ratio, size_text, table
from save_restore_figures import FSDP_FLOOR, FSDP_PEERS, SizeResult, fsdp_median
from save_restore_targets import misses, targets_table

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

HEADERS = ["what", "median s", "min-max s", "GB/s", "x (a)", "x (b)", "x (c)", "peak extra RSS"]
FSDP_HEADERS = ["what", "median s", "min-max s", "GB/s", "x 1 process", "x 2-rank read",
                "rank 0 peak extra RSS (% of its shard)", "rank 1"]  # fmt: skip


def _mb(n: int) -> str:
    return f"{n / 1e6:,.0f} MB"


def _mem(n: int, of: int) -> str:
    return f"{_mb(n)} ({n / of:.0%})"


def _row_cells(r: SizeResult, key: str, refs: tuple[str, ...]) -> list[str]:
    row = r.rows.get(key)
    if row is None:
        return []
    if row.m is None:
        return [row.label, row.error or "failed", "", "", "", "", "", ""]
    ratios = [ratio(row.m.median, r.median(ref)) for ref in refs]
    return [
        row.label, *median_span(row.m.times), f"{r.nbytes / 1e9 / row.m.median:.2f}", *ratios,
        _mem(row.m.peak_extra, r.nbytes),
    ]  # fmt: skip


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
    fp, xx = r.median("fingerprints"), r.median("checksums")
    save_s, restore_s = r.median("ours_save"), r.median("ours_restore_fresh")
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
            rows.append([name, case["error"] or "failed", "", "", "", "", "", ""])
            continue
        m = Measurement(case["times"], 0)
        peer = r.median(FSDP_PEERS.get(name, ""))
        floor = fsdp_median(f, FSDP_FLOOR) if "restore" in name or name == FSDP_FLOOR else None
        peaks = case["peak_extra"]
        rows.append([
            name, *median_span(m.times), f"{r.nbytes / 1e9 / m.median:.2f}",
            ratio(m.median, peer), ratio(m.median, floor) if floor else "",
            _mem(peaks[0], shard[0]), _mem(peaks[1], shard[1]) if len(peaks) > 1 else "-",
        ])  # fmt: skip
    return "\n".join(
        [
            f"2-rank FSDP2 (torchrun, gloo, fully_shard per layer and root; the same "
            f"{size_text(r.nbytes)} in total, shards of {' + '.join(_mb(s) for s in shard)}; "
            "x 1 process: over the same path in one process; x 2-rank read: over each rank "
            "reading its own shard files, cold, into new tensors, in the same run):",
            "",
            table(FSDP_HEADERS, rows),
        ]
    )


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
        cells.append(factor(per[-1] / per[0]) if per[0] and per[-1] else "-")
        rows.append(cells)
    return "\n".join(
        [
            "Cost per GB across state sizes (issue 15, item 5; median s/GB, min in brackets):",
            "",
            table(headers, rows),
        ]
    )


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
            *bullets(info),
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
