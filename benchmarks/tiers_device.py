"""The local tier in one process on one device (issue 37's GPU row): a local save's blocked
time beside a persistent one's, both with ``async_save="overlap"``, their time until the
copy is safe, and a restore from each into fresh objects, verified, in the same run.

    python benchmarks/tiers_device.py                  # cuda if there is one: 3.2 GB, 3 runs
    python benchmarks/tiers_device.py --device cpu --mb 200 --runs 2

One node (no replicas): the local folder is under --shm (/dev/shm), the persistent one
under --tmpdir. Prints the table (medians, min-max, ratios to the persistent tier's rows).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
import uuid
import warnings
from pathlib import Path

import torch

import common
import unbroken as ub
from report import bullets, median_span, ratio, table


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def measure(args: argparse.Namespace) -> dict[str, list[float]]:
    device = torch.device(args.device)
    model, opt = common.build_state(args.mb, args.width, device)
    root = Path(tempfile.mkdtemp(prefix="ub-tiers-", dir=args.tmpdir))
    shm = Path(args.shm) / f"ub-tiers-{uuid.uuid4().hex[:8]}"
    tier = ub.LocalTier(shm, replicas=0, keep_last=2)
    out: dict[str, list[float]] = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ckpt = ub.Checkpointer(root / "run", model=model, optimizer=opt, local=tier,
                                   async_save="overlap", keep_last=2)  # fmt: skip
        for step in range(1, args.runs + 2):  # the first of each: its buffers allocated
            for name, tier_name in (("local", "local"), ("persistent", "persistent")):
                s = 2 * step + (name == "local")
                blocked = _timed(lambda: ckpt.save(s, tier=tier_name))  # noqa: B023
                done = blocked + _timed(ckpt.wait)
                if step > 1:
                    out.setdefault(f"{name}.blocked", []).append(blocked)
                    out.setdefault(f"{name}.safe", []).append(done)
        ckpt.close()
        for name in ("local", "persistent"):
            for _ in range(args.runs):
                fresh, fresh_opt = common.fresh_like(model)
                fresh.to(device)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    again = ub.Checkpointer(root / "run", model=fresh, optimizer=fresh_opt,
                                            local=tier if name == "local" else None)  # fmt: skip
                common.synchronize(device)
                report = None

                def restore(again=again):
                    nonlocal report
                    report = again.restore()
                    common.synchronize(device)

                took = _timed(restore)
                assert report is not None and report.verified, report
                assert report.source == name, (name, report.source)
                again.close()
                out.setdefault(f"{name}.restore", []).append(took)
                del fresh, fresh_opt, again
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cuda = torch.cuda.is_available()
    parser.add_argument("--device", default="cuda" if cuda else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--mb", type=float, default=3220, help="state size (MB)")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tmpdir", default=tempfile.gettempdir(), help="the persistent tier")
    parser.add_argument("--shm", default="/dev/shm", help="where the local tier's folder goes")
    args = parser.parse_args()
    device = torch.device(args.device)
    info = common.machine_info(args.tmpdir, device if device.type == "cuda" else None)
    print(*bullets(info), sep="\n")
    figures = measure(args)
    rows = []
    for what, key in (("save blocked", "blocked"), ("save until safe", "safe"),
                      ("restore, verified", "restore")):  # fmt: skip
        base = figures["persistent." + key]
        for name in ("local", "persistent"):
            got = figures[f"{name}.{key}"]
            mid, span = median_span(got, 4)
            rows.append([f"{name}: {what}", mid, span, ratio(sorted(got)[len(got) // 2],
                         sorted(base)[len(base) // 2])])  # fmt: skip
    print(f"\n{args.mb:.0f} MB on {args.device}, median of {args.runs}:\n")
    print(table(["", "median s", "min-max s", "x persistent"], rows))


if __name__ == "__main__":
    main()
