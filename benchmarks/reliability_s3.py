"""The S3 reliability matrix: faults injected for real against moto's S3 server on
127.0.0.1, each scenario repeated, trials and failures printed as a table.

    python benchmarks/reliability_s3.py [--trials 3] [--junk 300]

Scenarios (docs/reliability.md, "The S3 matrix"):

- kill during a sync / async / overlap save: a process saving step after step is
  killed (``os._exit``) at a random instant; a fresh process restores. Failure: no step
  restored, not verified, or a state other than the one saved at the step it names.
- two jobs on one prefix: two runs save the same step, the second having listed the
  prefix before the first committed. Failure: both return, or the first's step is gone.
- kill during a re-save: killed between setting the old copy aside and committing the
  new one. Failure: the relaunch's restore does not get the step back, verified.
- a flipped byte in transit: one byte of a shard's download flipped. Failure: a restore
  that returns a state other than the one saved (it must fall back or refuse).
- junk keys: ``--junk`` garbage ``step_*/manifest.json`` keys newer than the sound step.
  Failure: the sound step is not restored (the time is printed).
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # the code of this checkout, in the children too
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

import unbroken as ub  # noqa: E402
from report import table  # noqa: E402
from s3_server import S3Server  # noqa: E402

SIZE = 256  # a Linear(SIZE, SIZE) trained by SGD on constant gradients: exact to replay


def _linear(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(SIZE, SIZE)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()


def _reference(steps: int) -> torch.nn.Module:
    model, opt = _linear(0)
    for _ in range(steps):
        _step(model, opt)
    return model


def _fresh(url: str) -> tuple[ub.Checkpointer, torch.nn.Module]:
    model, opt = _linear(99)
    return ub.Checkpointer(url, model=model, optimizer=opt), model


def _child(url: str, mode: str, delay: float) -> None:
    """The killed process (``--child``): saves step after step into ``url`` and is killed
    (``os._exit(9)``) ``delay`` seconds after its first save; ``resave``: killed between
    moving step 1 aside and committing its new copy."""
    from unbroken.storage import store_medium

    model, opt = _linear(0)
    how = {"sync": False, "async": True, "overlap": "overlap", "resave": False}[mode]
    ckpt = ub.Checkpointer(url, model=model, optimizer=opt, async_save=how)
    ckpt.restore()
    _step(model, opt)
    ckpt.save(1)
    ckpt.wait()
    if mode == "resave":
        store_medium.StoreMedium._put_manifest = lambda *a: os._exit(9)
        _step(model, opt)
        ckpt.save(1)
        os._exit(3)
    threading.Timer(delay, lambda: os._exit(9)).start()
    for k in range(2, 10_000):
        _step(model, opt)
        ckpt.save(k)
    os._exit(4)


def _restores_exactly(url: str, *, step: int | None = None) -> str | None:
    """None if a fresh process's restore() loads exactly the state saved at the step it
    names (``step``, if given), verified; else what went wrong."""
    ckpt, model = _fresh(url)
    try:
        report = ckpt.restore()
    except ub.CheckpointError as exc:
        return f"restore failed: {exc}"
    if not report.restored or not report.verified:
        return f"nothing restored or not verified: {report.step}"
    if step is not None and report.step != step:
        return f"restored step {report.step}, not {step}"
    ref = _reference(report.step)
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters(), strict=True))
    return None if same else f"step {report.step} restored other values"


def _url() -> str:
    return f"s3://ckpts/{uuid.uuid4().hex[:8]}/run"


def kill(mode: str, rng: random.Random) -> str | None:
    url, delay = _url(), f"{rng.uniform(0.0, 1.5):.3f}"
    command = [sys.executable, __file__, "--child", url, mode, delay]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if done.returncode != 9:
        return f"the child was not killed (exit {done.returncode}): {done.stderr[-500:]}"
    return _restores_exactly(url, step=1 if mode == "resave" else None)


def two_jobs(rng: random.Random) -> str | None:
    from unbroken.run.ownership import FolderClaim

    url = _url()
    first, _ = _fresh(url)
    second, _ = _fresh(url)
    first.restore()
    second.restore()
    check, errors, won = FolderClaim.check, [], []

    def paused(self, step, lineage):  # the second lists, then the first saves whole
        check(self, step, lineage)
        if self is second._run.claim and not errors and not won:
            try:
                first.save(step)
                won.append("first")
            except ub.CheckpointError as exc:
                errors.append(str(exc))

    FolderClaim.check = paused
    try:
        second.save(3)
        won.append("second")
    except ub.CheckpointError as exc:
        errors.append(str(exc))
    finally:
        FolderClaim.check = check
    if len(won) != 1 or len(errors) != 1 or "another save committed step 3" not in errors[0]:
        return f"saves returned: {won}; failed: {errors}"
    ckpt, _ = _fresh(url)
    report = ckpt.restore()
    return None if report.step == 3 and report.verified else f"step 3 lost: {report}"


def flipped_byte(rng: random.Random) -> str | None:
    from unbroken.storage import store_io

    url = _url()
    ckpt, model = _fresh(url)
    ckpt.save(1)  # a state whose values _reference(0) does not give: restore must refuse
    real, flipped = store_io.cat_range, []

    def flip(fs, key, start, end):
        data = real(fs, key, start, end)
        if "/rank_" in key and data and not flipped:
            at = rng.randrange(len(data))
            data = data[:at] + bytes([data[at] ^ 1 << rng.randrange(8)]) + data[at + 1 :]
            flipped.append(at)
        return data

    store_io.cat_range = flip
    try:
        again, loaded = _fresh(url)
        try:
            report = again.restore()
        except ub.CheckpointError:
            return None  # refused: the flip was caught
    finally:
        store_io.cat_range = real
    if not flipped:
        return "no byte was flipped"
    same = all(
        torch.equal(a, b) for a, b in zip(loaded.parameters(), model.parameters(), strict=True)
    )
    return None if report.restored and same else f"loaded a flipped byte: {report}"


def junk(rng: random.Random, count: int, timings: list[float]) -> str | None:
    url = _url()
    ckpt, model = _fresh(url)
    with torch.no_grad():
        for p, q in zip(model.parameters(), _reference(2).parameters(), strict=True):
            p.copy_(q)
    ckpt.save(2)
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    fs.pipe(
        {f"{root}/step_{99_000_000 + i:08d}/manifest.json": b"garbage" * 9 for i in range(count)}
    )
    start = time.perf_counter()
    failure = _restores_exactly(url, step=2)
    timings.append(time.perf_counter() - start)
    return failure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3, help="trials per scenario")
    parser.add_argument("--junk", type=int, default=300, help="junk keys per junk trial")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)  # URL MODE DELAY
    args = parser.parse_args()
    if args.child:
        _child(args.child[0], args.child[1], float(args.child[2]))
    rng = random.Random(args.seed)
    logging.getLogger("unbroken").setLevel(logging.ERROR)  # each junk key warns
    server = S3Server()
    server.bucket("ckpts")
    timings: list[float] = []
    scenarios = [
        ("kill during a sync save", lambda: kill("sync", rng)),
        ("kill during an async save", lambda: kill("async", rng)),
        ("kill during an overlap save", lambda: kill("overlap", rng)),
        ("two jobs on one prefix", lambda: two_jobs(rng)),
        ("kill during a re-save", lambda: kill("resave", rng)),
        ("a flipped byte in transit (download)", lambda: flipped_byte(rng)),
        (f"{args.junk} junk newer-step keys", lambda: junk(rng, args.junk, timings)),
    ]
    rows, first_failures, began = [], {}, time.perf_counter()
    with server.environment():
        for name, trial in scenarios:
            failures, start = [], time.perf_counter()
            for _ in range(args.trials):
                try:
                    failure = trial()
                except Exception as exc:  # a crash of the trial is a failure too
                    failure = f"{type(exc).__name__}: {exc}"
                if failure:
                    failures.append(failure)
            spent = time.perf_counter() - start
            rows.append([name, str(args.trials), str(len(failures)), f"{spent:.1f}"])
            first_failures.update({name: failures[0]} if failures else {})
    server.stop()
    print(table(["scenario", "trials", "failures", "seconds"], rows))
    for name, failure in first_failures.items():
        print(f"  {name}, first failure: {failure[:300]}")
    if timings:
        print(f"\njunk-key restores: {', '.join(f'{t:.1f} s' for t in timings)}")
    print(f"total {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
