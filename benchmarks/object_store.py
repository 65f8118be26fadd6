"""Save and restore to an S3 API on loopback (moto's server) against local disk.

    python benchmarks/object_store.py [--mb 300] [--repeats 5] [--write-docs]

moto runs in a process of its own (``python -m moto.server``) so that its request
handling does not share this process's GIL; it keeps objects in memory, so the S3
numbers measure the client side (request handling, part uploads, ranged reads, the
protocol's extra requests) over loopback HTTP, not a real network or a real store.
Rows: our save and restore on local disk (the baseline of the ratios), the same on S3,
and the raw floor of the store (s3fs writing and reading the same bytes as one object).
``--write-docs`` replaces only this benchmark's section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

from common import (  # noqa: E402
    OtherLoad,
    build_state,
    drop_page_cache,
    fresh_like,
    git_revision,
    machine_info,
    state_bytes,
)
from docs_sections import OBJECT_STORE  # noqa: E402
from report import Report, bullets, median_span, ratio, table  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def moto_server():
    port = _free_port()
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
    )  # fmt: skip
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=endpoint,
    )  # fmt: skip
    for _ in range(200):
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            break
        time.sleep(0.05)
    try:
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _runs(fn, repeats: int, setup=None) -> list[float]:
    out = []
    for _ in range(repeats):
        arg = setup() if setup is not None else None
        start = time.perf_counter()
        fn(arg)
        out.append(time.perf_counter() - start)
    return out


def _counter():
    """setup() for _runs: the next step number each time (every save a new step)."""
    steps = iter(range(1, 10_000))
    return lambda: next(steps)


def measure(mb: float, repeats: int) -> tuple[dict[str, list[float]], int, float]:
    import fsspec

    import unbroken as ub

    model, opt = build_state(mb)
    nbytes = state_bytes(model, opt)
    results: dict[str, list[float]] = {}
    tmp = tempfile.mkdtemp(prefix="unbroken-bench-s3-")
    with moto_server(), OtherLoad() as load:
        fs = fsspec.filesystem("s3")
        fs.mkdir("bench")
        for where, url in (("local disk", f"{tmp}/run"), ("S3 (moto, loopback)", "s3://bench/run")):
            ckpt = ub.Checkpointer(url, model=model, optimizer=opt, keep_last=1)
            results[f"save: {where}"] = _runs(ckpt.save, repeats, _counter())
            ckpt.close()

            def fresh(url=url):
                if not url.startswith("s3://"):
                    drop_page_cache([str(p) for p in Path(url).rglob("*") if p.is_file()])
                m, o = fresh_like(model)
                return ub.Checkpointer(url, model=m, optimizer=o)

            results[f"restore: {where}"] = _runs(lambda c: c.restore(), repeats, fresh)
        blob = b"".join(
            t.detach().contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes()
            for t in list(model.parameters())
            + [v for s in opt.state.values() for v in s.values() if v.dim()]
        )
        results["floor: s3fs pipe_file (one object)"] = _runs(
            lambda _: fs.pipe_file("bench/raw.bin", blob), repeats
        )
        results["floor: s3fs cat_file (one object)"] = _runs(
            lambda _: fs.cat_file("bench/raw.bin"), repeats
        )
        # moto reads a whole object to answer a range of it: what each of a restore's
        # ranged reads costs here (a real store serves ranges without that).
        results["moto: one 16 MiB range of that object"] = _runs(
            lambda _: fs.cat_file("bench/raw.bin", start=0, end=16 << 20), repeats
        )
    return results, nbytes, load.cores


def render(results: dict[str, list[float]], nbytes: int, repeats: int, load: float) -> str:
    base = {
        "save": statistics.median(results["save: local disk"]),
        "restore": statistics.median(results["restore: local disk"]),
    }
    rows = []
    for name, times in results.items():
        med = statistics.median(times)
        kind = "save" if "save" in name or "pipe" in name else "restore"  # the ratio's base
        size, x_local = nbytes, ratio(med, base[kind])
        if name.startswith("moto:"):
            size, x_local = 16 << 20, "-"
        rows.append([name, *median_span(times), f"{size / med / 1e9:.2f}", x_local])
    info = machine_info(tempfile.gettempdir())
    import unbroken

    return "\n".join([
        f"## Object store (S3 API on loopback) vs local disk, {nbytes / 1e9:.2f} GB, "
        f"median of {repeats} runs",
        "",
        "Generated by `python benchmarks/object_store.py --write-docs`; only this section. "
        "moto keeps objects in memory in a process of its own: the S3 rows measure the "
        "client side (parts, ranged reads, the commit protocol's requests) over loopback "
        "HTTP, not a network or a real store. moto also reads a whole object to answer "
        "each ranged GET of it (last row), which a restore issues once per tensor chunk: "
        "that, not the client, dominates the S3 restore row. Local restores read a cold "
        "page cache. "
        "*x local* divides by our own save (or restore) to local disk in the same run.",
        "",
        *bullets(info),
        f"- unbroken: {unbroken.__version__}, revision {git_revision(str(HERE.parent))}",
        f"- other processes' CPU use meanwhile (average busy cores): {load:.2f}",
        f"- parts: {os.environ.get('UNBROKEN_STORE_PART_MB', '32')} MiB, "
        f"{os.environ.get('UNBROKEN_STORE_CONCURRENCY', '8')} in flight per rank",
        "",
        table(["what", "median s", "min-max s", "GB/s", "x local"], rows),
    ])  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    Report.add_options(parser, OBJECT_STORE, markdown=False)  # what it prints is markdown
    args = parser.parse_args()
    out = Report.from_args(args, OBJECT_STORE)
    results, nbytes, load = measure(args.mb, args.repeats)
    section = render(results, nbytes, args.repeats, load)
    out.publish(section, lambda: section)


if __name__ == "__main__":
    main()
