"""Rounds of saves and restores over a list of contenders: what the peers part (restores
in a fresh process, fresh objects) and the device part (restores into the live objects on
the device) both measure.

Each contender is built and saves once (its first save: staging buffers allocated,
writer processes started; its blocked time is reported apart, and the memory it keeps
afterwards is measured); then each round saves with every contender (the order rotated
by one place per round, each into a folder emptied beforehand, untimed) and restores each
family from the checkpoint its source saved in that round (the order rotated too), cold
(the files fsync'd and evicted from the page cache) then warm (every file read once).

The figures: ``"<key>.<field>"`` for a save (``first_blocked``, ``blocked``, ``durable``,
``fsync``, ``copied``, ``peak``, ``kept``) and ``"<family>_<cold|warm|peak|correct>"``
for a restore, each a list of runs, or a string that says why there is none.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import common
import contenders

Figures = dict[str, list | str]
SAVE_FIELDS = ("first_blocked", "blocked", "durable", "fsync", "copied", "peak", "kept")
# (family, checkpoint, "cold" | "warm") -> {"seconds", "peak", "correct", "verified"}
RestoreOnce = Callable[[str, Path, str], dict]


def run(
    classes: list[type[contenders.Contender]],
    sources: dict[str, str],
    state: tuple[nn.Module, torch.optim.Optimizer],
    root: Path,
    runs: int,
    device: torch.device,
    restore_once: RestoreOnce,
    log: Callable[[str], None],
    *,
    memory: bool,
) -> tuple[Figures, int]:
    """The first save of every contender of ``classes``, then ``runs`` rounds (module
    docstring); ``sources``: restore family -> the key of the save whose checkpoint it
    reads; ``memory``: sample the peak extra memory of each save (this process and its
    children). Returns the figures and how many restores the library itself verified."""
    fig: Figures = {}

    def fail(key: str, why: str, fields: tuple[str, ...] = SAVE_FIELDS) -> None:
        fig.update({f"{key}.{f}": why for f in fields})
        log(f"  {key}: {why}")

    live: list[contenders.Contender] = []
    try:
        for cls in classes:
            if cls.family == "tc" and not contenders.tc_installed():
                fail(cls.key, contenders.TC_MISSING)
                continue
            common.release_free_memory()
            before = common.rss(children=True)
            try:
                live.append(cls(root, *state, device))
                common.synchronize(device)
                first = live[-1].save()
                live[-1].clear()
            except Exception as exc:
                fail(cls.key, f"error: {common.one_line(exc)}")
                continue
            common.release_free_memory()
            fig.update({f"{cls.key}.{f}": [] for f in SAVE_FIELDS})
            fig[f"{cls.key}.first_blocked"] = [first.blocked]
            fig[f"{cls.key}.kept"] = [common.rss(children=True) - before]
        verified = 0
        for i in range(runs):
            _saves(common.rotated(live, i), fig, set(sources.values()), device, fail, memory)
            for family in common.rotated(list(sources), i):
                verified += _restores(family, sources[family], live, fig, restore_once, log)
            log(f"  round {i + 1}/{runs} done")
    finally:
        for c in live:
            c.close()
    return fig, verified


def _saves(live, fig: Figures, kept: set[str], device, fail, memory: bool) -> None:
    for c in live:
        if isinstance(fig[f"{c.key}.blocked"], str):
            continue
        c.clear()
        common.release_free_memory()
        try:
            common.synchronize(device)
            with (
                common.PeakRSS(0.005, children=True) if memory else contextlib.nullcontext() as mem
            ):
                t = c.save()
            common.synchronize(device)
        except Exception as exc:
            fail(c.key, f"error: {common.one_line(exc)}")
            continue
        for field, value in (("blocked", t.blocked), ("durable", t.durable), ("fsync", t.fsync),
                             ("copied", t.copied), ("peak", mem.extra if mem else None)):  # fmt: skip
            if value is not None:
                fig[f"{c.key}.{field}"].append(value)  # type: ignore[union-attr]
        if c.key not in kept:
            c.clear()  # only the checkpoints the restores read stay on disk


def _restores(family: str, source: str, live, fig: Figures, restore_once, log) -> int:
    """Restore ``family`` cold, then warm, from its source's checkpoint of this round."""
    keys = [f"{family}_{x}" for x in ("cold", "warm", "peak", "correct")]
    src = next((c for c in live if c.key == source), None)
    why = fig.get(
        f"{source}.blocked", contenders.TC_MISSING if family == "tc" else "its save did not run"
    )
    if src is None or isinstance(why, str):
        fig.update(
            {
                k: why if why == contenders.TC_MISSING else f"its save ({source}): {why}"
                for k in keys
            }
        )
        return 0
    for k in keys:
        fig.setdefault(k, [])
    verified, peak = 0, 0
    for temp in ("cold", "warm"):
        key = f"{family}_{temp}"
        if isinstance(fig[key], str):
            continue
        (common.drop_page_cache if temp == "cold" else common.warm_cache)([str(src.latest())])
        try:
            got = restore_once(family, src.latest(), temp)
        except Exception as exc:
            fig[key] = f"error: {common.one_line(exc)}"
            log(f"  restore {key}: {fig[key]}")
            continue
        fig[key].append(got["seconds"])  # type: ignore[union-attr]
        peak = max(peak, got.get("peak", 0))
        verified += bool(got.get("verified"))
        if got.get("correct") is not None:
            fig[f"{family}_correct"].append(got["correct"])  # type: ignore[union-attr]
    fig[f"{family}_peak"].append(peak)  # type: ignore[union-attr]
    return verified
