"""What ``gpu.py`` measures on one device: the state, the floors, the saves, the restores.

The saves are the contenders of ``peers_contenders.py`` (ours in its three modes, DCP,
``torch.save``, torch-checkpointing), each timed by ``Contender.save``: ``blocked`` is the
call the training loop waits for, ``durable`` runs until the data is on disk (for a peer
that does not fsync, or not every folder, plus an fsync pass over its files and folders,
timed into ``durable``). Here the device is synchronized before each timed region; after
``blocked`` it is not (a synchronize would wait for a copy that runs behind training).
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import paths
import peers_contenders as pc
from common import drop_page_cache, rotated
from peers import warm_cache

Optim = torch.optim.Optimizer
TC_MISSING = "not installed"


def failure(exc: BaseException) -> str:
    """One line: the type and the last line of the message (a writer process's error
    carries its whole traceback)."""
    lines = [x.strip() for x in str(exc).splitlines() if x.strip()] or [""]
    return f"{type(exc).__name__}: {lines[-1]}"[:200]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(layers: int, width: int, device: torch.device) -> tuple[nn.Module, Optim]:
    """``layers`` x ``nn.Linear(width, width)`` on ``device`` and AdamW (fused on CUDA)
    after one step, so that both moments exist."""
    torch.manual_seed(0)
    with device:
        model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=device.type == "cuda")
        for p in model.parameters():
            p.grad = torch.randn_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    synchronize(device)
    return model, opt


def repeat(
    fn: Callable[[], object],
    runs: int,
    device: torch.device,
    setup: Callable[[], object] | None = None,
) -> list[float]:
    """Seconds of ``runs`` calls of ``fn``, the device synchronized before and after each
    (``setup`` untimed, before each)."""
    times = []
    for _ in range(runs):
        if setup is not None:
            setup()
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


# The floors ---------------------------------------------------------------------------


def floors(
    tensors: list[torch.Tensor], device: torch.device, folder: Path, runs: int
) -> dict[str, list[float] | str]:
    """One copy of the state to the host into pinned and into pageable memory (both
    allocated and touched beforehand), the write + fsync of its bytes from host memory,
    their read back into it with the page cache warm and cold, and the copy back to the
    device from pinned memory. Pinned memory needs CUDA: without it those are "n/a"."""
    cuda = device.type == "cuda"
    out: dict[str, list[float] | str] = {}
    pageable = [torch.zeros(t.shape, dtype=t.dtype) for t in tensors]  # zeros: touched
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors] if cuda else []

    def copy(dst: list[torch.Tensor], src: list[torch.Tensor], non_blocking: bool) -> None:
        for d, s in zip(dst, src, strict=True):
            d.copy_(s, non_blocking=non_blocking)

    na = "n/a (pinned memory needs CUDA)"
    out["pinned_d2h"] = repeat(lambda: copy(pinned, tensors, True), runs, device) if cuda else na
    out["pageable_d2h"] = repeat(lambda: copy(pageable, tensors, False), runs, device)
    host = pinned or pageable
    path = folder / "floor.bin"
    out["write_fsync"] = repeat(
        lambda: paths.write_raw(host, str(path)), runs, device, lambda: paths.clear(path)
    )
    out["read_warm"] = repeat(
        lambda: paths.read_raw(host, str(path)), runs, device, lambda: warm_cache(path)
    )
    out["read_cold"] = repeat(
        lambda: paths.read_raw(host, str(path)), runs, device,
        lambda: drop_page_cache([str(path)]),
    )  # fmt: skip
    if cuda:
        back = [torch.empty_like(t) for t in tensors]
        out["pinned_h2d"] = repeat(lambda: copy(back, pinned, True), runs, device)
        del back
    else:
        out["pinned_h2d"] = na
    paths.clear(path)
    return out


# The saves ----------------------------------------------------------------------------


class DcpSave(pc.DcpSave):
    """``dcp.save`` (its writer fsyncs each file) plus our fsync pass over the folder."""

    key, label, fsyncs = "dcp_save", "DCP: dcp.save (+ fsync pass)", False


class DcpAsync(pc.DcpAsync):
    key, label, fsyncs = "dcp_async", "DCP: dcp.async_save (defaults, + fsync pass)", False


class Overlap(pc.OursOverlap):
    """``async_save="overlap"``, also timing ``save()`` until its copy of the parameters
    and optimizer state is done on the device (what the next optimizer step waits for,
    less the forward and backward that run meanwhile)."""

    device = torch.device("cpu")
    copied: float | None = None

    def _save(self, path: Path) -> Callable[[], object]:
        start = time.perf_counter()
        self.ckpt.save(self.step)

        def done() -> None:
            settle = getattr(self.ckpt._saver, "settle", None)  # the step pre-hook's wait
            if settle is not None:
                settle()
                synchronize(self.device)
                self.copied = time.perf_counter() - start
            self.ckpt.wait()

        return done


class TcSync(pc.TcSync):
    label = "torch-checkpointing: sync save (+ fsync pass)"


class TcAsync(pc.TcAsync):
    """Its async save, also timing ``save()`` until its staging copy is done: its
    ``save()`` returns while the copy runs, and the state must not change before it ends
    (its saver compares the state before and after staging)."""

    label = "torch-checkpointing: async save (+ fsync pass)"
    device = torch.device("cpu")
    copied: float | None = None

    def _save(self, path: Path) -> Callable[[], object] | None:
        start = time.perf_counter()
        written = super()._save(path)

        def done() -> None:
            staging = getattr(self.manager, "_staging_future", None)
            if staging is not None:
                staging.result()
                synchronize(self.device)
                self.copied = time.perf_counter() - start
            if written is not None:
                written()

        return done


SAVES: list[type[pc.Contender]] = [
    pc.Ours, pc.OursAsync, Overlap, DcpSave, DcpAsync, pc.TorchSave, TcSync, TcAsync,
]  # fmt: skip
TC_KEYS = {TcSync.key, TcAsync.key}
# Each restore family reads the checkpoint of one save.
RESTORE_FROM = {"ours": pc.Ours.key, "dcp": DcpSave.key, "torch": pc.TorchSave.key,
                "tc": TcAsync.key}  # fmt: skip


def tc_installed() -> bool:
    return importlib.util.find_spec("torch_checkpointing") is not None


def save_runs(
    saves: list[type[pc.Contender]], model: nn.Module, opt: Optim, root: Path,
    device: torch.device, runs: int, log: Callable[[str], None],
) -> tuple[dict[str, dict[str, list[float]] | str], dict[str, Path]]:  # fmt: skip
    """Every save, once untimed-as-a-run (its first save, reported apart), then ``runs``
    rounds, the order rotated by one place per round. Returns key -> {"first_blocked",
    "blocked", "durable", "copied"} (or why not), and key -> the checkpoint its last save
    left on disk for the restores (the other saves' checkpoints are removed)."""
    out: dict[str, dict[str, list[float]] | str] = {}
    live: list[pc.Contender] = []
    for cls in saves:
        if cls.key in TC_KEYS and not tc_installed():
            out[cls.key] = TC_MISSING
            continue
        try:
            c = cls(root, model, opt)
            if isinstance(c, Overlap | TcAsync):
                c.device = device
            synchronize(device)
            first = c.save()
            c.clear()
        except Exception as exc:
            out[cls.key] = f"error: {failure(exc)}"
            log(f"  {cls.label}: {out[cls.key]}")
            continue
        live.append(c)
        out[cls.key] = {"first_blocked": [first.blocked], "blocked": [], "durable": [],
                        "copied": []}  # fmt: skip
    kept: dict[str, Path] = {}
    try:
        for i in range(runs):
            for c in rotated(live, i):
                row = out[c.key]
                if isinstance(row, str):
                    continue
                c.clear()
                try:
                    synchronize(device)
                    t = c.save()
                    synchronize(device)
                except Exception as exc:
                    out[c.key] = f"error: {failure(exc)}"
                    kept.pop(c.key, None)  # its checkpoint is gone: its restores say so
                    log(f"  {c.label}: {out[c.key]}")
                    continue
                row["blocked"].append(t.blocked)
                row["durable"].append(t.durable)
                if getattr(c, "copied", None) is not None:
                    row["copied"].append(c.copied)
                if c.key in RESTORE_FROM.values():
                    kept[c.key] = c.latest()
                else:
                    c.clear()  # only the checkpoints the restores read stay on disk
            log(f"  saves, round {i + 1}/{runs} done")
    finally:
        for c in live:
            c.close()
    return out, kept


# The restores -------------------------------------------------------------------------


def restore(family: str, path: Path, model: nn.Module, opt: Optim, device: torch.device) -> bool:
    """Read a checkpoint into the live ``model`` and ``opt``; True where the library
    verified what it restored (ours: always, or it raises)."""
    if family == "ours":
        return paths.ours_restore(str(path), model, opt).verified
    if family == "torch":
        state = torch.load(path, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        return False
    pc.restore(family, str(path), model, opt)
    return False


def restore_runs(
    kept: dict[str, Path], model: nn.Module, opt: Optim, device: torch.device, runs: int,
    log: Callable[[str], None],
) -> tuple[dict[str, list[float] | str], int]:  # fmt: skip
    """Each family restores ``runs`` times cold (every file of the checkpoint fsync'd and
    evicted from the page cache, ``POSIX_FADV_DONTNEED``) and warm (every file read once
    before). Returns "<family>_cold"/"<family>_warm" -> seconds (or why not), and how
    many of ours' restores were verified."""
    out: dict[str, list[float] | str] = {}
    verified = 0
    families = [f for f in RESTORE_FROM if RESTORE_FROM[f] in kept]
    for f in RESTORE_FROM:
        if f not in families:
            why = TC_MISSING if f == "tc" and not tc_installed() else "its save did not run"
            out[f"{f}_cold"] = out[f"{f}_warm"] = why
        else:
            pc.import_library(f)
            out[f"{f}_cold"], out[f"{f}_warm"] = [], []
    for i in range(runs):
        for f in rotated(families, i):
            path = kept[RESTORE_FROM[f]]
            for temp, setup in (("cold", drop_page_cache), ("warm", _warm)):
                key = f"{f}_{temp}"
                if isinstance(out[key], str):
                    continue
                setup([str(path)])
                synchronize(device)
                start = time.perf_counter()
                try:
                    ok = restore(f, path, model, opt, device)
                    synchronize(device)
                except Exception as exc:
                    out[key] = f"error: {failure(exc)}"
                    log(f"  restore {key}: {out[key]}")
                    continue
                out[key].append(time.perf_counter() - start)  # type: ignore[union-attr]
                verified += ok
        log(f"  restores, round {i + 1}/{runs} done")
    return out, verified


def _warm(where: list[str]) -> None:
    for p in where:
        warm_cache(Path(p))
