"""The suite's part ``tiers``: the local tier (issue 37), the ``Benchmark`` section of
docs/tiers.md.

Two torchrun agents of ``--tier-nproc`` ranks each on 127.0.0.1 (``tiers_worker.py``),
each agent a node whose local folder is ``/dev/shm/<unique>/node_G``; the persistent
folder under ``--tmpdir``. The state: Linear layers + AdamW after one step (about
``--tier-mb`` MB in all), FSDP2 over every rank. Measured:

1. seconds ``save(step, tier="local")`` blocked, sync and ``async_save="overlap"``,
   beside a persistent overlap save in the same launch (each the slowest rank's, after
   one warm-up save);
2. from the ``save()`` call to ``wait_replicated()`` returning (every copy on its peer);
3. resume in a fresh launch, from the local tier, from a peer (node 1's folder deleted
   before the launch), from the persistent folder on a cold page cache and with DCP
   (``dcp.load`` + ``set_state_dict``) from a DCP checkpoint of the same state, cold:
   the restore call's seconds, and from the first worker's start (before importing
   torch) to the last rank's first training step done. Every worker checks that the
   state came from where it should (``report.source``), verified, and that it is the
   saved one, bit for bit (a digest of every rank's shards);
4. floors: one in-memory copy of a node's share of the state (numpy), the same bytes
   over a TCP socket on 127.0.0.1, and a cold read of the persistent checkpoint's files.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np

import common
import report
from report import kept, median, median_span, over, ratio, table

sys.path.insert(0, str(common.ROOT / "tests"))  # processes.py, which agents.py imports
sys.path.insert(0, str(common.ROOT / "tests" / "distributed"))
import agents

PAGE = common.ROOT / "docs" / "tiers.md"
WORKER = Path(__file__).with_name("tiers_worker.py")
MB, WIDTH, REPEATS, NODES, NPROC = 1024, 2048, 3, 2, 2
QUICK_NPROC = 1
SOURCES = ["local", "peer", "persistent", "dcp"]
QUICK_SOURCES = SOURCES[:3]  # --quick: a smoke test of ours; each launch costs seconds
SOURCE_LABELS = {
    "local": "ours: local tier (each node's own memory)",
    "peer": "ours: local tier, node 1's folder lost (from node 0's replica)",
    "persistent": "ours: persistent folder, cold page cache",
    "dcp": "DCP: dcp.load + set_state_dict, cold page cache",
}
SAVE_LABELS = {
    "local_overlap": 'local, async_save="overlap"',
    "local_sync": "local, sync",
    "persistent_overlap": 'persistent, async_save="overlap"',
}
BLOCKED_MS_PER_GB = 2.0  # targets of issue 37
RESUME_VS_COPY, LOCAL_VS_PERSISTENT = 1.5, 3.0


SECTION = report.PageSection("tiers-benchmark", PAGE, "# The local tier")


# Measuring ------------------------------------------------------------------------------


def _launch(work: Path, name: str, argv: list[str], nproc: int, timeout: float) -> list[dict]:
    """The worker (``argv``: its mode, ROOT, SHM, then options; OUT is put after them) on
    NODES agents of ``nproc`` ranks; every rank's record."""
    out = work / name
    agents.TIMEOUT_S = timeout
    env = {"TIERS_LAUNCHED": repr(time.time()), "PYTHONPATH": _pythonpath()}
    agents.launch(WORKER, NODES, [*argv[:3], str(out), *argv[3:]], work / "logs" / name, env,
                  nproc=nproc)  # fmt: skip
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank_*.json"))]


def _pythonpath() -> str:
    """The workers import this checkout's unbroken (src/) and the benchmarks' common."""
    paths = [str(common.ROOT / "src"), os.environ.get("PYTHONPATH", "")]
    return os.pathsep.join(p for p in paths if p)


def memory_copy(nbytes: int, repeats: int) -> list[float]:
    """One copy of ``nbytes`` into preallocated memory (numpy), its pages touched first."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    return common.repeat(lambda: np.copyto(dst, src), repeats)


def loopback(nbytes: int, repeats: int) -> list[float]:
    """``nbytes`` sent over a TCP socket on 127.0.0.1 into a preallocated buffer."""
    data = np.ones(nbytes, dtype=np.uint8)
    sink = bytearray(1 << 24)
    times = []
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        sender = socket.create_connection(server.getsockname())
        receiver, _ = server.accept()
        with sender, receiver:

            def receive() -> None:
                view, left = memoryview(sink), nbytes
                while left:
                    left -= receiver.recv_into(view[: min(left, len(sink))])

            for _ in range(repeats + 1):  # the first: a warm-up
                thread = threading.Thread(target=receive)
                start = time.perf_counter()
                thread.start()
                sender.sendall(memoryview(data))
                thread.join()
                times.append(time.perf_counter() - start)
    return times[1:]


def cold_read(folder: Path, repeats: int) -> list[float]:
    """Every file of ``folder`` read once, its pages evicted first."""
    return common.repeat(
        lambda: common.warm_cache([str(folder)]), repeats, None,
        lambda: common.drop_page_cache([str(folder)]),
    )  # fmt: skip


def _files_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def measure(args: argparse.Namespace, log) -> dict:
    """The part's figures, as ``--results`` keeps them (and ``--render`` reads)."""
    (mb,), width, repeats = common.scale(args, [args.tier_mb], WIDTH, REPEATS)
    nproc = QUICK_NPROC if args.quick else args.tier_nproc
    info = common.machine_info(args.tmpdir)
    info["local folders"] = f"{common.disk('/dev/shm')}, /dev/shm"
    timeout = 120 + 300 * mb / 1024
    shm = Path("/dev/shm") / f"ub-tiers-{uuid.uuid4().hex[:8]}"
    work = Path(tempfile.mkdtemp(prefix="ub-tiers-", dir=args.tmpdir))
    root = work / "ckpt"
    base = [str(root), str(shm / "live")]
    size = ["--mb", str(mb), "--width", str(width)]
    other = common.OtherLoad().__enter__()
    try:
        log(f"\n== tiers: {mb:.0f} MB, {NODES} agents x {nproc} ranks, {repeats} runs")
        started = time.perf_counter()
        saved = _launch(work, "saved", ["save", *base, *size, "--repeats", str(repeats)],
                        nproc, timeout)  # fmt: skip
        log(f"  saves: {time.perf_counter() - started:.0f} s")
        nbytes = sum(r["bytes"] for r in saved)
        saves = {
            key: [
                max(r["times"][key][i] for r in saved) for i in range(len(saved[0]["times"][key]))
            ]
            for key in saved[0]["times"]
        }  # each run: its slowest rank
        shutil.copytree(shm / "live", shm / "pristine")
        resumes: dict[str, dict[str, list[float]]] = {s: {} for s in SOURCES}
        for i in range(repeats):
            for source in common.rotated(QUICK_SOURCES if args.quick else SOURCES, i):
                shutil.rmtree(shm / "live", ignore_errors=True)
                shutil.copytree(shm / "pristine", shm / "live")
                if source == "peer":
                    shutil.rmtree(shm / "live" / "node_1")
                if source in ("persistent", "dcp"):
                    common.drop_page_cache(
                        [str(root / ("full" if source == "persistent" else "dcp"))]
                    )
                recs = _launch(work, f"resume_{source}_{i}",
                               ["resume", *base, *size, "--source", source], nproc, timeout)  # fmt: skip
                start = min(r["started"] for r in recs)
                fig = resumes[source]
                for key, value in (
                    ("restore", max(r["restore"] for r in recs)),
                    ("first_step", max(r["first_step"] for r in recs) - start),
                    ("launch_to_first_step", max(r["first_step"] for r in recs) - recs[0]["launched"]),
                    ("import", max(r["imported"] - r["started"] for r in recs)),
                    ("build", max(r["built"] - r["imported"] for r in recs)),
                    ("checkpointer", max(r["made"] - r["built"] for r in recs)),
                    ("step", max(r["step_s"] for r in recs)),
                    *((k, max(r["spent"][k] for r in recs))
                      for k in ("check_copies", "read_verify") if k in recs[0]["spent"]),
                ):  # fmt: skip
                    if key != "checkpointer" or source != "dcp":
                        fig.setdefault(key, []).append(value)
                log(f"  resume from {source}: restore {fig['restore'][-1]:.3f} s, first step "
                    f"{fig['first_step'][-1]:.2f} s after the start")  # fmt: skip
        node_bytes = nbytes // NODES
        floors = {
            "memory_copy": memory_copy(node_bytes, max(repeats, 3)),
            "loopback": loopback(node_bytes, max(repeats, 3)),
            "disk_cold_read": cold_read(root / "full", max(repeats, 1)),
        }
        disk_bytes = _files_bytes(root / "full")
    finally:
        other.__exit__()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return {"info": info, "mb": mb, "width": width, "nbytes": nbytes, "node_bytes": node_bytes,
            "disk_bytes": disk_bytes, "nodes": NODES, "nproc": nproc, "repeats": repeats,
            "saves": saves, "resumes": resumes, "floors": floors,
            "other_load": other.cores}  # fmt: skip


# Rendering ------------------------------------------------------------------------------


def _secs(xs: list[float], digits: int = 3) -> tuple[str, str]:
    return median_span(xs, digits) if xs else ("-", "-")


def _ms(xs: list[float]) -> tuple[str, str]:
    return _secs([x * 1000 for x in xs], 1)


def _verdict(value: float | None, limit: float, higher: bool = False) -> str:
    if value is None:
        return "n/a"
    met = value >= limit if higher else value <= limit
    return "met" if met else f"missed ({value:.2f} vs {limit:g})"


def _targets(data: dict) -> list[list[str]]:
    saves, resumes, floors = data["saves"], data["resumes"], data["floors"]
    gb = data["nbytes"] / 1e9
    local = median(saves.get("local_overlap.blocked"))
    persistent = median(saves.get("persistent_overlap.blocked"))
    copy = median(floors["memory_copy"])
    rows = []
    per_gb = None if local is None else local * 1000 / gb
    rows.append(["local overlap save blocked <= persistent overlap save blocked",
                 f"{local * 1000:.1f} ms vs {persistent * 1000:.1f} ms" if local and persistent else "-",
                 _verdict(over(local, persistent), 1.0)])  # fmt: skip
    rows.append([f"local overlap save blocked <= {BLOCKED_MS_PER_GB:g} ms/GB",
                 "-" if per_gb is None else f"{per_gb:.2f} ms/GB",
                 _verdict(per_gb, BLOCKED_MS_PER_GB)])  # fmt: skip
    for key, what in (("restore", "restore() call"), ("first_step", "start to first step")):
        x = over(median(resumes["local"].get(key)), copy)
        rows.append([f"local resume ({what}) <= {RESUME_VS_COPY:g}x the memory copy",
                     report.factor(x), _verdict(x, RESUME_VS_COPY)])  # fmt: skip
    for key, what in (("restore", "restore() call"), ("first_step", "start to first step")):
        x = over(median(resumes["persistent"].get(key)), median(resumes["local"].get(key)))
        rows.append([f"local resume ({what}) >= {LOCAL_VS_PERSISTENT:g}x faster than persistent cold",
                     report.factor(x), _verdict(x, LOCAL_VS_PERSISTENT, higher=True)])  # fmt: skip
    return rows


def _tables(data: dict) -> str:
    saves, resumes, floors = data["saves"], data["resumes"], data["floors"]
    gb = data["nbytes"] / 1e9
    base = median(saves.get("persistent_overlap.blocked"))
    save_rows = []
    for key, label in SAVE_LABELS.items():
        blocked = saves.get(f"{key}.blocked", [])
        until = saves.get(f"{key}.replicated") or saves.get(f"{key}.committed", [])
        m = median(blocked)
        save_rows.append([label, *_ms(blocked), "-" if m is None else f"{m * 1000 / gb:.2f}",
                          ratio(m, base), *_secs(until),
                          "replicated" if key.startswith("local") else "committed",
                          _ms(saves.get(f"{key}.first_blocked", []))[0]])  # fmt: skip
    copy, local_first = median(floors["memory_copy"]), median(resumes["local"].get("first_step"))
    local_restore = median(resumes["local"].get("restore"))
    resume_rows, parts_rows = [], []
    for source in SOURCES:
        fig = resumes[source]
        r, f = fig.get("restore", []), fig.get("first_step", [])
        resume_rows.append([SOURCE_LABELS[source], *_secs(r), ratio(median(r), local_restore),
                            ratio(median(r), copy), *_secs(f), ratio(median(f), local_first),
                            _secs(fig.get("launch_to_first_step", []))[0]])  # fmt: skip
        parts_rows.append([SOURCE_LABELS[source],
                           *(_secs(fig.get(k, []))[0] for k in (
                               "import", "build", "checkpointer", "restore", "check_copies",
                               "read_verify", "step"))])  # fmt: skip
    floor_rows = []
    for key, label, n in (
        ("memory_copy", "one copy in memory (numpy), a node's share", data["node_bytes"]),
        ("loopback", "TCP on 127.0.0.1, a node's share", data["node_bytes"]),
        ("disk_cold_read", "cold read of the persistent checkpoint's files", data["disk_bytes"]),
    ):
        xs = floors[key]
        floor_rows.append([label, f"{n / 1e9:.3f}", *_secs(xs), f"{n / median(xs) / 1e9:.2f}"])
    return "\n".join([
        table(["save", "blocked ms", "min-max ms", "ms/GB", "x persistent overlap",
               "until copies are safe s", "min-max s", "safe =", "first save blocked ms"],
              save_rows), "",
        table(["resume (fresh launch)", "restore() s", "min-max s", "x local", "x memory copy",
               "start to first step s", "min-max s", "x local", "launch to first step s"],
              resume_rows), "",
        table(["resume: where the time goes (medians, slowest rank)", "import s",
               "init + build s", "Checkpointer() s", "restore() s", "of which copies checked s",
               "of which read + verify s", "first step s"], parts_rows), "",
        table(["floor", "GB", "median s", "min-max s", "GB/s"], floor_rows), "",
        table(["target (issue 37)", "this run", "verdict"], _targets(data)),
    ])  # fmt: skip


def render(data: dict, *, markdown: bool) -> str:
    head = (f"{data['nbytes'] / 1e9:.2f} GB of state, {data['nodes']} agents x {data['nproc']} "
            f"ranks (FSDP2), median of {data['repeats']} runs")  # fmt: skip
    text = _tables(data)
    if not markdown:
        return (
            f"== tiers: {head}; other processes' CPU use meanwhile: "
            f"{data['other_load']:.2f} cores\n\n{text}"
        )
    return "\n".join([
        f"## Benchmark\n\n{head}. Generated by `{data['command']}`; only this section "
        f"({data['elapsed'] / 60:.1f} minutes in all).\n",
        "Two torchrun agents on 127.0.0.1 stand for two nodes, each with its own local "
        "folder under /dev/shm; the persistent folder is on the disk below. Saves: the "
        "slowest rank's seconds, after one warm-up save each; *until copies are safe*: "
        "from the `save()` call to `wait_replicated()` (local) or `wait()` (persistent) "
        "returning. Resumes: a fresh launch each; *restore() s* is the slowest rank's "
        "restore call (DCP: `get_state_dict`, `dcp.load`, `set_state_dict`), *start to "
        "first step* runs from the first worker's start (before `import torch`) to the "
        "last rank's first training step done, *launch* from the agents' start. Each "
        "worker checks where the state came from (`report.source`, verified) and that it "
        "is the saved state bit for bit. The second table splits the slowest rank's time "
        "into its phases: *init + build* includes `init_process_group` (waiting for the "
        "slowest rank's import) and the FSDP2 model; *copies checked* is the local tier's "
        "pass over every copy a node holds (`_check_copies`: only after a read found "
        "damage, since 2026-11-28; `-` when it did not run), *read + verify* the restore "
        "proper (`restoring.restore`). Floors: a node's share of the state, as a node "
        "restores it. Machine:\n",
        *report.bullets(data["info"]),
        f"- other processes' CPU use meanwhile (average busy cores): {data['other_load']:.2f}",
        "", text, "",
        kept("tiers-notes", PAGE),
    ]).rstrip() + "\n"  # fmt: skip
