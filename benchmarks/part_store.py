"""The suite's part ``store``: save and restore to an S3 API on loopback (moto's server)
against local disk, the ``object-store`` section of docs/benchmarks.md.

moto runs in a process of its own (``python -m moto.server``) so that its request
handling does not share this process's GIL; it keeps objects in memory, so the S3
numbers measure the client side (request handling, part uploads, ranged reads, the
protocol's extra requests) over loopback HTTP, not a real network or a real store.
Rows: our save and restore on local disk (the baseline of the ratios), the same on S3,
and the raw floor of the store (s3fs writing and reading the same bytes as one object).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time

import common
import contenders
import report
import unbroken as ub

SECTION = report.Section("object-store")
MB, REPEATS = 300, 5


@contextlib.contextmanager
def moto_server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
    )  # fmt: skip
    for _ in range(200):
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            break
        time.sleep(0.05)
    try:
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def ours(url: str, model, opt, repeats: int) -> tuple[list[float], list[float]]:
    """Seconds of our saves to ``url``, then of restores from it into fresh objects (each
    by a new Checkpointer, built untimed; a local folder's files evicted first)."""
    ckpt = ub.Checkpointer(url, model=model, optimizer=opt, keep_last=1)
    steps = iter(range(1, 10_000))
    saves = common.repeat(lambda: ckpt.save(next(steps)), repeats)
    ckpt.close()
    fresh: list = []

    def build() -> None:
        if not url.startswith("s3://"):
            common.drop_page_cache([url])
        m, o = common.fresh_like(model)
        fresh[:] = [ub.Checkpointer(url, model=m, optimizer=o)]

    return saves, common.repeat(lambda: fresh[0].restore(), repeats, None, build)


def measure(args: argparse.Namespace, log) -> dict:
    """The part's figures, as ``--results`` keeps them (and ``--render`` reads)."""
    import fsspec

    (mb,), width, repeats = common.scale(args, [args.store_mb], 2048, REPEATS)
    info = common.machine_info(args.tmpdir)
    model, opt = common.build_state(mb, width)
    results: dict[str, list[float]] = {}
    log(f"\n== object store: {common.state_bytes(model, opt) / 1e9:.2f} GB, {repeats} runs")
    with tempfile.TemporaryDirectory(prefix="unbroken-bench-s3-", dir=args.tmpdir) as tmp, \
            moto_server(), common.OtherLoad() as load:  # fmt: skip
        fs = fsspec.filesystem("s3")
        fs.mkdir("bench")
        for where, url in (("local disk", f"{tmp}/run"), ("S3 (moto, loopback)", "s3://bench/run")):
            results[f"save: {where}"], results[f"restore: {where}"] = ours(url, model, opt, repeats)
        blob = b"".join(
            contenders.raw_bytes(t.contiguous()).tobytes() for t in common.state_tensors(model, opt)
        )
        results["floor: s3fs pipe_file (one object)"] = common.repeat(
            lambda: fs.pipe_file("bench/raw.bin", blob), repeats
        )
        results["floor: s3fs cat_file (one object)"] = common.repeat(
            lambda: fs.cat_file("bench/raw.bin"), repeats
        )
        # moto reads a whole object to answer a range of it: what each of a restore's
        # ranged reads costs here (a real store serves ranges without that).
        results["moto: one 16 MiB range of that object"] = common.repeat(
            lambda: fs.cat_file("bench/raw.bin", start=0, end=16 << 20), repeats
        )
    part_mb = os.environ.get("UNBROKEN_STORE_PART_MB", "32")
    flight = os.environ.get("UNBROKEN_STORE_CONCURRENCY", "8")
    return {"info": info, "nbytes": common.state_bytes(model, opt), "repeats": repeats, "load": load.cores,
            "parts": f"{part_mb} MiB, {flight} in flight per rank", "results": results}  # fmt: skip


def render(data: dict, *, markdown: bool = True) -> str:
    """The section (markdown; it is what the part prints too)."""
    results, nbytes = data["results"], data["nbytes"]
    base = {"save": report.median(results["save: local disk"]),
            "restore": report.median(results["restore: local disk"])}  # fmt: skip
    rows = []
    for name, times in results.items():
        med = report.median(times)
        kind = "save" if "save" in name or "pipe" in name else "restore"  # the ratio's base
        size, x_local = (
            (16 << 20, "-") if name.startswith("moto:") else (nbytes, report.ratio(med, base[kind]))
        )
        rows.append([name, *report.median_span(times), f"{size / med / 1e9:.2f}", x_local])
    return "\n".join([
        f"## Object store (S3 API on loopback) vs local disk, {nbytes / 1e9:.2f} GB, "
        f"median of {data['repeats']} runs", "",
        f"Generated by `{data['command']}`; only this section. "
        "moto keeps objects in memory in a process of its own: the S3 rows measure the "
        "client side (parts, ranged reads, the commit protocol's requests) over loopback "
        "HTTP, not a network or a real store. moto also reads a whole object to answer "
        "each ranged GET of it (last row), which a restore issues once per tensor chunk: "
        "that, not the client, dominates the S3 restore row. Local restores read a cold "
        "page cache. *x local* divides by our own save (or restore) to local disk in the "
        "same run.", "",
        *report.bullets(data["info"]),
        f"- other processes' CPU use meanwhile (average busy cores): {data['load']:.2f}",
        f"- parts: {data['parts']}", "",
        report.table(["what", "median s", "min-max s", "GB/s", "x local"], rows),
    ])  # fmt: skip
