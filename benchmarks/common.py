"""What every benchmark shares: the training state, timing, memory, the page cache and the
machine it runs on (tables and pages: ``report.py``; the ways to save: ``contenders.py``)."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import datetime
import hashlib
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import torch
from torch import nn
from torch.distributed.tensor import DTensor

import unbroken as ub

ROOT = Path(__file__).resolve().parent.parent
QUICK_MB, QUICK_WIDTH = 4.0, 256  # --quick: a tiny state, in every part

# The training state ---------------------------------------------------------------------


def layer_count(total_mb: float, width: int = 2048, bias: bool = False) -> int:
    """Linear(width, width) layers whose weights and AdamW moments make ``total_mb``."""
    return max(1, round(total_mb * 1e6 / ((width * width + width * bias) * 4 * 3)))


def linears(total_mb: float, width: int = 2048, bias: bool = False) -> nn.Sequential:
    """Those layers, on the default device (``with torch.device("meta")``: no memory)."""
    layers = layer_count(total_mb, width, bias)
    return nn.Sequential(*(nn.Linear(width, width, bias=bias) for _ in range(layers)))


def build_state(
    total_mb: float, width: int = 2048, device: torch.device | None = None, *, bias: bool = False
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """nn.Linear layers + AdamW (fused on CUDA) after one step on ``device``: parameters,
    ``exp_avg`` and ``exp_avg_sq`` (about 3x the parameters)."""
    device = device or torch.device("cpu")
    torch.manual_seed(0)
    with device:
        model = linears(total_mb, width, bias)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=device.type == "cuda")
        for p in model.parameters():
            p.grad = torch.randn_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    synchronize(device)
    return model, opt


def fresh_like(model: nn.Module, seed: int = 1) -> tuple[nn.Module, torch.optim.Optimizer]:
    """What a resumed process builds before ``restore()``: the same architecture freshly
    initialized (another seed) and an AdamW without state (its moments do not exist yet)."""
    layers = [m for m in model.modules() if isinstance(m, nn.Linear)]
    torch.manual_seed(seed)
    fresh = nn.Sequential(
        *(nn.Linear(m.in_features, m.out_features, bias=m.bias is not None) for m in layers)
    )
    return fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-3)


def state_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of the training state: parameters, then the optimizer's moments."""
    out = [p.detach() for p in model.parameters()]
    return out + [t for s in opt.state.values() for t in s.values() if t.dim() > 0]


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of every tensor of the training state (of a DTensor: this rank's shard)."""
    tensors = [*model.parameters(), *(t for s in opt.state.values() for t in s.values())]
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors if torch.is_tensor(t)]
    return sum(t.numel() * t.element_size() for t in local)


def scale(
    args: argparse.Namespace, sizes: list[float], width: int, runs: int, quick_runs: int = 1
) -> tuple[list[float], int, int]:
    """The state sizes (MB), Linear width and runs a part measures: with ``--quick`` the
    tiny state and ``quick_runs``, else ``sizes``; ``--width``, ``--repeats`` where given."""
    if args.quick:
        return [QUICK_MB], args.width or QUICK_WIDTH, quick_runs
    return sizes, args.width or width, args.repeats or runs


# Timing and memory ----------------------------------------------------------------------


def synchronize(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def repeat(
    fn: Callable[[], object],
    runs: int,
    device: torch.device | None = None,
    setup: Callable[[], object] | None = None,
) -> list[float]:
    """Seconds of ``runs`` calls of ``fn``, the device synchronized before and after each
    (``setup`` untimed, before each)."""
    times = []
    for _ in range(runs):
        if setup is not None:
            setup()
        times.append(seconds(fn, device))
    return times


def seconds(fn: Callable[[], object], device: torch.device | None = None) -> float:
    """Seconds of one call of ``fn``, the device synchronized before and after."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


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


@dataclasses.dataclass
class Case:
    """One path a benchmark runs once per round: ``fn`` timed, with its peak extra RSS;
    ``setup`` and ``teardown`` untimed around it (free memory is handed back to the OS
    before the baseline); ``barrier``, a multi-rank run's, before the clock starts and
    again before it stops, so that the slowest rank decides. A failure is recorded, and
    the case is not run again."""

    key: str
    label: str
    fn: Callable[[], object]
    setup: Callable[[], object] | None = None
    teardown: Callable[[], object] | None = None
    barrier: Callable[[], object] = lambda: None
    times: list[float] = dataclasses.field(default_factory=list)
    peak: int = 0
    error: str | None = None

    def run_once(self) -> None:
        if self.error is not None:
            return
        try:
            if self.setup is not None:
                self.setup()
            release_free_memory()
            self.barrier()
            with PeakRSS() as mem:
                start = time.perf_counter()
                result = self.fn()
                self.barrier()
                self.times.append(time.perf_counter() - start)
                del result  # freeing what fn returned is not part of its time
            self.peak = max(self.peak, mem.extra)
            if self.teardown is not None:
                self.teardown()
        except Exception as exc:
            self.error = one_line(exc)
            traceback.print_exc()
            print(f"  {self.label} failed: {self.error}", file=sys.stderr, flush=True)


def run_rounds(groups: list[list[Case]], repeats: int, log: Callable[[str], None]) -> None:
    """``repeats`` rounds: each runs every case once, group after group, each group
    rotated by one place per round (:func:`rotated`)."""
    for i in range(repeats):
        started = time.perf_counter()
        for group in groups:
            for case in rotated(group, i):
                case.run_once()
        log(f"  round {i + 1}/{repeats}: {time.perf_counter() - started:.1f} s")


def torchrun(
    script: str | os.PathLike, ranks: int, args: list[str], timeout: float, env: dict | None = None
) -> subprocess.CompletedProcess:
    """``script args`` on ``ranks`` processes of this machine (``torch.distributed.run
    --standalone``), one torch thread each; its output captured."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    cmd += [str(ranks), str(script), *args]
    env = {**(os.environ if env is None else env), "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def exit_at_once(code: int = 0) -> NoReturn:
    """End a torchrun worker whose results are written, skipping the interpreter's
    finalization: gloo's threads outlive ``destroy_process_group``, and one releasing a
    tensor then aborts the process (SIGABRT; docs/pitfalls.md)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def rss(*, children: bool = False) -> int:
    """Resident memory of this process, in bytes (``/proc/self/statm``); with
    ``children``, plus the private memory of its children (:func:`children_anon`)."""
    with open("/proc/self/statm", "rb") as f:
        own = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return own + (children_anon() if children else 0)


def children_anon() -> int:
    """Private anonymous memory (RssAnon) of this process's children, in bytes: a peer's
    writer process. Their shared memory is not added (this process maps it too)."""
    total = 0
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            for pid in Path(f"/proc/self/task/{task}/children").read_text().split():
                with contextlib.suppress(OSError, StopIteration):
                    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
                    total += int(next(x for x in lines if x.startswith("RssAnon:")).split()[1])
    return total * 1024


def release_free_memory() -> None:
    """Hand memory the allocator keeps after frees back to the OS (glibc ``malloc_trim``),
    so that a run's RSS baseline is honest and its peak is not hidden by reused pages."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class PeakRSS:
    """Peak resident memory above the level at entry, sampled every ``interval`` seconds
    by a background thread (reads of ``/proc/self/statm`` cost microseconds); with
    ``children``, plus the private memory of this process's children."""

    def __init__(self, interval: float = 0.002, *, children: bool = False) -> None:
        self.interval, self.children = interval, children
        self.base = self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self, fd: int, page: int) -> int:
        own = int(os.pread(fd, 64, 0).split()[1]) * page
        return own + (children_anon() if self.children else 0)

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
        self.base = self.peak = rss(children=self.children)
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


class OtherLoad:
    """CPU time used by other processes on the machine while this is open, in cores
    (from ``/proc/stat`` minus this process and its waited-for children)."""

    cores = 0.0

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


def rotated(items: list, shift: int) -> list:
    """``items`` starting at position ``shift``: each round puts each case at another place
    in the sequence, so that what one case leaves behind (a disk still busy with the
    previous write, a warm cache) does not always fall on the same next case."""
    k = shift % len(items) if items else 0
    return items[k:] + items[:k]


def one_line(exc: BaseException) -> str:
    """The error's type and the last line of its message (a writer process sends its
    whole traceback), at most 200 characters."""
    lines = [x.strip() for x in str(exc).splitlines() if x.strip()] or [""]
    return f"{type(exc).__name__}: {lines[-1]}"[:200]


# The page cache -------------------------------------------------------------------------


def _files(root: str | os.PathLike) -> list[str]:
    if os.path.isdir(root):
        return [os.path.join(d, f) for d, _, names in os.walk(root) for f in names]
    return [str(root)]


def drop_page_cache(paths: list[str]) -> None:
    """Evict our own files (or every file under a folder) from the page cache, for cold
    reads, without root-only knobs: fsync, then ``posix_fadvise(DONTNEED)``."""
    for path in (f for root in paths for f in _files(root)):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_cache(paths: list[str]) -> None:
    """Read every file once, so the next read finds it cached."""
    for path in (f for root in paths for f in _files(root)):
        with open(path, "rb") as fh:
            while fh.read(1 << 24):
                pass


# The machine and the code ---------------------------------------------------------------


def _first_line(path: str) -> str:
    try:
        with open(path) as f:
            return f.readline().strip()
    except OSError:
        return ""


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
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
    kind, name = "", os.path.basename(source)
    if source.startswith("/dev/"):
        for block in (name, name.rstrip("0123456789").removesuffix("p")):
            rot = _first_line(f"/sys/block/{block}/queue/rotational")
            if rot:
                kind = f" (sysfs rotational={rot})"
                break
    return f"{fstype} on {source}{kind}"


def gpu_info(device: torch.device) -> dict[str, str]:
    if device.type != "cuda":
        return {"gpu": "none: this run used the CPU"}
    name, driver = torch.cuda.get_device_name(device), "unknown"
    try:
        lines = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout.splitlines()
        name, driver = (x.strip() for x in lines[device.index or 0].split(",", 1))
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        pass
    return {"gpu": name, "driver": driver, "cuda": str(torch.version.cuda)}


def machine_info(
    tmpdir: str, device: torch.device | None = None, sources: dict[str, str] | None = None
) -> dict[str, str]:
    """What the numbers were measured on (the GPU too on CUDA), and the code they measured:
    ``version, revision R, sources D`` (D: a digest of ``sources``, :func:`source_digests`)."""
    digests = sorted((sources or source_digests()).items())
    digest = hashlib.sha256(repr(digests).encode()).hexdigest()[:12]
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    gpu = gpu_info(device) if device is not None else {}
    return {
        "date": date,
        **gpu,
        "cpu": f"{os.cpu_count()} cores, {cpu_model()}",
        "torch threads": str(torch.get_num_threads()),
        "memory": f"{mem:.0f} GiB",
        "disk": f"{disk(tmpdir)}, temp folder {tmpdir}",
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "unbroken": f"{ub.__version__}, revision {git_revision()}, sources {digest}",
    }


def git_revision(root: str | os.PathLike = ROOT) -> str:
    """The short commit, noting uncommitted changes in src/ (``UNBROKEN_REVISION`` where
    the tree was copied without its git folder)."""
    if os.environ.get("UNBROKEN_REVISION"):
        return os.environ["UNBROKEN_REVISION"]

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        rev, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "--", "src")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{rev} + uncommitted changes in src/" if dirty else rev


def source_digests() -> dict[str, str]:
    """Each Python source of the unbroken package measured -> a digest of its bytes, to
    tell whether, and where, the code changed while a benchmark ran."""
    package = Path(ub.__file__).parent
    return {
        str(p.relative_to(package)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(package.rglob("*.py"))
    }
