"""The suite's part ``peers``: ours side by side with its peers (issue 15, item 6), the
``peers`` section of docs/benchmarks.md.

Contenders (``contenders.py``): ours (sync ``save()``, verified; ``async_save="overlap"``
and ``True``), raw DCP (``dcp.save`` with 1 and 2 writer threads, ``dcp.async_save``),
``torch.save`` + fsync, and torch-checkpointing 0.1.1 in its documented CPU configuration
(sync, async, and async with its default O_DIRECT storage), in rounds (``rounds.py``).
Restores run in a fresh process (this file, run as a script) into fresh objects, timing
only the restore call; the cold restore also hashes every restored tensor (blake2b of its
bytes, with dtype, shape and stride) and the parent compares with the hashes of the
saved state: no tensor crosses processes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import common
import contenders
import rounds
from report import (
    Section,
    bullets,
    kept,
    median,
    median_span,
    ratio,
    runs,
    table,
    why_missed,
)

SECTION = Section("peers")
SIZES, WIDTH, REPEATS = [300, 1200], 2048, 5
CONTENDERS = [
    contenders.Ours, contenders.OursOverlap, contenders.OursAsync, contenders.DcpSave,
    contenders.DcpSave2, contenders.DcpAsync, contenders.TorchSave, contenders.TcSync,
    contenders.TcAsync, contenders.TcAsyncDirect,
]  # fmt: skip
SOURCES = {"ours": "ours", "dcp": "dcp_1", "torch": "torch_save", "tc": "tc_async"}
RESTORE_LABELS = {
    "ours": "ours: restore()",
    "dcp": "DCP load + set_state_dict",
    "torch": "torch.load + load_state_dict",
    "tc": "torch-checkpointing: load + load_state_dict",
}
BASELINE = {"sync": "ours", "async": "ours_overlap"}  # what "x ours" divides by
PEERS_TOPIC = "Peers side by side"  # the heading of the analysis that says why ours is behind


# The state's digest: what a restore must give back, bit for bit -----------------------


def _digest(t: torch.Tensor) -> str:
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    h = hashlib.blake2b(memoryview(data), digest_size=16).hexdigest()
    return f"{t.dtype}|{tuple(t.shape)}|{t.stride()}|{t.device}|{h}"


def digests(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, str]:
    """Every tensor of the model and optimizer state dicts -> dtype|shape|stride|device|
    blake2b of its bytes; non-tensors and param_groups -> repr."""
    out = {f"model.{k}": _digest(v) for k, v in model.state_dict().items()}
    sd = opt.state_dict()
    for i, state in sd["state"].items():
        for k, v in state.items():
            out[f"optim.{i}.{k}"] = _digest(v) if isinstance(v, torch.Tensor) else repr(v)
    out["optim.param_groups"] = repr(sd["param_groups"])
    return out


def compare(expected: dict[str, str], got: dict[str, str]) -> str:
    """``exact``, or what differed (the first few entries)."""
    fields = ("dtype", "shape", "stride", "device", "bytes")
    problems = [f"{k} missing" for k in expected if k not in got]
    problems += [f"{k} unexpected" for k in got if k not in expected]
    for k in expected.keys() & got.keys():
        if expected[k] != got[k]:
            a, b = expected[k].split("|"), got[k].split("|")
            what = [f for f, x, y in zip(fields, a, b, strict=False) if x != y] or ["value"]
            problems.append(f"{k} {'/'.join(what)}")
    if not problems:
        return "exact"
    problems.sort()
    more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
    return "; ".join(problems[:3]) + more


# Measuring ------------------------------------------------------------------------------


def restore_in_fresh_process(mb: float, width: int, expected: dict, timeout: float):
    """What ``rounds.run`` calls for each restore: this file in a new process."""

    def once(family: str, path: Path, temp: str) -> dict:
        cmd = [sys.executable, __file__, family, str(path), "--mb", str(mb), "--width", str(width)]
        if temp == "cold":
            cmd.append("--digest")
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise TimeoutError(f"restore did not finish within {timeout:.0f} s") from exc
        for line in reversed(done.stdout.splitlines()):
            if line.startswith("RESULT "):
                got = json.loads(line[len("RESULT ") :])
                correct = compare(expected, got["digests"]) if "digests" in got else None
                return {"seconds": got["seconds"], "peak": got["peak_extra"], "correct": correct}
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"exited {done.returncode}: {tail[0][:200]}")

    return once


def measure(args: argparse.Namespace, log) -> dict:
    """Every size's figures, as ``--results`` keeps them (and ``--render`` reads)."""
    cpu = torch.device("cpu")
    info = {**common.machine_info(args.tmpdir), "torch-checkpointing": contenders.tc_version()}
    sizes, width, repeats = common.scale(args, args.peer_sizes or SIZES, WIDTH, REPEATS)
    out = []
    for mb in sizes:
        model, opt = common.build_state(mb, width)
        nbytes = common.state_bytes(model, opt)
        log(f"\n== peers: state {nbytes / 1e9:.3f} GB, {repeats} rounds")
        once = restore_in_fresh_process(mb, width, digests(model, opt), 300 + 120 * nbytes / 1e9)
        root = Path(tempfile.mkdtemp(prefix="ub-peers-", dir=args.tmpdir))
        try:
            with common.OtherLoad() as other:
                fig, _ = rounds.run(CONTENDERS, SOURCES, (model, opt), root, repeats, cpu, once,
                                    log, memory=True)  # fmt: skip
        finally:
            shutil.rmtree(root, ignore_errors=True)
        out.append({"mb": mb, "nbytes": nbytes, "repeats": repeats, "figures": fig,
                    "other_load": other.cores})  # fmt: skip
    return {"info": info, "sizes": out}


# Rendering ------------------------------------------------------------------------------


def _secs(xs: list[float]) -> str:
    return "-" if not xs else "{} ({})".format(*median_span(xs))


def _mb(n: int, has: bool) -> str:
    return f"{max(0, n) / 1e6:.0f}" if has else "-"


def _error(fig: dict, key: str) -> str | None:
    v = fig.get(key, "not measured")
    return v.removeprefix("error: ") if isinstance(v, str) else None


def _verdict(correct: list[str]) -> str:
    wrong = [c for c in correct if c != "exact"]
    if not correct:
        return "-"
    return "exact" if not wrong else f"WRONG ({len(wrong)}/{len(correct)}): {wrong[0]}"


def _tables(fig: dict, notes: list[str]) -> str:
    saves = []
    for c in CONTENDERS:
        base = BASELINE[c.kind]
        blocked, durable = runs(fig, f"{c.key}.blocked"), runs(fig, f"{c.key}.durable")
        label, error = c.label, _error(fig, f"{c.key}.blocked")
        if error is not None:
            notes.append(f"{c.label}: failed on this machine, `{error}`.")
            label += f" [{len(notes)}]"
        elif not c.fsyncs:
            label += " *"
        ok = bool(blocked)
        fsync = _secs(runs(fig, f"{c.key}.fsync")) if not c.fsyncs else "in its save"
        saves.append([label, _secs(blocked), ratio(median(blocked), median(runs(fig, f"{base}.blocked"))),
                      _secs(durable), ratio(median(durable), median(runs(fig, f"{base}.durable"))),
                      fsync if ok else "-", _mb(max(runs(fig, f"{c.key}.peak"), default=0), ok),
                      _mb(sum(runs(fig, f"{c.key}.kept")), error is None)])  # fmt: skip
    restores = []
    for family, label in RESTORE_LABELS.items():
        cold, warm = runs(fig, f"{family}_cold"), runs(fig, f"{family}_warm")
        error = _error(fig, f"{family}_cold") or _error(fig, f"{family}_warm")
        if error is not None:
            notes.append(f"{label}: failed, `{error}`.")
            label += f" [{len(notes)}]"
        ok = bool(cold)
        restores.append([label, _secs(cold), ratio(median(cold), median(runs(fig, "ours_cold"))),
                         _secs(warm), ratio(median(warm), median(runs(fig, "ours_warm"))),
                         _mb(max(runs(fig, f"{family}_peak"), default=0), ok),
                         _verdict(runs(fig, f"{family}_correct"))])  # fmt: skip
    return "\n".join([
        table(["save", "blocked s", "x ours", "until durable s", "x ours", "fsync we added s",
               "peak extra MB", "kept MB"], saves), "",
        table(["restore (fresh process, fresh objects)", "cold s", "x ours", "warm s", "x ours",
               "peak extra MB", "correct"], restores),
    ])  # fmt: skip


def behind(fig: dict, nbytes: int) -> list[str]:
    """Every figure where a peer's median beats ours' (of the same kind), by how much
    (memory: by more than 8 MB and 2% of the state, below which it is Python objects)."""
    out, noise = [], max(8e6, 0.02 * nbytes)
    labels = {c.key: c.label for c in CONTENDERS}

    def slower(what: str, mine: list, theirs: list, who: str, us: str) -> None:
        a, b = median(mine), median(theirs)
        if a is not None and b is not None and 0 < b < a:
            out.append(f"{what}: {who} {b:.3f} s, {us} {a:.3f} s ({a / b:.2f}x, +{a - b:.3f} s)")

    def bigger(what: str, a: int, b: int, who: str, us: str) -> None:
        if b < a and a - b > noise:
            out.append(f"{what}: {who} {b / 1e6:.0f} MB, {us} {a / 1e6:.0f} MB "
                       f"(+{(a - b) / 1e6:.0f} MB)")  # fmt: skip

    for c in CONTENDERS:
        base = BASELINE[c.kind]
        if c.key.startswith("ours") or not runs(fig, f"{c.key}.blocked"):
            continue
        if not runs(fig, f"{base}.blocked"):
            continue
        for name in ("blocked", "durable"):
            what = "save blocked" if name == "blocked" else "save until durable"
            slower(what, runs(fig, f"{base}.{name}"), runs(fig, f"{c.key}.{name}"), c.label,
                   labels[base])  # fmt: skip
        for name, field in (("peak extra memory", "peak"), ("memory kept between saves", "kept")):
            a = max(runs(fig, f"{base}.{field}"), default=0)
            b = max(runs(fig, f"{c.key}.{field}"), default=0)
            bigger(f"save {name}", a, max(0, b), c.label, labels[base])
    ours = runs(fig, "ours_cold")
    for family, label in RESTORE_LABELS.items():
        if family == "ours" or not ours or not runs(fig, f"{family}_cold"):
            continue
        for temp in ("cold", "warm"):
            slower(f"restore {temp}", runs(fig, f"ours_{temp}"), runs(fig, f"{family}_{temp}"),
                   label, "ours")  # fmt: skip
        bigger("restore peak extra memory", max(runs(fig, "ours_peak")),
               max(runs(fig, f"{family}_peak")), label, "ours")  # fmt: skip
    return out


def render(data: dict, *, markdown: bool) -> str:
    out = []
    if markdown:
        out.append(f"## Peers side by side: ours, DCP, torch.save, torch-checkpointing "
                   f"(issue 15, item 6)\n\nGenerated by `{data['command']}`; only this section. "
                   f"Seconds: median (min-max) of the rounds; {data['elapsed'] / 60:.1f} "
                   "minutes in all.\n")  # fmt: skip
        out += bullets(data["info"])
    for size in data["sizes"]:
        notes: list[str] = []
        head = f"{size['nbytes'] / 1e9:.2f} GB, {size['repeats']} round" + "s" * (
            size["repeats"] > 1
        )
        load = f"other processes' CPU use meanwhile: {size['other_load']:.2f} cores"
        out.append(f"\n### {head}\n\n{load}\n" if markdown else f"\n== {head}; {load}")
        out.append(_tables(size["figures"], notes))
        out += ["", *(f"- [{i}] {n}" for i, n in enumerate(notes, 1))] if notes else []
        lines = behind(size["figures"], size["nbytes"])
        out.append(f"\nWhere ours is behind ({head}, from the medians):")
        out += [f"- {x}" for x in lines] or ["- nowhere"]
        out += [f"- {why_missed(PEERS_TOPIC)}"] if lines else []
    return "\n".join([*out, "", kept("peers-notes")] if markdown else out)


def _restore_worker() -> None:
    """A fresh process: fresh objects, only the restore call timed; prints ``RESULT``."""
    parser = argparse.ArgumentParser(description="one restore in a fresh process")
    parser.add_argument("family")
    parser.add_argument("path")
    parser.add_argument("--mb", type=float, required=True)
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--digest", action="store_true")
    args = parser.parse_args()
    with torch.device("meta"):
        like = common.linears(args.mb, args.width)
    model, opt = common.fresh_like(like)
    contenders.import_library(args.family)
    common.release_free_memory()
    with common.PeakRSS() as mem:
        start = time.perf_counter()
        contenders.restore(args.family, args.path, model, opt)
        seconds = time.perf_counter() - start
    out = {"seconds": seconds, "peak_extra": mem.extra}
    if args.digest:
        out["digests"] = digests(model, opt)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    _restore_worker()
