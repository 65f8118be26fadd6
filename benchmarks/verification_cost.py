"""What verification costs: fingerprints and checksums as a share of save and restore.

    python benchmarks/verification_cost.py [--mb 300] [--repeats 5]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile

import xxhash
from common import build_state, drop_page_cache, machine, state_bytes, table, timed

import unbroken as ub
from unbroken import fingerprint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mb", type=float, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    model, opt = build_state(args.mb)
    tensors = [p.detach() for p in model.parameters()]
    tensors += [t for s in opt.state.values() for t in s.values() if t.dim() > 0]
    nbytes = state_bytes(model, opt)
    root = tempfile.mkdtemp(prefix="ub-bench-")
    try:
        ckpt = ub.Checkpointer(root, model=model, optimizer=opt, keep_last=1)
        step = iter(range(1, 10_000))
        save = timed(lambda: ckpt.save(next(step)), args.repeats)
        fp = timed(lambda: [fingerprint.fingerprint(t) for t in tensors], args.repeats)
        xx = timed(
            lambda: [xxhash.xxh3_128_hexdigest(t.numpy().data) for t in tensors], args.repeats
        )
        restore = timed(
            lambda: ub.Checkpointer(root, model=model, optimizer=opt).restore(),
            args.repeats,
            setup=lambda: drop_page_cache([root]),
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)

    gb = nbytes / 1e9
    rows = []
    for name, (med, lo, hi), base in [
        ("save (sync, verified)", save, None),
        ("restore (cold, verified)", restore, None),
        ("fingerprints, all tensors", fp, save),
        ("xxh3-128 checksums, all tensors", xx, save),
    ]:
        share = f"{med / base[0]:.0%} of save" if base else ""
        rows.append(
            [name, f"{med:.3f}", f"{lo:.3f}-{hi:.3f}", f"{gb / med:.2f}", share]
        )
    print(f"state: {gb:.2f} GB; machine: {machine()}; median of {args.repeats}")
    print(table(["what", "median s", "min-max s", "GB/s", "share"], rows))


if __name__ == "__main__":
    main()
