"""What verification costs: fingerprints and checksums as a share of save and restore.

    python benchmarks/verification_cost.py [--mb 300] [--repeats 5]

A save computes one fingerprint (``unbroken.format.fingerprint``) and one xxh3-128 checksum of
every tensor; a restore checks every chunk's checksum and verifies the installed values.
:func:`verification_times` times both over a whole state; ``save_restore.py`` reuses
:func:`fingerprint_all` and :func:`checksum_all`.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile

import torch
import xxhash

import unbroken as ub
from common import (
    Measurement,
    build_state,
    drop_page_cache,
    machine,
    measure,
    state_bytes,
    state_tensors,
)
from report import Report, median_span, table
from unbroken.format import fingerprint


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def fingerprint_all(tensors: list[torch.Tensor]) -> list[str]:
    """What a save (and again a restore) computes: every tensor's fingerprint."""
    return [fingerprint.fingerprint(t) for t in tensors]


def checksum_all(tensors: list[torch.Tensor]) -> list[str]:
    """What a save (and again a restore) computes: an xxh3-128 of every tensor's bytes."""
    return [xxhash.xxh3_128_hexdigest(_raw(t)) for t in tensors]


def verification_times(tensors: list[torch.Tensor], repeats: int) -> dict[str, Measurement]:
    """Seconds to fingerprint, and to checksum, every tensor once."""
    return {
        "fingerprints": measure(lambda: fingerprint_all(tensors), repeats),
        "checksums": measure(lambda: checksum_all(tensors), repeats),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mb", type=float, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    model, opt = build_state(args.mb)
    tensors = state_tensors(model, opt)
    nbytes = state_bytes(model, opt)
    root = tempfile.mkdtemp(prefix="ub-bench-")
    try:
        ckpt = ub.Checkpointer(root, model=model, optimizer=opt, keep_last=1)
        step = iter(range(1, 10_000))
        save = measure(lambda: ckpt.save(next(step)), args.repeats)
        ckpt.close()
        costs = verification_times(tensors, args.repeats)

        def restore() -> None:
            with ub.Checkpointer(root, model=model, optimizer=opt) as c:
                c.restore()

        restored = measure(restore, args.repeats, setup=lambda: drop_page_cache([root]))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    gb = nbytes / 1e9
    rows = []
    for name, m, share in [
        ("save (sync, verified)", save, ""),
        ("restore (cold, verified)", restored, ""),
        ("fingerprints, all tensors", costs["fingerprints"], "save"),
        ("xxh3-128 checksums, all tensors", costs["checksums"], "save"),
    ]:
        of = f"{m.median / save.median:.0%} of save, {m.median / restored.median:.0%} of restore"
        rows.append([name, *median_span(m.times), f"{gb / m.median:.2f}", of if share else ""])
    Report().publish(
        f"state: {gb:.2f} GB; machine: {machine()}; median of {args.repeats}\n"
        + table(["what", "median s", "min-max s", "GB/s", "share"], rows)
    )


if __name__ == "__main__":
    main()
