"""Where ours spends its time: cProfile of a save and of cold restores.

    python benchmarks/save_restore.py --sizes 1200 --profile [--top 25] [--device cuda]

Each case runs once unprofiled (its plain wall time) and once under cProfile. Threads
that the call starts (e.g. a fingerprint worker) get their own profiler and are listed
separately; threads that existed before the call are not seen.
"""

from __future__ import annotations

import contextlib
import cProfile
import pstats
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from common import build_state, drop_page_cache, fresh_like, seconds, state_bytes
from contenders import Ours, restore
from report import size_text, table


class ThreadProfiles:
    """cProfile of the calling thread, plus one profiler per thread started meanwhile."""

    def __init__(self) -> None:
        self.main = cProfile.Profile()
        self.workers: list[tuple[str, cProfile.Profile]] = []

    def _hook(self, *_: object) -> None:
        sys.setprofile(None)
        prof = cProfile.Profile()
        self.workers.append((threading.current_thread().name, prof))
        prof.enable()

    def __enter__(self) -> ThreadProfiles:
        threading.setprofile(self._hook)
        self.main.enable()
        return self

    def __exit__(self, *exc: object) -> None:
        self.main.disable()
        threading.setprofile(None)  # type: ignore[arg-type]
        for _, prof in self.workers:
            prof.disable()


def _where(func: tuple[str, int, str]) -> str:
    path, line, name = func
    if path == "~":
        return name  # a builtin
    for marker in ("site-packages/", "/src/", "/lib/python3."):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{path}:{line}({name})"


def _table(stats: pstats.Stats, wall: float, top: int, *, cumulative: bool = False) -> str:
    """The ``top`` functions by own time, or (``cumulative``) unbroken's and DCP's by
    cumulative time, with the share of ``wall``."""
    entries = stats.stats.items()  # type: ignore[attr-defined]
    if cumulative:
        entries = [
            (f, v) for f, v in entries if "unbroken" in f[0] or "distributed/checkpoint" in f[0]
        ]
    ranked = sorted(entries, key=lambda kv: kv[1][3 if cumulative else 2], reverse=True)
    rows = [
        [_where(f), str(nc), f"{tt:.3f}", f"{ct:.3f}", f"{(ct if cumulative else tt) / wall:.0%}"]
        for f, (_, nc, tt, ct, _) in ranked[:top]
    ]
    return table(["function", "calls", "own s", "cumulative s", "% of wall"], rows)


def report(profiles: ThreadProfiles, wall: float, top: int) -> str:
    """Tables: the calling thread by own time and, for unbroken and DCP functions, by
    cumulative time; then the threads the call started, by own time."""
    main = pstats.Stats(profiles.main)
    parts = [
        "calling thread, by own time (tottime):",
        _table(main, wall, top),
        "",
        "calling thread, unbroken and torch.distributed.checkpoint by cumulative time:",
        _table(main, wall, top, cumulative=True),
    ]
    if profiles.workers:
        names = sorted({n.rsplit("_", 1)[0] for n, _ in profiles.workers})
        workers = pstats.Stats(profiles.workers[0][1])
        for _, prof in profiles.workers[1:]:
            workers.add(prof)
        parts += [
            "",
            f"{len(profiles.workers)} thread(s) started by the call ({', '.join(names)}), "
            "by own time (they overlap the calling thread):",
            _table(workers, wall, min(top, 12)),
        ]
    return "\n".join(parts)


def profile(mb: float, width: int, tmp: str, top: int, device: torch.device) -> str:
    """Profile ours' save, restore into fresh objects (CPU only: a resumed process builds
    them there first) and into the existing ones, cold: the tables of each
    (:func:`report`)."""
    model, opt = build_state(mb, width, device)
    nbytes = state_bytes(model, opt)
    root = Path(tempfile.mkdtemp(prefix="ub-profile-", dir=tmp))
    fresh: list = []
    out = []
    try:
        ours = Ours(root, model, opt, device)
        ours.save()  # warm-up: first-call costs are not what we are after

        def fresh_objects() -> None:
            fresh[:] = fresh_like(model)
            drop_page_cache([str(ours.dir)])

        cases: list[tuple[str, Callable[[], object], Callable[[], object]]] = [
            ("save (sync)", ours.save, ours.clear),
            ("restore, existing objects", lambda: restore("ours", ours.dir, model, opt),
             lambda: drop_page_cache([str(ours.dir)])),
        ]  # fmt: skip
        if device.type == "cpu":
            cases.insert(1, ("restore, fresh objects", lambda: restore("ours", ours.dir, *fresh),
                             fresh_objects))  # fmt: skip
        for name, fn, setup in cases:
            timings = []
            for profiled in (False, True):
                setup()
                with ThreadProfiles() if profiled else contextlib.nullcontext() as profiles:
                    timings.append(seconds(fn, device))
            plain, wall = timings
            out.append(
                f"== cProfile of ours, {name}: {size_text(nbytes)} on {device}; {plain:.3f} s "
                f"unprofiled, {wall:.3f} s under the profiler\n{report(profiles, wall, top)}"
            )
        ours.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return "\n\n".join(out)
