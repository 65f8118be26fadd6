"""Shared pieces of the benchmarks: a training state of a given size, timing, tables."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn


def build_state(total_mb: float, width: int = 2048) -> tuple[nn.Module, torch.optim.Optimizer]:
    """nn.Linear layers + AdamW after one step: params, exp_avg and exp_avg_sq (~3x params)."""
    layer_mb = width * width * 4 * 3 / 1e6
    depth = max(1, round(total_mb / layer_mb))
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(depth)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    for s in opt.state.values():
        n += sum(t.numel() * t.element_size() for t in s.values() if isinstance(t, torch.Tensor))
    return n


def timed(fn: Callable[[], object], repeats: int, setup: Callable[[], object] | None = None):
    """Median, min and max seconds of ``fn`` over ``repeats`` runs (``setup`` untimed)."""
    times = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times), max(times)


def drop_page_cache(paths: list[str]) -> None:
    """Evict our own files from the page cache (cold reads) without root-only knobs."""
    for root in paths:
        for dirpath, _, files in os.walk(root):
            for f in files:
                fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, Python "
        f"{platform.python_version()}, torch {torch.__version__}"
    )


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows, strict=True)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = [
        "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) + " |"
        for r in rows
    ]
    return "\n".join([line, sep, *body])
