"""The suite's part ``async``: what a save costs the training loop in each ``async_save``
mode (issue 15, item 3), the ``async`` section of docs/benchmarks.md.

A loop of real training steps (forward, backward, AdamW step) over the state of
``common.build_state``. For each mode (``False``, ``True``, ``"overlap"``) one
Checkpointer saves once per round, after one warm-up save (which allocates the staging
buffers later saves reuse); each round: two steps without a save (the reference step),
``save()``, then steps until the save is committed. Measured per round: the seconds
``save()`` blocked, the seconds the next optimizer step waited for the copy (between two
optimizer step pre-hooks of our own: a global one registered before the Checkpointer's,
which runs first, and one on the optimizer, which runs after every global one), the first
step after ``save()``, the mean step while the write was in flight, and ``save()`` to
commit (seen between steps: step granularity). The yardstick is one copy of the state
into preallocated memory.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

import unbroken as ub
from common import build_state, machine_info, repeat, scale, state_bytes, state_tensors
from contenders import copy_into
from report import Section, inline, kept, ratio, table

SECTION = Section("async")
MODES: list[bool | str] = [False, True, "overlap"]
MB, WIDTH, BATCH, REPEATS = 1200, 2048, 64, 5


class Loop:
    """Training steps on one model and optimizer, each timed, and the time each optimizer
    step spent in the step pre-hooks registered after our first one (the Checkpointer's)."""

    def __init__(self, model, opt: torch.optim.Optimizer, batch: int) -> None:
        self.model, self.opt = model, opt
        width = next(model.parameters()).shape[1]
        self.x = torch.randn(batch, width, generator=torch.Generator().manual_seed(0))
        self.waits: list[float] = []
        self._entered = 0.0

        def enter(*_: object) -> None:
            self._entered = time.perf_counter()

        def leave(*_: object) -> None:
            self.waits.append(time.perf_counter() - self._entered)

        self.hooks = [register_optimizer_step_pre_hook(enter), opt.register_step_pre_hook(leave)]

    def step(self) -> float:
        start = time.perf_counter()
        loss = self.model(self.x).pow(2).mean()
        self.opt.zero_grad(set_to_none=False)
        loss.backward()
        self.opt.step()
        return time.perf_counter() - start


def bench_mode(loop: Loop, mode: bool | str, root: Path, repeats: int) -> dict[str, list[float]]:
    ckpt = ub.Checkpointer(
        root / f"mode_{mode}", model=loop.model, optimizer=loop.opt, keep_last=2,
        async_save=mode, overwrite=True,
    )  # fmt: skip
    out: dict[str, list[float]] = {
        k: [] for k in ("blocked", "wait", "first", "writing", "plain", "committed")
    }
    try:
        ckpt.save(1)  # warm-up: staging buffers allocated here
        ckpt.wait()
        for step in range(2, repeats + 2):
            out["plain"] += [loop.step(), loop.step()]
            start = time.perf_counter()
            ckpt.save(step)
            out["blocked"].append(time.perf_counter() - start)
            loop.waits.clear()
            out["first"].append(loop.step())
            out["wait"].append(sum(loop.waits))
            during = []
            while ckpt.latest_step() != step and len(during) < 50:
                during.append(loop.step())
            ckpt.wait()
            out["committed"].append(time.perf_counter() - start)
            if during:
                out["writing"].append(statistics.mean(during))
    finally:
        ckpt.close()
    return out


def measure(args: argparse.Namespace, log) -> dict:
    """The part's figures, as ``--results`` keeps them (and ``--render`` reads)."""
    (mb,), width, repeats = scale(args, [args.async_mb], WIDTH, REPEATS, 2)
    batch = 8 if args.quick else args.batch
    info = machine_info(args.tmpdir)
    model, opt = build_state(mb, width)
    tensors = state_tensors(model, opt)
    targets = [torch.zeros_like(t) for t in tensors]
    copies = repeat(lambda: copy_into(targets, tensors), max(repeats, 5))
    targets.clear()
    loop = Loop(model, opt, batch)
    log(f"state {state_bytes(model, opt) / 1e9:.2f} GB ({len(tensors)} tensors), batch "
        f"{batch}, {repeats} rounds per mode; one copy into preallocated memory "
        f"{statistics.median(copies):.3f} s")  # fmt: skip
    modes = {}
    try:
        with tempfile.TemporaryDirectory(prefix="ub-async-", dir=args.tmpdir) as tmp:
            for mode in MODES:
                log(f"  async_save={mode!r} ...")
                modes[repr(mode)] = bench_mode(loop, mode, Path(tmp), repeats)
    finally:
        for hook in loop.hooks:
            hook.remove()
    return {"info": info, "nbytes": state_bytes(model, opt), "width": width, "copies": copies,
            "modes": modes}  # fmt: skip


def _fmt(times: list[float]) -> str:
    return "-" if not times else f"{statistics.median(times):.4f} ({min(times):.4f})"


def render(data: dict, *, markdown: bool) -> str:
    copies, modes = data["copies"], data["modes"]
    copy = statistics.median(copies)
    rows = []
    for mode, r in modes.items():
        total = [b + w for b, w in zip(r["blocked"], r["wait"], strict=True)]
        rows.append([f"`{mode}`", _fmt(r["blocked"]), _fmt(r["wait"]),
                     ratio(statistics.median(r["blocked"]), copy),
                     ratio(statistics.median(total), copy), _fmt(r["first"]),
                     _fmt(r["writing"]), _fmt(r["committed"])])  # fmt: skip
    plain = [t for r in modes.values() for t in r["plain"]]
    rows.append(["(no save)", "-", "-", "-", "-", _fmt(plain), _fmt(plain), "-"])
    rows.append(["one copy into preallocated memory", _fmt(copies), "-", "1.00x", "-", "-", "-",
                 "-"])  # fmt: skip
    text = table(["async_save", "blocked in save()", "wait at next step", "blocked / copy",
                  "(blocked + wait) / copy", "first step after save", "step while writing",
                  "save() to commit"], rows)  # fmt: skip
    if not markdown:
        return text
    blocked = statistics.median(modes["'overlap'"]["blocked"])
    share = blocked / copy if copy else float("inf")
    verdict = "met" if share <= 0.05 else f"missed by {share / 0.05 - 1:.0%}"
    width = data["width"]
    return (
        f"## Training blocked by a save: `async_save` modes, {data['nbytes'] / 1e9:.2f} GB "
        f"(issue 15, item 3)\n\n"
        f"Generated by `{data['command']}`; only this section. Seconds inside `save()`, the "
        "seconds the next optimizer step waited for the copy (the step pre-hook of "
        '`async_save="overlap"`, timed), the first training step after `save()`, the mean '
        "step while the write was in flight, and `save()` to commit (seen between steps). A "
        f"step is a real forward, backward and AdamW step over Linear({width}, {width}) "
        "layers; the yardstick is one copy of the state into preallocated memory, measured "
        "in the same run. Median of the rounds (min), after one warm-up save per mode. "
        f"Machine: {inline(data['info'])}.\n\n"
        f'Target (item 3): training blocked <= 0.05x one copy. `"overlap"`: '
        f"{blocked * 1000:.1f} ms = {share:.3f}x: **{verdict}**.\n\n{text}\n\n"
        + kept("async-reading")
    )
