"""Shared pieces of the benchmarks: a training state of a given size, timing, memory,
and the machine it all runs on (tables and reports: ``report.py``)."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime
import hashlib
import os
import platform
import statistics
import subprocess
import threading
import time
from collections.abc import Callable

import torch
from torch import nn


def layer_count(total_mb: float, width: int = 2048) -> int:
    """Linear(width, width) layers whose weights and AdamW moments make ``total_mb``."""
    layer_mb = width * width * 4 * 3 / 1e6
    return max(1, round(total_mb / layer_mb))


def build_state(total_mb: float, width: int = 2048) -> tuple[nn.Module, torch.optim.Optimizer]:
    """nn.Linear layers + AdamW after one step: params, exp_avg and exp_avg_sq (~3x params)."""
    depth = layer_count(total_mb, width)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(depth)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def fresh_like(model: nn.Module, seed: int = 1) -> tuple[nn.Module, torch.optim.Optimizer]:
    """What a resumed process builds before ``restore()``: the same architecture freshly
    initialized (another seed) and an AdamW without state (its moments do not exist yet)."""
    widths = [m.in_features for m in model.modules() if isinstance(m, nn.Linear)]
    torch.manual_seed(seed)
    fresh = nn.Sequential(*(nn.Linear(w, w, bias=False) for w in widths))
    return fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-3)


def state_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of the training state: parameters, then the optimizer's moments."""
    out = [p.detach() for p in model.parameters()]
    out += [t for s in opt.state.values() for t in s.values() if t.dim() > 0]
    return out


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


@dataclasses.dataclass
class Measurement:
    """Seconds of each run, and the largest extra resident memory seen in any of them."""

    times: list[float]
    peak_extra: int  # bytes of RSS above the level when the run started

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def low(self) -> float:
        return min(self.times)

    @property
    def high(self) -> float:
        return max(self.times)


def rss() -> int:
    """Resident memory of this process, in bytes (``/proc/self/statm``)."""
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def release_free_memory() -> None:
    """Hand memory the allocator keeps after frees back to the OS (glibc ``malloc_trim``),
    so that a run's RSS baseline is honest and its peak is not hidden by reused pages."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class PeakRSS:
    """Peak resident memory above the level at entry, sampled every ``interval`` seconds
    by a background thread (reads of ``/proc/self/statm`` cost microseconds)."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.base = 0
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self, fd: int, page: int) -> int:
        return int(os.pread(fd, 64, 0).split()[1]) * page

    def _loop(self) -> None:
        fd = os.open("/proc/self/statm", os.O_RDONLY)
        page = os.sysconf("SC_PAGE_SIZE")
        try:
            while not self._stop.is_set():
                self.peak = max(self.peak, self._sample(fd, page))
                self._stop.wait(self.interval)
            self.peak = max(self.peak, self._sample(fd, page))
        finally:
            os.close(fd)

    def __enter__(self) -> PeakRSS:
        self.base = self.peak = rss()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    @property
    def extra(self) -> int:
        return max(0, self.peak - self.base)


def measure(
    fn: Callable[[], object],
    repeats: int,
    setup: Callable[[], object] | None = None,
    teardown: Callable[[], object] | None = None,
) -> Measurement:
    """Like :func:`timed`, also sampling the peak extra RSS of each run.

    ``setup`` and ``teardown`` run untimed before and after each run; free memory is
    handed back to the OS before each baseline is taken.
    """
    times, peak = [], 0
    for _ in range(repeats):
        if setup is not None:
            setup()
        release_free_memory()
        with PeakRSS() as mem:
            start = time.perf_counter()
            result = fn()
            times.append(time.perf_counter() - start)
            del result  # freeing what fn returned is not part of its time
        peak = max(peak, mem.extra)
        if teardown is not None:
            teardown()
    return Measurement(times, peak)


def drop_page_cache(paths: list[str]) -> None:
    """Evict our own files (or every file under a folder) from the page cache, for cold
    reads, without root-only knobs."""
    for root in paths:
        if os.path.isdir(root):
            files = [os.path.join(d, f) for d, _, names in os.walk(root) for f in names]
        else:
            files = [root]
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class OtherLoad:
    """CPU time used by other processes on the machine while this is open, in cores
    (from ``/proc/stat`` minus this process and its waited-for children)."""

    def __init__(self) -> None:
        self.cores = 0.0

    @staticmethod
    def _busy() -> float:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _ours() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def __enter__(self) -> OtherLoad:
        self._start = (time.perf_counter(), self._busy(), self._ours())
        return self

    def __exit__(self, *exc: object) -> None:
        wall, busy, ours = self._start
        elapsed = time.perf_counter() - wall
        others = (self._busy() - busy) - (self._ours() - ours)
        self.cores = max(0.0, others / elapsed) if elapsed > 0 else 0.0


def _first_line(path: str) -> str:
    try:
        with open(path) as f:
            return f.readline().strip()
    except OSError:
        return ""


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def disk(path: str) -> str:
    """The file system and block device under ``path``, e.g. ``ext4 on /dev/vda (SSD)``."""
    best, fstype, source = "", "?", "?"
    real = os.path.realpath(path)
    try:
        with open("/proc/mounts") as f:
            for line in f:
                src, mnt, fs = line.split()[:3]
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best):
                    best, fstype, source = mnt, fs, src
    except OSError:
        return "unknown"
    kind = ""
    name = os.path.basename(source)
    if source.startswith("/dev/"):
        for block in (name, name.rstrip("0123456789").removesuffix("p")):
            rot = _first_line(f"/sys/block/{block}/queue/rotational")
            if rot:
                kind = f" (sysfs rotational={rot})"
                break
    return f"{fstype} on {source}{kind}"


def git_revision(root: str) -> str:
    try:
        rev = subprocess.run(
            ["git", "-C", root, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", root, "status", "--porcelain", "--", "src"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{rev} + uncommitted changes in src/" if dirty else rev


def source_digests(package_dir: str) -> dict[str, str]:
    """Each Python source of a package (relative path) -> a short digest of its bytes, to
    tell whether, and where, the code changed while a benchmark ran."""
    out = {}
    for root, _, files in os.walk(package_dir):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                with open(path, "rb") as f:
                    out[os.path.relpath(path, package_dir)] = hashlib.sha256(f.read()).hexdigest()
    return dict(sorted(out.items()))


def combined_digest(digests: dict[str, str]) -> str:
    return hashlib.sha256(repr(sorted(digests.items())).encode()).hexdigest()[:12]


def machine_info(tmpdir: str) -> dict[str, str]:
    """What the numbers were measured on, for the report."""
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "cpu": f"{os.cpu_count()} cores, {cpu_model()}",
        "torch threads": str(torch.get_num_threads()),
        "memory": f"{mem:.0f} GiB",
        "disk": f"{disk(tmpdir)}, temp folder {tmpdir}",
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, Python "
        f"{platform.python_version()}, torch {torch.__version__}"
    )


def rotated(items: list, shift: int) -> list:
    """``items`` starting at position ``shift``: each round puts each case at another place
    in the sequence, so that what one case leaves behind (a disk still busy with the
    previous write, a warm cache) does not always fall on the same next case."""
    k = shift % len(items) if items else 0
    return items[k:] + items[:k]
