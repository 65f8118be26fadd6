"""The suite's part ``single``: every path in one process at each state size, and the same
on several FSDP2 ranks (``part_ranks.py``); its report is ``single_report.py``.

For each size, in one run: (a) the disk floor (plain writes + fsync, cold reads),
(b) ``torch.save`` + fsync and ``torch.load`` + ``load_state_dict``, (c) raw DCP through
``get_state_dict``/``set_state_dict``, (d) ours (sync save, async save, cold restore into
fresh and into existing objects), one copy of the state into preallocated memory and the
verification share. The cases run round-robin (every case once per round, saves first,
then restores, then copies, each group rotated by one place per round) so that load from
other processes and the disk's state spread over all of them alike; each round's
restores read the files its saves just wrote.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import xxhash

import part_ranks
from common import (
    Case,
    Measurement,
    OtherLoad,
    build_state,
    drop_page_cache,
    fresh_like,
    machine_info,
    release_free_memory,
    run_rounds,
    scale,
    source_digests,
    state_bytes,
    state_tensors,
)
from contenders import (
    DcpSave,
    DcpSave2,
    Ours,
    OursAsync,
    TorchSave,
    clear,
    copy_into,
    raw_bytes,
    read_raw,
    read_raw_new,
    restore,
    write_raw,
)

# Nothing public computes one tensor's fingerprint: the verification share times the
# library's own function (the one a save and a restore call for every tensor).
from unbroken.format.fingerprint import V2, fingerprint

SIZES, WIDTH, REPEATS = [300, 1200, 3000], 2048, 5


@dataclasses.dataclass
class Row:
    """One measured path: its label and measurement, or why there is none."""

    label: str
    m: Measurement | None
    error: str | None = None


@dataclasses.dataclass
class SizeResult:
    """Every figure of one state size: the rows by key, and the multi-rank part's JSON
    (``part_ranks.py``; ``{"error": ...}`` where it failed; None where not run)."""

    mb: float
    nbytes: int
    ntensors: int
    repeats: int
    rows: dict[str, Row]
    fsdp: dict[str, Any] | None
    load: dict[str, float]  # phase -> cores other processes kept busy meanwhile

    def times(self, key: str) -> list[float] | None:
        row = self.rows.get(key)
        return row.m.times if row is not None and row.m is not None else None

    def median(self, key: str) -> float | None:
        """The median seconds of row ``key``, or None where it was not measured."""
        row = self.rows.get(key)
        return row.m.median if row is not None and row.m is not None else None


def _row(case: Case) -> Row:
    if case.error is not None or not case.times:
        return Row(case.label, None, error=case.error or "not run")
    return Row(case.label, Measurement(case.times, case.peak))


class Bench:
    """All one-process measurements of one state size, in one temp folder."""

    def __init__(self, model, opt, root: Path, repeats: int) -> None:
        self.model, self.opt, self.root, self.repeats = model, opt, root, repeats
        self.tensors = state_tensors(model, opt)
        self.nbytes = state_bytes(model, opt)
        self.rows: dict[str, Row] = {}
        self._targets: list[torch.Tensor] = []  # preallocated, touched: read/copy targets
        self._fresh: list = []  # the fresh model and optimizer of a restore
        self._blocked: list[float] = []  # the async saves' seconds in save()
        cpu = torch.device("cpu")
        self.c = {
            cls.key: cls(root, model, opt, cpu) for cls in (TorchSave, DcpSave, DcpSave2, Ours)
        }
        self.async_save = OursAsync(root, model, opt, cpu)

    def run(self, log) -> None:
        self._targets = [torch.zeros_like(t) for t in self.tensors]
        first = Case("async_first", "(d) ours: async save, first call, blocked",
                     lambda: self._blocked.append(self.async_save.save().blocked),
                     self.async_save.clear)  # fmt: skip
        first.run_once()  # it may allocate staging memory that later calls reuse
        blocked, self._blocked = self._blocked, []
        self.rows["async_first"] = (
            Row(first.label, Measurement(blocked, first.peak)) if blocked else _row(first)
        )
        groups = [self._saves(), self._restores(), self._others()]
        try:
            run_rounds(groups, self.repeats, log)
        finally:
            for c in [*self.c.values(), self.async_save]:
                c.close()
            self._targets.clear()
        self.rows.update({case.key: _row(case) for group in groups for case in group})
        commit = self.rows["async_commit"]
        self.rows["async_block"] = Row(
            "(d) ours: async save, blocked in save()",
            Measurement(self._blocked, commit.m.peak_extra) if commit.m is not None else None,
            error=commit.error,
        )
        ok = [self.rows[k] for k in ("dcp_save_1", "dcp_save_2") if self.rows[k].m is not None]
        self.rows["dcp_save"] = min(ok, key=lambda r: r.m.median) if ok else self.rows["dcp_save_1"]  # type: ignore[union-attr]

    def _cold(self, path: Path) -> Callable[[], None]:
        return lambda: drop_page_cache([str(path)])

    def _fresh_objects(self, path: Path) -> Callable[[], None]:
        def setup() -> None:
            self._fresh.clear()
            release_free_memory()
            self._fresh.extend(fresh_like(self.model))
            drop_page_cache([str(path)])

        return setup

    def _saves(self) -> list[Case]:
        c, raw = self.c, self.root / "raw.bin"

        def save(key: str) -> tuple[Callable[[], object], Callable[[], object]]:
            return c[key].save, c[key].clear

        def save_async() -> None:
            self._blocked.append(self.async_save.save().blocked)

        return [
            Case("floor_write", "(a) write + fsync", lambda: write_raw(self.tensors, raw),
                 lambda: clear(raw)),
            Case("torch_save", "(b) torch.save + fsync", *save("torch_save")),
            Case("dcp_save_1", "(c) DCP save, thread_count=1", *save("dcp_1")),
            Case("dcp_save_2", "(c) DCP save, thread_count=2", *save("dcp_2")),
            Case("ours_save", "(d) ours: save (sync, verified)", *save("ours")),
            Case("async_commit", "(d) ours: async save, until committed", save_async,
                 self.async_save.clear),
        ]  # fmt: skip

    def _restores(self) -> list[Case]:
        m, o, fresh, raw = self.model, self.opt, self._fresh, self.root / "raw.bin"

        def path(key: str) -> Callable[[], Path]:
            return self.c[key].latest

        torch_pt, dcp1, ours = path("torch_save"), path("dcp_1"), path("ours")
        return [
            Case("floor_read", "(a) cold read into existing tensors",
                 lambda: read_raw(self._targets, raw), self._cold(raw)),
            # Built fresh objects first, as the restores into fresh objects do: a resumed
            # process has built its model before it reads, and this VM's first touch of
            # memory depends on what was freed and built just before (docs/benchmarks.md).
            Case("floor_read_new", "(a) cold read into new tensors",
                 lambda: read_raw_new(self.tensors, raw), self._fresh_objects(raw), fresh.clear),
            Case("torch_load", "(b) torch.load + load_state_dict, existing objects",
                 lambda: restore("torch", torch_pt(), m, o), lambda: self._cold(torch_pt())()),
            Case("dcp_load", "(c) DCP load + set_state_dict, existing objects",
                 lambda: restore("dcp", dcp1(), m, o), lambda: self._cold(dcp1())()),
            Case("dcp_load_fresh", "(c) DCP load + set_state_dict, fresh objects",
                 lambda: restore("dcp", dcp1(), *fresh), lambda: self._fresh_objects(dcp1())(),
                 fresh.clear),
            Case("ours_restore_fresh", "(d) ours: restore, fresh objects",
                 lambda: restore("ours", ours(), *fresh), self._fresh_objects(ours()),
                 fresh.clear),
            Case("ours_restore", "(d) ours: restore, existing objects",
                 lambda: restore("ours", ours(), m, o), self._cold(ours())),
        ]  # fmt: skip

    def _others(self) -> list[Case]:
        t = self.tensors
        return [
            Case("copy", "one copy of the state into preallocated memory",
                 lambda: copy_into(self._targets, t)),
            Case("clone", "one copy of the state into new memory (clone)",
                 lambda: [x.clone() for x in t]),
            Case("fingerprints", "fingerprints, every tensor once",
                 lambda: [fingerprint(x) for x in t]),
            Case("fingerprints_v2", "the same in the older wsum64-v2 format",
                 lambda: [fingerprint(x, V2) for x in t]),
            Case("checksums", "xxh3-128 checksums, every tensor once",
                 lambda: [xxhash.xxh3_128_hexdigest(raw_bytes(x)) for x in t]),
        ]  # fmt: skip


def bench_size(mb: float, width: int, repeats: int, tmp: str, ranks: int, log) -> SizeResult:
    model, opt = build_state(mb, width)
    load: dict[str, float] = {}
    fsdp = None
    root = Path(tempfile.mkdtemp(prefix="ub-bench-", dir=tmp))
    try:
        b = Bench(model, opt, root, repeats)
        log(f"\n== state {b.nbytes / 1e9:.3f} GB ({len(b.tensors)} tensors), {repeats} rounds")
        with OtherLoad() as other:
            b.run(log)
        load["1 process"] = other.cores
        if ranks > 1:
            timeout = 300 + 60 * repeats * b.nbytes / 1e9
            with OtherLoad() as other:
                fsdp = part_ranks.launch(mb, width, repeats, root, ranks, timeout, log)
            load["FSDP2"] = other.cores
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return SizeResult(mb, b.nbytes, len(b.tensors), repeats, b.rows, fsdp, load)


def measure(args: argparse.Namespace, log) -> dict:
    """Every size's figures, and the machine and the code they were measured on, as
    ``--results`` keeps them."""
    sources = source_digests()
    info = machine_info(args.tmpdir, sources=sources)
    log("machine: " + "; ".join(f"{k} {v}" for k, v in info.items()))
    sizes, width, repeats = scale(args, args.sizes or SIZES, WIDTH, REPEATS)
    results = [bench_size(mb, width, repeats, args.tmpdir, args.ranks, log) for mb in sizes]
    now = source_digests()
    changed = sorted(f for f in sources.keys() | now.keys() if sources.get(f) != now.get(f))
    if changed:
        info["unbroken"] += (
            f" (WARNING: {', '.join(changed)} changed during the run; the FSDP2 workers, "
            "started later, may have run the newer code)"
        )
    return {"info": info, "results": [dataclasses.asdict(r) for r in results]}


def load_sizes(data: dict) -> list[SizeResult]:
    """The sizes :func:`measure` kept (``--results``), as objects again (older files also
    hold an empty ``notes`` per size and an ``na`` per row, never set: left out)."""
    out = []
    for r in data["results"]:
        r = {k: v for k, v in r.items() if k != "notes"}
        rows = {}
        for key, row in r.pop("rows").items():
            m = Measurement(**row["m"]) if row["m"] else None
            rows[key] = Row(row["label"], m, row["error"])
        out.append(SizeResult(rows=rows, **r))
    return out
