"""Tables and the docs section of ``peers.py``: per size, a save table and a restore table
(median (min-max) seconds, ratios against ours, peak extra memory, correctness), then where
ours is behind, computed from the medians."""

from __future__ import annotations

import dataclasses
import statistics

from docs_sections import analysis_headings, why_missed
from peers_contenders import RESTORE_LABELS
from report import bullets, median_span, ratio, table

BASELINE = {"sync": "ours", "async": "ours_overlap"}  # what "x ours" divides by


def tc_version() -> str:
    try:
        from importlib.metadata import version

        return version("torch-checkpointing")
    except Exception as exc:  # not installed: its rows say so
        return f"not installed ({type(exc).__name__})"


@dataclasses.dataclass
class SaveRow:
    key: str
    label: str
    kind: str
    fsyncs: bool
    blocked: list[float] = dataclasses.field(default_factory=list)
    durable: list[float] = dataclasses.field(default_factory=list)
    fsync: list[float] = dataclasses.field(default_factory=list)
    peak: int = 0
    kept: int = 0
    error: str | None = None

    def add(self, blocked: float, durable: float, fsync: float, peak: int) -> None:
        self.blocked.append(blocked)
        self.durable.append(durable)
        self.fsync.append(fsync)
        self.peak = max(self.peak, peak)


@dataclasses.dataclass
class RestoreRow:
    family: str
    cold: list[float] = dataclasses.field(default_factory=list)
    warm: list[float] = dataclasses.field(default_factory=list)
    peak: int = 0
    correct: list[str] = dataclasses.field(default_factory=list)
    error: str | None = None

    def add(self, cold: float, warm: float, peak: int, correct: str) -> None:
        self.cold.append(cold)
        self.warm.append(warm)
        self.peak = max(self.peak, peak)
        self.correct.append(correct)

    @property
    def label(self) -> str:
        return RESTORE_LABELS[self.family]

    @property
    def verdict(self) -> str:
        wrong = [c for c in self.correct if c != "exact"]
        if not self.correct:
            return "-"
        return "exact" if not wrong else f"WRONG ({len(wrong)}/{len(self.correct)}): {wrong[0]}"


@dataclasses.dataclass
class Result:
    mb: float
    nbytes: int
    repeats: int
    saves: dict[str, SaveRow] = dataclasses.field(default_factory=dict)
    restores: dict[str, RestoreRow] = dataclasses.field(default_factory=dict)
    other_load: float = 0.0

    def add_save(self, key: str, label: str, kind: str, fsyncs: bool) -> None:
        self.saves[key] = SaveRow(key, label, kind, fsyncs)

    def restore_row(self, family: str) -> RestoreRow:
        return self.restores.setdefault(family, RestoreRow(family))


def _med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _secs(xs: list[float]) -> str:
    if not xs:
        return "-"
    med, span = median_span(xs)
    return f"{med} ({span})"


def _ratio(xs: list[float], base: list[float]) -> str:
    return ratio(_med(xs), _med(base))


def _mb(n: int, has: bool) -> str:
    return f"{max(0, n) / 1e6:.0f}" if has else "-"


def _save_table(r: Result, notes: list[str]) -> str:
    rows = []
    for s in r.saves.values():
        base = r.saves.get(BASELINE[s.kind])
        bb, bd = (base.blocked, base.durable) if base else ([], [])
        label = s.label
        if s.error is not None:
            notes.append(f"{s.label}: failed on this machine, `{s.error}`.")
            label += f" [{len(notes)}]"
        elif not s.fsyncs:
            label += " *"
        fs = _secs(s.fsync) if not s.fsyncs else "in its save"
        ok = bool(s.blocked)
        rows.append([label, _secs(s.blocked), _ratio(s.blocked, bb), _secs(s.durable),
                     _ratio(s.durable, bd), fs if ok else "-", _mb(s.peak, ok),
                     _mb(s.kept, s.error is None)])  # fmt: skip
    headers = ["save", "blocked s", "x ours", "until durable s", "x ours", "fsync we added s",
               "peak extra MB", "kept MB"]  # fmt: skip
    return table(headers, rows)


def _restore_table(r: Result, notes: list[str]) -> str:
    base = r.restores.get("ours")
    rows = []
    for x in r.restores.values():
        label = x.label
        if x.error is not None:
            notes.append(f"{x.label}: failed, `{x.error}`.")
            label += f" [{len(notes)}]"
        ok = bool(x.cold)
        rows.append([label, _secs(x.cold), _ratio(x.cold, base.cold if base else []),
                     _secs(x.warm), _ratio(x.warm, base.warm if base else []),
                     _mb(x.peak, ok), x.verdict])  # fmt: skip
    headers = ["restore (fresh process, fresh objects)", "cold s", "x ours", "warm s",
               "x ours", "peak extra MB", "correct"]  # fmt: skip
    return table(headers, rows)


PEERS_TOPIC = "Peers side by side"  # the heading of analysis.md that says why ours is behind


def behind(r: Result) -> list[str]:
    """Every figure where a peer's median beats ours' (of the same kind), by how much
    (memory: by more than 8 MB and 2% of the state, below which it is Python objects)."""
    out = []
    noise = max(8e6, 0.02 * r.nbytes)
    for s in r.saves.values():
        base = r.saves.get(BASELINE[s.kind])
        if s.key.startswith("ours") or base is None or not s.blocked or not base.blocked:
            continue
        for name, mine, theirs in [("blocked", base.blocked, s.blocked),
                                   ("until durable", base.durable, s.durable)]:  # fmt: skip
            a, b = _med(mine), _med(theirs)
            if a is not None and b is not None and 0 < b < a:
                out.append(f"save {name}: {s.label} {b:.3f} s, {base.label} {a:.3f} s "
                           f"({a / b:.2f}x, +{a - b:.3f} s)")  # fmt: skip
        for name, a, b in [("peak extra memory", base.peak, s.peak),
                           ("memory kept between saves", base.kept, max(0, s.kept))]:  # fmt: skip
            if b < a and a - b > noise:
                out.append(f"save {name}: {s.label} {b / 1e6:.0f} MB, {base.label} "
                           f"{a / 1e6:.0f} MB (+{(a - b) / 1e6:.0f} MB)")  # fmt: skip
    ours = r.restores.get("ours")
    for x in r.restores.values():
        if x.family == "ours" or ours is None or not x.cold or not ours.cold:
            continue
        for name, mine, theirs in [("cold", ours.cold, x.cold), ("warm", ours.warm, x.warm)]:
            a, b = statistics.median(mine), statistics.median(theirs)
            if 0 < b < a:
                out.append(f"restore {name}: {x.label} {b:.3f} s, ours {a:.3f} s "
                           f"({a / b:.2f}x, +{a - b:.3f} s)")  # fmt: skip
        if ours.peak - x.peak > noise:
            out.append(f"restore peak extra memory: {x.label} {x.peak / 1e6:.0f} MB, ours "
                       f"{ours.peak / 1e6:.0f} MB (+{(ours.peak - x.peak) / 1e6:.0f} MB)")  # fmt: skip
    return out


FOOTNOTES = [
    "*blocked*: seconds inside the save call. *until durable*: from the call until the "
    "checkpoint is on disk: fsync'd by the contender, or, marked `*`, until the peer's own "
    "future resolved plus an fsync pass of its files and folders that we add and time "
    "(*fsync we added*): torch-checkpointing 0.1.1 never calls fsync "
    "(`torch_checkpointing/storage/filesystem.py`). DCP's FileSystemWriter and our "
    "`torch.save` path fsync every file (not the folder).",
    'ours `async_save="overlap"` returns before copying: the copy runs behind and the next '
    "`optimizer.step()` waits for it (not measured here: `async_overhead.py` does). "
    "torch-checkpointing's async save also stages in the background (its docs ask for "
    "`with manager.lock(): optimizer.step()`). `async_save=True` and `dcp.async_save` copy "
    "inside the call. *x ours* divides sync rows by ours' sync save, async rows by "
    '`"overlap"`.',
    "*peak extra MB*: resident memory above the level before the call, sampled every 5 ms "
    "until durable, of this process plus the private (RssAnon) memory of its child "
    "processes (torch-checkpointing writes from a spawned process; the shared memory it "
    "stages into is counted once). *kept MB*: memory each contender still holds after its "
    "first save (staging buffers, writer process), measured once when it was built.",
    "Each contender saves once untimed before the rounds (first-call costs: buffers, the "
    "writer process). torch-checkpointing is configured as its docs say for CPU-only hosts "
    "(`CheckpointStagerConfig(use_pinned_memory=False, use_non_blocking_copy=False)`); its "
    "default storage opens files with O_DIRECT and writes through Python's buffered file "
    "object, which ext4 rejects (EINVAL); `LocalFileSystemStorageConfig(use_direct_io="
    "False)` is its documented switch for that. Its load uses a sync-configured manager "
    "(loads need no writer process).",
    "Restores run in a fresh process with fresh objects (another seed; AdamW without state) "
    "and time only the restore call (each library imported beforehand, as a job does at "
    "start-up; the call includes building its manager or Checkpointer): *cold* after evicting the checkpoint's files from the "
    "page cache, *warm* after reading them once. *correct*: after the cold restore, every "
    "model and optimizer tensor (and the param groups) hashed with blake2b of its bytes, "
    "with dtype, shape, stride and device, against the saved state's hashes.",
]


def render(results: list[Result], info: dict[str, str], elapsed: float, *, markdown: bool,
           command: str = "") -> str:  # fmt: skip
    out = []
    if markdown:
        out.append(f"## Peers side by side: ours, DCP, torch.save, torch-checkpointing "
                   f"(issue 15, item 6)\n\nGenerated by `{command}`; only this section. "
                   f"Seconds: median (min-max) of the rounds; {elapsed / 60:.1f} minutes in "
                   "all.\n")  # fmt: skip
        out += bullets(info)
    headings = analysis_headings()
    for r in results:
        notes: list[str] = []
        head = f"{r.nbytes / 1e9:.2f} GB, {r.repeats} round{'s' if r.repeats > 1 else ''}"
        load = f"other processes' CPU use meanwhile: {r.other_load:.2f} cores"
        out.append(f"\n### {head}\n\n{load}\n" if markdown else f"\n== {head}; {load}")
        out.append(_save_table(r, notes))
        out.append("")
        out.append(_restore_table(r, notes))
        out += ["", *(f"- [{i}] {n}" for i, n in enumerate(notes, 1))] if notes else []
        lines = behind(r)
        out.append(f"\nWhere ours is behind ({head}, from the medians):")
        out += [f"- {x}" for x in lines] or ["- nowhere"]
        if lines:
            out.append(f"- {why_missed(PEERS_TOPIC, headings)}")
    out.append("\nNotes:")
    out += [f"- {n}" for n in FOOTNOTES]
    return "\n".join(out)
